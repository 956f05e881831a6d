"""What a pipeline stage is, declared once per stage in its own script (``STAGE = Stage(...)`` in stages/<name>.py).

A stage's name is its script's name. Its record says which params it reads, which files it reads besides its code,
what it writes (and how DVC keeps each output), what to lower when it runs out of GPU memory, the params section it
owns (``params.yaml``'s section of its name) and, for a stage that trains the evaluated policy, which output that
policy is (the stage's name is then a value of ``method``). Everything else follows from the records: the params
schema's sections and methods (rlhf/pipeline/schema.py), dvc.yaml's stages (``python -m tools.dvc_yaml`` writes them,
a test checks they are current), the code a stage depends on (the modules its script imports, found by reading the
imports), the policies evaluate reads, ``--help``, the staged outputs, the one-line errors, the checkpoint folder and
the checkpoint fingerprints. Adding a stage is adding its script (and its library code, its params.yaml section and
its docs): nothing else names it.
"""

from __future__ import annotations

import ast
import functools
import importlib
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rlhf.pipeline.paths import CHECKPOINTS_DIR
from rlhf.pipeline.sections import Section

ROOT = Path(__file__).resolve().parents[2]  # the project: stages/ and rlhf/ live here
CODE_PACKAGES = ("rlhf", "stages")  # the project's own code, the part of a stage's code DVC watches


@dataclass(frozen=True)
class Output:
    """One file or folder a stage writes. ``kind``: dvc.yaml's outs, metrics or plots; ``cache: False`` for small
    files kept in git (metrics, curves); ``plot``: the plot's x/y keys for a stage plot."""

    path: Path
    kind: Literal["outs", "metrics", "plots"] = "outs"
    cache: bool = True
    plot: dict[str, str] = field(default_factory=dict)
    comment: str = ""  # why, for dvc.yaml's reader


@dataclass(frozen=True)
class Stage:
    """A DVC stage: its script's module (``__spec__.name``, so the name is the file's), the params it reads (dotted
    keys, or a section for all of its keys), the files it reads besides its code, its outputs, the advice printed
    when it runs out of GPU memory, its own params section (a pydantic model, ``params.<name>``), the output that is
    the policy of ``method=<name>`` for a stage that trains one, and whether it reads every such policy
    (evaluate)."""

    module: str
    params: tuple[str, ...]
    inputs: tuple[Path, ...]
    outputs: tuple[Output, ...]
    out_of_memory: str | None = None
    section: type[Section] | None = None
    policy: Path | None = None
    reads_policies: bool = False

    def __post_init__(self) -> None:
        if self.policy is not None and self.policy not in self.output_paths:
            raise ValueError(f"{self.module}: policy {self.policy} is not one of its outputs")

    @property
    def name(self) -> str:
        return self.module.removeprefix("stages.")

    @property
    def output_paths(self) -> tuple[Path, ...]:
        """Every output, replaced together when the stage completes (rlhf/pipeline/io.py's StagedOutputs)."""
        return tuple(output.path for output in self.outputs)

    @property
    def deps(self) -> tuple[Path, ...]:
        """The files it reads besides its code: its inputs and, for a stage that reads policies, every policy."""
        return self.inputs + (tuple(policies().values()) if self.reads_policies else ())

    @property
    def checkpoints(self) -> Path:
        """Where its resumable checkpoints live (outside DVC's outputs: DVC deletes those before a rerun)."""
        return CHECKPOINTS_DIR / self.name

    @property
    def code(self) -> list[str]:
        """The project's modules the stage runs, as files relative to the project root, its script first."""
        script = f"stages/{self.name}.py"
        return [script, *sorted(imported_files(ROOT / script) - {script})]


def stage_names() -> list[str]:
    """Every script in stages/, in pipeline order: a stage comes after the stages whose outputs it reads."""
    names = sorted(path.stem for path in (ROOT / "stages").glob("*.py") if not path.stem.startswith("_"))
    producer = {output: name for name in names for output in stage(name).output_paths}
    trainers = {name for name in names if stage(name).policy is not None}
    after = {name: {producer[p] for p in stage(name).inputs if p in producer}
             | (trainers if stage(name).reads_policies else set()) for name in names}
    ordered: list[str] = []
    while len(ordered) < len(names):
        ordered.append(next(name for name in names if name not in ordered and after[name] <= set(ordered)))
    return ordered


@functools.cache
def stage(name: str) -> Stage:
    """The record of stage ``name`` (imports its script); KeyError for a name that is no stage."""
    if not (ROOT / "stages" / f"{name}.py").is_file() or name.startswith("_"):
        raise KeyError(f"{name!r} is not a pipeline stage")
    module = sys.modules.get("__main__")
    if getattr(getattr(module, "__spec__", None), "name", None) != f"stages.{name}":
        module = importlib.import_module(f"stages.{name}")
    return module.STAGE


def policies() -> dict[str, Path]:
    """{method: the policy its stage trains}, for every stage that trains one, in pipeline order (ppo: models/policy,
    dpo: models/dpo)."""
    return {name: record.policy for name in stage_names() if (record := stage(name)).policy is not None}


def _imports(path: Path) -> set[str]:
    """Dotted names ``path`` may import, in every form (``import a.b``, ``from a.b import c`` where ``c`` may be a
    module or a name, relative imports, imports inside functions)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = [*package[: len(package) - node.level + 1]] if node.level else []
            module = ".".join(parts + (node.module.split(".") if node.module else []))
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return names


def imported_files(script: Path) -> set[str]:
    """The project's module files ``script`` imports, directly or through other project modules (package
    ``__init__`` files are empty and left out)."""
    seen: set[str] = set()
    todo = [script]
    while todo:
        for name in _imports(todo.pop()):
            path = ROOT / (name.replace(".", "/") + ".py")
            if name.split(".")[0] in CODE_PACKAGES and path.is_file():
                relative = path.relative_to(ROOT).as_posix()
                if relative not in seen:
                    seen.add(relative)
                    todo.append(path)
    return seen
