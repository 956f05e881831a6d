"""dvc.yaml, read by the code: the one place where a stage's deps, the params it reads and its outputs are written.
``StagedOutputs.of`` writes the outputs it lists, ``load_params(stage)`` lets the stage read only the params it lists,
checkpoints are keyed by them and ``--help`` prints them."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from ruamel.yaml import YAML

from rlhf.pipeline.errors import PipelineError

DVC_YAML = Path("dvc.yaml")


@dataclass(frozen=True)
class Wiring:
    """One stage of dvc.yaml: ``deps`` (code and data), ``params`` (a section name stands for all its keys),
    ``outputs`` (its outs, metrics and plots) and ``metrics`` (its metrics files, outputs too)."""

    name: str
    deps: tuple[str, ...]
    params: tuple[str, ...]
    outputs: tuple[Path, ...]
    metrics: tuple[Path, ...]


@functools.cache
def _stages(path: Path, mtime: int) -> dict:
    return YAML(typ="safe").load(path.read_text(encoding="utf-8"))["stages"]


def stages(dvc_yaml: Path = DVC_YAML) -> dict:
    """dvc.yaml's ``stages:`` mapping, in pipeline order."""
    path = dvc_yaml.resolve()
    if not path.is_file():
        raise PipelineError(f"{dvc_yaml}: not found (run from the project root)")
    return _stages(path, path.stat().st_mtime_ns)


def wiring(name: str, dvc_yaml: Path = DVC_YAML) -> Wiring:
    """The stage ``name`` as ``dvc_yaml`` declares it."""
    if name not in (every := stages(dvc_yaml)):
        raise PipelineError(f"{dvc_yaml}: no stage {name!r} (stages: {', '.join(every)})")

    def entries(kind: str) -> list[str]:  # ``path`` or ``{path: {options}}``
        return [item if isinstance(item, str) else next(iter(item)) for item in every[name].get(kind) or []]

    return Wiring(name, tuple(entries("deps")), tuple(entries("params")),
                  tuple(Path(p) for kind in ("outs", "metrics", "plots") for p in entries(kind)),
                  tuple(Path(p) for p in entries("metrics")))
