"""The ppo stage end to end on tiny local models: its outputs, 2-process data parallelism, and bad input."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import ROOT, build_tiny_gpt2, error_line, set_params, write_prompts
from helpers import eos_only_gpt2, run, write_pool
from transformers import AutoModelForCausalLM

from rlhf.pipeline import cli
from rlhf.pipeline.errors import DataError

ESTIMATORS = {  # TINY's batch_size 4: 2 prompts x 2 samples for the group estimators
    "gae": {},
    "rloo": {"ppo.advantage_estimator": "rloo", "ppo.samples_per_prompt": 2},
    "grpo": {"ppo.advantage_estimator": "grpo", "ppo.samples_per_prompt": 2, "ppo.kl_loss_coef": 0.04},
    "reinforce_pp": {"ppo.advantage_estimator": "reinforce_pp"},
}


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_outputs(ppo_project: Path, estimator: str) -> None:
    set_params(ppo_project, **ESTIMATORS[estimator])
    result = run(ppo_project)
    assert result.returncode == 0, result.stderr
    critic = estimator == "gae"
    policy = ppo_project / "models/policy"
    AutoModelForCausalLM.from_pretrained(policy)
    assert (policy / "tokenizer.json").exists()
    assert (policy / "value_head.safetensors").exists() == critic
    rollouts = pd.read_parquet(ppo_project / "data/rollouts")
    assert sorted(rollouts["step"].unique()) == [0, 1, 2] and len(rollouts) == 3 * 4
    assert sorted(p.name for p in (ppo_project / "data/rollouts").iterdir()) == [
        "steps-000000-000001.parquet", "steps-000002-000002.parquet"]
    assert rollouts["response_length"].between(1, 6).all()
    assert rollouts["value_mean"].isna().all() != critic
    k = ESTIMATORS[estimator].get("ppo.samples_per_prompt", 1)
    for _, step in rollouts.groupby("step"):
        queries = step["query"].tolist()
        assert all(len(set(queries[i: i + k])) == 1 for i in range(0, 4, k))  # a prompt's samples in a row
    curves = ppo_project / "metrics/ppo/plots/metrics"
    for curve in ("objective/scores", "objective/kl", "objective/kl_coef", "loss/policy", "policy/clipfrac"):
        assert len((curves / f"{curve}.tsv").read_text().splitlines()) == 1 + 3
    for curve in ("objective_fraction", "kl", "samples"):  # no pool: the objective plots' files, headers alone
        assert (curves / f"optimum/{curve}.tsv").read_text() == f"step\t{curve}\n"
    assert (curves / "loss/value.tsv").exists() == (curves / "val/mean.tsv").exists() == critic
    assert (curves / "val/returns.tsv").exists() == (estimator in ("gae", "reinforce_pp"))
    assert (curves / "loss/kl.tsv").exists() == (estimator == "grpo")
    ignored = (f"ppo: advantage_estimator {estimator} ignores ppo.value_model, ppo.vf_coef, ppo.cliprange_value, "
               "ppo.value_learning_rate")
    assert (ignored in result.stderr) != critic
    summary = json.loads((ppo_project / "metrics/ppo.json").read_text())["ppo"]
    assert summary["trained"] and summary["processes"] == 1


@pytest.mark.slow
def test_the_curve_measures_the_objective_on_the_pool_without_changing_the_run(ppo_project: Path) -> None:
    """With the optimum's pool, every rollout-log flush measures the objective's share on the pool's prompts against
    the samples trained on; the probe draws from its own seed and restores the run's random state, so the policy
    trained is the one trained without a pool."""
    from safetensors.torch import load_file

    set_params(ppo_project, **{"ppo.adap_kl_ctrl": False})
    assert run(ppo_project).returncode == 0
    without = load_file(ppo_project / "models/policy/model.safetensors")
    write_pool(ppo_project)
    result = run(ppo_project)
    assert result.returncode == 0, result.stderr
    with_probe = load_file(ppo_project / "models/policy/model.safetensors")
    assert all(torch.equal(without[name], with_probe[name]) for name in without)
    curves = ppo_project / "metrics/ppo/plots/metrics/optimum"
    samples = pd.read_csv(curves / "samples.tsv", sep="\t")
    assert samples["step"].tolist() == [2, 3] and samples["samples"].tolist() == [8, 12]  # flushes after 2 and 3 steps
    fractions = pd.read_csv(curves / "objective_fraction.tsv", sep="\t")["objective_fraction"]
    kl = pd.read_csv(curves / "kl.tsv", sep="\t")["kl"]
    assert len(fractions) == 2 and fractions.notna().all() and (kl > 0).all()


@pytest.mark.slow
def test_a_policy_whose_every_response_is_empty_is_said_once(ppo_project: Path, tiny_gpt2_dir: Path) -> None:
    """A policy that answers EOS at once: every response empty at every step, which ppo said nothing of."""
    set_params(ppo_project, **{"model.policy": str(eos_only_gpt2(tiny_gpt2_dir, ppo_project / "eos-only"))})
    result = run(ppo_project)
    assert result.returncode == 0, result.stderr
    assert (pd.read_parquet(ppo_project / "data/rollouts")["response"] == "").all()
    said = [line for line in result.stderr.splitlines() if "every response" in line]
    assert len(said) == 1 and said[0].startswith("ppo: step 0: every response is empty"), said


@pytest.mark.slow
def test_two_processes_on_cpu(ppo_project: Path) -> None:
    torchrun = Path(sys.executable).parent / "torchrun"  # accelerate's CPU launcher starts a single process
    result = run(ppo_project, str(torchrun), "--nproc_per_node", "2", "-m", "stages.ppo")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((ppo_project / "metrics/ppo.json").read_text())["ppo"]["processes"] == 2
    assert (ppo_project / "models/policy/model.safetensors").exists()

    # one process killed at its third step: the other's collective fails, or torchrun's SIGTERM reaches it first
    # (under load): either way one line, naming the checkpoint kept
    set_params(ppo_project, **{"ppo.learning_rate": 2e-5})  # another run: no result to reuse
    result = run(ppo_project, str(torchrun), "--nproc_per_node", "2", str(ROOT / "tests/fault.py"), "ppo", "--where",
                 r"ppo_trainer\.py:PPOTrainer\.step$", "--at", "3", "--kind", "kill", "--rank", "1")
    rank0 = [line for line in result.stderr.splitlines() if line.startswith(("error: ", "stopped by ", "[rank0]:"))]
    assert len(rank0) == 1 and re.fullmatch(r"(error: another process of this 2-process run died or failed \(.+\)|"
                                            r"stopped by SIGTERM( at "
                                            r"step \d+)?); checkpoint data/checkpoints/ppo/step-000001 kept; rerun to "
                                            r"resume", rank0[0]), rank0


def test_a_stop_that_arrives_while_an_error_is_told_adds_nothing_to_its_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """The losing order of the stop above, forced: a process is telling its error (there, the collective another
    process's death broke) when torchrun's SIGTERM reaches it, sent here from inside the telling. The line stays one
    line, its status the error's."""
    def main() -> None:
        raise DataError("data/prompts/train.parquet: too few prompts")

    def told_while_stopped(stage: str | None) -> str:
        os.kill(os.getpid(), signal.SIGTERM)
        return ""

    monkeypatch.setattr(sys, "argv", ["stages.ppo"])
    monkeypatch.setattr(cli, "under_dvc", told_while_stopped)
    handlers = {signum: signal.getsignal(signum) for signum in cli.STOP_SIGNALS}
    try:
        cli.run_stage(main)
    except BaseException as e:  # a Stopped raised by the signal would be a KeyboardInterrupt: caught, not let out
        outcome = e
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert isinstance(outcome, SystemExit) and outcome.code == 1, repr(outcome)
    assert capsys.readouterr().err == "error: data/prompts/train.parquet: too few prompts\n"


def test_response_longer_than_the_context(ppo_project: Path, tokenizer_dir: Path, tmp_path: Path) -> None:
    short = build_tiny_gpt2(tmp_path / "short", tokenizer_dir, n_positions=12)
    set_params(ppo_project, **{"model.policy": str(short), "ppo.response_max_tokens": 8})
    error_line(run(ppo_project), "ppo.response_max_tokens", "= 16 exceeds model.policy's 12 positions")
    assert not (ppo_project / "models/policy").exists()


def test_tokenizer_that_does_not_match_the_policy(ppo_project: Path, tokenizer_dir: Path, tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    small = tmp_path / "small-vocab"
    GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=64, n_embd=8, n_layer=1, n_head=1)).save_pretrained(small)
    set_params(ppo_project, **{"model.policy": str(small), "model.tokenizer": str(tokenizer_dir)})
    error_line(run(ppo_project), "model.tokenizer", "400 tokens but the model's embedding has only 50 rows")


def test_too_few_prompts_for_a_step(ppo_project: Path, tokenizer_dir: Path) -> None:
    write_prompts(ppo_project, tokenizer_dir, n=3)
    set_params(ppo_project, **ESTIMATORS["rloo"])  # 4 samples = 2 prompts x 2: 3 prompts are enough
    set_params(ppo_project, **{"ppo.steps": 1, "ppo.checkpoint_every": 0})
    assert run(ppo_project).returncode == 0
    set_params(ppo_project, **{"ppo.advantage_estimator": "gae", "ppo.samples_per_prompt": 1})
    error_line(run(ppo_project), "data/prompts/train.parquet", "3 prompts, fewer than the 4 a step needs")


def test_prompts_without_input_ids(ppo_project: Path) -> None:
    pq.write_table(pa.table({"query": ["a", "b"]}), ppo_project / "data/prompts/train.parquet")
    error_line(run(ppo_project), "data/prompts/train.parquet", "missing column 'input_ids'")
