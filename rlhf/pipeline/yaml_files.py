"""Reading YAML as DVC reads params.yaml: every YAML the stages and tools read (params.yaml, presets, ``--set``
values) goes through here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ruamel.yaml import YAML, YAMLError

from rlhf.pipeline.errors import ParamsError


def read_yaml(path: Path | str) -> Any:
    """A YAML file as DVC reads it (see ``parse_yaml``). Every YAML the stages and the recipe runners read goes
    through here."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ParamsError(f"{path}: not found (run from the project root)") from None
    return parse_yaml(text, str(path))


def parse_yaml(text: str, where: str) -> Any:
    """YAML text as DVC reads params (ruamel.yaml's safe loader; DVC writes ``-S`` values back with ruamel too): YAML
    1.2, so ``1e-5``, ``5e-05``, ``3E-4``, ``.5`` and ``1_000`` are numbers, a quoted ``'5e-05'`` stays a string, and
    ``yes``/``on`` are strings, not booleans. ``where`` names the text in the one-line error."""
    try:
        return YAML(typ="safe").load(text)
    except YAMLError as e:
        problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
        line = f"line {mark.line + 1}: " if mark is not None else ""
        raise ParamsError(f"{where}: not valid YAML: {line}{problem or str(e).strip().splitlines()[0]}") from None
