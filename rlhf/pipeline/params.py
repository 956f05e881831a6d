"""params.yaml -> typed, validated, frozen ``Params`` (rlhf/pipeline/schema.py): the only config source of the
pipeline. Every stage calls ``load_params()`` first, before any data or model is loaded; a missing or unknown key, a
value of the wrong type or an impossible value raises ``ParamsError`` with one line naming the dotted key and the rule.
Overrides go through DVC (``dvc exp run -S ppo.learning_rate=1e-5``), not through a CLI layer.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rlhf.pipeline.errors import ParamsError
from rlhf.pipeline.messages import message
from rlhf.pipeline.registry import ROOT, stage
from rlhf.pipeline.schema import Params, params_model
from rlhf.pipeline.sections import Section, section_of
from rlhf.pipeline.yaml_files import read_yaml

PARAMS_FILE = "params.yaml"


def _check_keys(raw: Any, model: type[Section], prefix: str = "") -> None:
    """Unknown keys, then missing ones: params.yaml is DVC's cache key, so every key must be written out (the code has
    no defaults: a key left out would change results without DVC noticing). A missing key's message gives its doc."""
    if not isinstance(raw, dict):
        return  # validation names the wrong type
    known = model.model_fields
    for key in raw:
        if key not in known:
            raise ParamsError(f"params.yaml: {prefix}{key}: unknown key (known: {', '.join(sorted(known))})")
    for name, field in known.items():
        if name not in raw:
            what = "a section" if section_of(field) else " ".join((field.description or "").split())
            raise ParamsError(f"params.yaml: {prefix}{name}: missing (params.yaml is the DVC cache key: every key "
                              f"must be written out; {what})")
        if section := section_of(field):
            _check_keys(raw[name], section, f"{prefix}{name}.")


def parse_params(raw: Any, root: Path | str = ".") -> Params:
    """Validate a params mapping (as read from params.yaml) into ``Params``; relative paths resolve against root."""
    raw = {} if raw is None else raw
    model = params_model()
    _check_keys(raw, model)
    try:
        return model.model_validate(raw, context={"root": Path(root)})
    except ValidationError as e:
        raise ParamsError(message(e.errors()[0])) from None


def load_params(path: Path | str = PARAMS_FILE) -> Params:
    """Read and validate params.yaml (relative paths in it resolve against its folder)."""
    path = Path(path)
    return parse_params(read_yaml(path), path.parent)


@functools.cache
def defaults() -> Params:
    """The project's own params.yaml, the one place defaults are written (for tests, benchmarks and tools that start
    from the defaults)."""
    return load_params(ROOT / PARAMS_FILE)


def stage_params(params: Params, name: str, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """The values of the params stage ``name`` reads, as {dotted key: value} (JSON-ready), minus ``exclude``."""
    values = {}
    for entry in stage(name).params:
        value: Any = params
        for name in entry.split("."):
            value = getattr(value, name)
        if isinstance(value, Section):
            values |= {f"{entry}.{key}": v for key, v in value.model_dump().items()}
        else:
            values[entry] = value
    return {key: value for key, value in values.items() if key not in set(exclude)}
