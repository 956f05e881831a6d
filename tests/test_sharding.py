"""ppo.shard: the ppo stage over 2 gloo processes with its models sharded by FSDP2, against the same run
data-parallel (each process a whole copy): the weights, each process's bytes, a kill and a resume, two "machines"."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, error_line, set_params
from helpers import run
from safetensors.torch import load_file

TORCHRUN = str(Path(sys.executable).parent / "torchrun")  # accelerate's CPU launcher starts a single process
SHARDED = {"ppo.shard": True, "ppo.max_grad_norm": 1.0}  # clipping too: the norm is gathered over the shards


def torchrun(project: Path, *args: str) -> object:
    return run(project, TORCHRUN, "--nproc_per_node", "2", *args, "-m", "stages.ppo")


def weights(project: Path) -> dict[str, torch.Tensor]:
    folder = project / "models/policy"
    return load_file(folder / "model.safetensors") | load_file(folder / "value_head.safetensors")


@pytest.mark.slow
def test_sharded_run_trains_the_data_parallel_runs_weights(ppo_project: Path) -> None:
    set_params(ppo_project, **{"ppo.checkpoint_every": 0, "ppo.max_grad_norm": 1.0})
    result = torchrun(ppo_project)
    assert result.returncode == 0, result.stderr[-3000:]
    data_parallel = weights(ppo_project)
    set_params(ppo_project, **SHARDED)
    result = torchrun(ppo_project)
    assert result.returncode == 0, result.stderr[-3000:]
    sharded = weights(ppo_project)
    assert sharded.keys() == data_parallel.keys()
    for name, weight in sharded.items():
        torch.testing.assert_close(weight, data_parallel[name], rtol=1e-5, atol=1e-6, msg=name)
