"""dvc.yaml, read by the code: the one place where a stage's dependencies, the params it reads and its outputs are
written. ``StagedOutputs.of`` writes a stage's outputs as dvc.yaml lists them, ``load_params(stage)`` lets the stage
read only the params dvc.yaml lists for it, checkpoints are keyed by them and ``--help`` prints them."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from ruamel.yaml import YAML

from rlhf.pipeline.errors import PipelineError

DVC_YAML = Path("dvc.yaml")


@dataclass(frozen=True)
class Wiring:
    """One stage of dvc.yaml: its ``deps`` (code and data), the ``params`` keys (a section name stands for all its
    keys) and its ``outputs`` (outs, metrics and plots)."""

    name: str
    deps: tuple[str, ...]
    params: tuple[str, ...]
    outputs: tuple[Path, ...]


def _entries(items: list | None) -> list[str]:
    """dvc.yaml list entries as strings: ``path`` or ``{path: {options}}``."""
    return [item if isinstance(item, str) else next(iter(item)) for item in items or []]


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
    """The stage ``name`` as ``dvc_yaml`` (default: ./dvc.yaml) declares it."""
    stages_ = stages(dvc_yaml)
    if name not in stages_:
        raise PipelineError(f"{dvc_yaml}: no stage {name!r} (stages: {', '.join(stages_)})")
    stage = stages_[name]
    outputs = [Path(p) for kind in ("outs", "metrics", "plots") for p in _entries(stage.get(kind))]
    return Wiring(name, tuple(_entries(stage.get("deps"))), tuple(_entries(stage.get("params"))), tuple(outputs))
