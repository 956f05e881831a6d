"""The ppo stage end to end on tiny local models: its outputs, 2-process data parallelism, and bad input."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import build_tiny_gpt2, set_params
from helpers import run
from transformers import AutoModelForCausalLM


@pytest.mark.slow
def test_outputs(ppo_project: Path) -> None:
    result = run(ppo_project)
    assert result.returncode == 0, result.stderr
    policy = ppo_project / "models/policy"
    AutoModelForCausalLM.from_pretrained(policy)
    assert (policy / "value_head.safetensors").exists() and (policy / "tokenizer.json").exists()
    rollouts = pd.read_parquet(ppo_project / "data/rollouts")
    assert sorted(rollouts["step"].unique()) == [0, 1, 2] and len(rollouts) == 3 * 4
    assert sorted(p.name for p in (ppo_project / "data/rollouts").iterdir()) == [
        "steps-000000-000001.parquet", "steps-000002-000002.parquet"]
    assert rollouts["response_length"].between(1, 6).all()
    for curve in ("objective/scores", "objective/kl", "objective/kl_coef", "loss/policy", "policy/clipfrac"):
        assert len((ppo_project / f"metrics/ppo/plots/metrics/{curve}.tsv").read_text().splitlines()) == 1 + 3
    summary = json.loads((ppo_project / "metrics/ppo.json").read_text())
    assert summary["steps"] == 3 and summary["processes"] == 1


@pytest.mark.slow
def test_two_processes_on_cpu(ppo_project: Path) -> None:
    torchrun = Path(sys.executable).parent / "torchrun"  # accelerate's CPU launcher starts a single process
    result = run(ppo_project, str(torchrun), "--nproc_per_node", "2", "-m", "stages.ppo")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((ppo_project / "metrics/ppo.json").read_text())["processes"] == 2
    assert (ppo_project / "models/policy/model.safetensors").exists()


def test_response_longer_than_the_context(ppo_project: Path, tokenizer_dir: Path, tmp_path: Path) -> None:
    short = build_tiny_gpt2(tmp_path / "short", tokenizer_dir, n_positions=12)
    set_params(ppo_project, **{"model.policy": str(short), "ppo.response_max_tokens": 8})
    result = run(ppo_project)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "error: ppo.response_max_tokens: prompt_max_tokens + response_max_tokens = 16 exceeds model.policy's 12 "
        "positions")
    assert not (ppo_project / "models/policy").exists()


def test_tokenizer_that_does_not_match_the_policy(ppo_project: Path, tokenizer_dir: Path, tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    small = tmp_path / "small-vocab"
    GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=64, n_embd=8, n_layer=1, n_head=1)).save_pretrained(small)
    set_params(ppo_project, **{"model.policy": str(small), "model.tokenizer": str(tokenizer_dir)})
    result = run(ppo_project)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "error: model.tokenizer: the tokenizer has 400 tokens but the model's embedding has only 50 rows "
        "(tokenizer and model do not belong together)")


def test_prompts_without_input_ids(ppo_project: Path) -> None:
    pq.write_table(pa.table({"query": ["a", "b"]}), ppo_project / "data/prompts/train.parquet")
    result = run(ppo_project)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "error: data/prompts/train.parquet: missing column 'input_ids' (columns: query)")
