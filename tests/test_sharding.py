"""ppo.shard: the ppo stage over 2 gloo processes with its models sharded by FSDP2, against the same run
data-parallel (each process a whole copy): the weights, each process's bytes, a kill and a resume, two "machines"."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, error_line, set_params
from helpers import run, write_pool
from safetensors.torch import load_file

from bench.sizing import optimizer_held_bytes
from rlhf.train import sharding

TORCHRUN = str(Path(sys.executable).parent / "torchrun")  # accelerate's CPU launcher starts a single process
SHARDED = {"ppo.shard": True, "ppo.max_grad_norm": 1.0}  # clipping too: the norm is gathered over the shards


def torchrun(project: Path, *args: str) -> object:
    return run(project, TORCHRUN, "--nproc_per_node", "2", *args, "-m", "stages.ppo")


def weights(project: Path) -> dict[str, torch.Tensor]:
    folder = project / "models/policy"
    return load_file(folder / "model.safetensors") | load_file(folder / "value_head.safetensors")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sharded_run_against_the_data_parallel_one_and_after_a_kill(ppo_project: Path) -> None:
    """3 steps sharded give the 2-process data-parallel run's weights, each process holding half the bytes; killed
    at its third step, the sharded run resumes from its checkpoint to the same weights."""
    # fp32: under bf16 autocast on a Xeon with AMX the two runs' weights part beyond the tolerance
    set_params(ppo_project, **{"ppo.max_grad_norm": 1.0, "model.precision": "fp32"})
    result = torchrun(ppo_project)
    assert result.returncode == 0, result.stderr[-3000:]
    data_parallel = weights(ppo_project)
    replicated = json.loads((ppo_project / "metrics/ppo.json").read_text())["ppo"]["weights_and_optimizer_bytes"]
    set_params(ppo_project, **SHARDED)
    result = torchrun(ppo_project)
    assert result.returncode == 0, result.stderr[-3000:]
    sharded = weights(ppo_project)
    assert sharded.keys() == data_parallel.keys()
    for name, weight in sharded.items():
        torch.testing.assert_close(weight, data_parallel[name], rtol=1e-5, atol=1e-6, msg=name)
    held = json.loads((ppo_project / "metrics/ppo.json").read_text())["ppo"]["weights_and_optimizer_bytes"]
    # half of every weight and moment, give or take the rows an odd dimension leaves to one process
    assert 0.4 < held / replicated < 0.65, (held, replicated)
    # bench/sizing.py's count of them: 3 fp32 copies (weight, 2 AdamW moments) of every trained parameter
    trained = sum(weight.numel() for weight in sharded.values())
    assert replicated == pytest.approx(optimizer_held_bytes(trained), rel=0.03)

    # rank 1 killed at its third step: the checkpoint after the second (every rank's shards) is kept
    (ppo_project / "models/policy/model.safetensors").unlink()
    for old in (ppo_project / "data/checkpoints/ppo").iterdir():  # the finished run's: it would end at once
        old.rename(old.with_name(".gone"))
    result = run(ppo_project, TORCHRUN, "--nproc_per_node", "2", str(ROOT / "tests/fault.py"), "ppo", "--where",
                 r"ppo_trainer\.py:PPOTrainer\.step$", "--at", "3", "--kind", "kill", "--rank", "1")
    assert result.returncode != 0
    assert (ppo_project / "data/checkpoints/ppo/step-000001/.metadata").is_file()  # every rank's shards, DCP's
    result = torchrun(ppo_project)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming after step 1" in result.stderr
    resumed = weights(ppo_project)
    for name, weight in sharded.items():
        torch.testing.assert_close(resumed[name], weight, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_two_machines_over_a_rendezvous(ppo_project: Path) -> None:
    """Two "machines" of one process each, meeting at a rendezvous on 127.0.0.1, as docs/gpu.md's multi-node
    command runs on each node; a separate critic sharded beside the policy, the full KL (the reference's head in the
    policy's forward) and the curve's probe on a pool."""
    import subprocess

    import pandas as pd
    from conftest import project_env

    write_pool(ppo_project)
    set_params(ppo_project, **SHARDED, **{"ppo.checkpoint_every": 0, "ppo.steps": 2, "ppo.value_model": "separate",
                                          "ppo.kl_penalty": "full"})
    endpoint = f"127.0.0.1:{free_port()}"
    command = [TORCHRUN, "--nnodes", "2", "--nproc_per_node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
               endpoint, "--rdzv-id", "ppo", "-m", "stages.ppo"]
    nodes = [subprocess.Popen(command, cwd=ppo_project, env=project_env(ppo_project), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [node.communicate(timeout=600) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], [err[-3000:] for _, err in outputs]
    assert json.loads((ppo_project / "metrics/ppo.json").read_text())["ppo"]["processes"] == 2
    assert any(name.startswith("critic.") for name in weights(ppo_project))  # gathered whole from both machines
    curve = ppo_project / "metrics/ppo/plots/metrics/optimum/objective_fraction.tsv"
    assert pd.read_csv(curve, sep="\t")["objective_fraction"].notna().sum() == 1  # after the last step


def test_sharding_in_one_process_is_refused(ppo_project: Path) -> None:
    set_params(ppo_project, **SHARDED)
    error_line(run(ppo_project), "ppo.shard", "runs as one process")
    assert not (ppo_project / "models/policy").exists()


def test_sharding_under_lora_is_refused(ppo_project: Path) -> None:
    set_params(ppo_project, **SHARDED, **{"model.lora.r": 2})
    error_line(run(ppo_project), "params.yaml", "ppo.shard: must be false with model.lora.r > 0")


@pytest.mark.slow
def test_dvc_repro_runs_the_sharded_stage_through_its_launcher(ppo_project: Path) -> None:
    """``cmd: torchrun ...`` in dvc.yaml, as docs/gpu.md says: DVC records the main process's outputs."""
    from conftest import dvc

    set_params(ppo_project, **SHARDED, **{"ppo.checkpoint_every": 0, "ppo.steps": 2})
    for output in ("models/sft", "models/reward", "data/optimum"):  # off: their markers
        if not (ppo_project / output).exists():
            (ppo_project / output).mkdir(parents=True)
            (ppo_project / output / "DISABLED").write_text(f"{output} is off\n")
    wired = (ppo_project / "dvc.yaml").read_text()
    (ppo_project / "dvc.yaml").write_text(wired.replace("cmd: python -m stages.ppo",
                                                        "cmd: torchrun --nproc_per_node 2 -m stages.ppo"))
    dvc(ppo_project, "repro", "-s", "ppo")
    assert json.loads((ppo_project / "metrics/ppo.json").read_text())["ppo"]["processes"] == 2
    assert "models/policy" in (ppo_project / "dvc.lock").read_text()


@pytest.mark.parametrize("processes", [1, 2])
def test_a_launchers_process_leaves_without_the_interpreters_teardown(processes: int, tmp_path: Path) -> None:
    """Done, one of a launcher's processes (WORLD_SIZE > 1) exits 0 before the teardown, where the threads of a gloo
    group that FSDP2's mesh keeps alive can abort it; a lone process keeps the teardown (here, an abort)."""
    import subprocess

    script = tmp_path / "stage.py"
    script.write_text("import os\nfrom rlhf.pipeline.cli import run_stage\n\n\nclass AbortsAtTeardown:\n"
                      "    def __del__(self):\n        os.abort()\n\n\n"
                      "kept = AbortsAtTeardown()\nrun_stage(lambda: print('trained', flush=True))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": str(processes)}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env)
    assert result.stdout == "trained\n"
    assert result.returncode == (0 if processes > 1 else -signal.SIGABRT), result.stderr


def test_the_root_is_fixed_through_fsdp2s_private_state() -> None:
    """make_root reaches into FSDP2's private state: in one process, a model whose block's forward runs first keeps
    the model as its root (this fails when torch moves that state)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        fully_shard(model[0])
        fully_shard(model)
        sharding.make_root(model)
        model[0](torch.ones(1, 4))  # a block's forward first, as the rollout's
        assert model._get_fsdp_state()._is_root and not model[0]._get_fsdp_state()._is_root
    finally:
        dist.destroy_process_group()
