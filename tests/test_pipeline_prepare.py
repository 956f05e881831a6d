"""The prepare stage as users run it: outputs and metrics, failures that write nothing, DVC caching and staleness."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import dvc, make_split, set_params

from rlhf.data.imdb import load_imdb
from rlhf.pipeline.cli import run_stage
from stages import prepare

OUTPUTS = ["data/prompts/train.parquet", "data/prompts/eval.parquet", "data/pairs/train.parquet",
           "data/pairs/test.parquet", "metrics/prepare.json"]


def configure(project: Path, source: Path | str, tokenizer_dir: Path, policy: Path | str, **extra: object) -> None:
    set_params(project, **{"data.source": str(source), "model.tokenizer": str(tokenizer_dir),
                           "model.policy": str(policy), "prepare.eval_prompts": 20, "prepare.train_pairs": 30,
                           "prepare.test_pairs": 10, **extra})


def test_stage_outputs(project: Path, imdb_dir: Path, tokenizer_dir: Path) -> None:
    # a policy id that cannot load offline: prepare needs only the tokenizer
    configure(project, imdb_dir, tokenizer_dir, "nobody/no-such-model")
    started = time.perf_counter()  # a fresh interpreter (not run_cli's fork): its times count from its own start
    result = subprocess.run([sys.executable, "-m", "stages.prepare"], cwd=project, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(project)})
    wall = time.perf_counter() - started
    assert result.returncode == 0, result.stderr

    train = pq.read_table(project / "data/prompts/train.parquet")
    assert train.schema == pa.schema([("query", pa.string()), ("input_ids", pa.list_(pa.int32())),
                                      ("review_id", pa.string()), ("label", pa.int64())])
    long_reviews = sum(len(t) > 200 for t in pd.read_parquet(imdb_dir / "train.parquet")["text"])
    assert train.num_rows == long_reviews
    assert pq.read_table(project / "data/prompts/eval.parquet").num_rows == 20
    pairs_test = pd.read_parquet(project / "data/pairs/test.parquet")
    test_ids = set(load_imdb(str(imdb_dir), None, ["test"])["test"]["review_id"])
    assert len(pairs_test) == 10 and set(pairs_test["chosen_id"]) | set(pairs_test["rejected_id"]) <= test_ids
    assert list(pairs_test.dtypes.astype(str)[4:]) == ["int64", "int64"]

    metrics = json.loads((project / "metrics/prepare.json").read_text())["prepare"]
    assert metrics["reviews_read"] == {"train": 200, "test": 120}
    assert metrics["reviews_kept"]["train"] == long_reviews
    assert metrics["prompts"] == {"train": long_reviews, "eval": 20} and metrics["pairs"] == {"train": 30, "test": 10}
    assert set(metrics["prompt_tokens"]) == {str(n) for n in range(2, 9)}
    assert sum(metrics["prompt_tokens"].values()) == long_reviews and 2 < metrics["prompt_tokens_mean"] < 8
    # the stage's own time, within the process's; to 0.1 s, so a tiny prepare on a fast CPU reads 0.0
    assert 0 <= metrics["seconds"] <= wall
    # the process's time from its start to its outputs going in: all of it but the interpreter's start and exit
    seconds = [metrics[f"time/{part}"] for part in ("setup", "steps", "teardown")]
    # setup (imports, reading) and steps do work; teardown (files moving in) can round to 0.00
    assert seconds[0] > 0 and seconds[1] > 0 and seconds[2] >= 0 and 0.5 * wall < sum(seconds) <= wall, (seconds, wall)
    log = result.stderr.splitlines()
    assert f"data.source: {imdb_dir} is outside data/raw/, so editing it will not rerun prepare " \
           "(copy it under data/raw/)" in log
    assert any(line.startswith(f"prepare: kept {{'train': {long_reviews}, 'test': ") and line.endswith(" s")
               for line in log)


def run_in_process(project: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> str:
    """run_stage(main) as ``python -m stages.prepare`` runs it, minus the interpreter start; the error line or ''."""
    monkeypatch.chdir(project)
    monkeypatch.setattr(sys, "argv", [prepare.__file__])  # pytest's own arguments are not the stage's
    try:
        run_stage(prepare.main)
    except SystemExit as e:
        assert e.code == 1
        return capsys.readouterr().err.splitlines()[-1]
    return ""


def test_bad_data_writes_nothing(project: Path, imdb_dir: Path, tokenizer_dir: Path, tiny_gpt2_dir: Path,
                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    make_split(10, seed=1).to_parquet(bad / "train.parquet")
    frame = make_split(10, seed=2)
    frame.loc[3, "label"] = 2
    frame.to_parquet(bad / "test.parquet")
    configure(project, bad, tokenizer_dir, tiny_gpt2_dir)
    assert run_in_process(project, monkeypatch, capsys) == (
        f"error: {bad}/test.parquet: row 3: label 2 is not one of [0, 1] or positive/negative (1 such rows)")
    assert not [name for name in OUTPUTS if (project / name).exists()]

    # after a good run, a failing one keeps the previous outputs whole and leaves no temporaries
    configure(project, imdb_dir, tokenizer_dir, tiny_gpt2_dir)
    assert run_in_process(project, monkeypatch, capsys) == ""
    before = {name: (project / name).read_bytes() for name in OUTPUTS}
    configure(project, imdb_dir, tokenizer_dir, tiny_gpt2_dir, **{"prepare.min_review_chars": 100_000})
    assert run_in_process(project, monkeypatch, capsys).startswith(
        f"error: {imdb_dir} [train]: no review is longer than prepare.min_review_chars=100000 characters")
    assert {name: (project / name).read_bytes() for name in OUTPUTS} == before
    assert not list((project / "data").rglob("*.tmp")) and not list((project / "metrics").rglob("*.tmp"))

    # more prompts than reviews pass the filter: refused before any tokenizing, not capped with a log line (the params
    # would name prompts the outputs do not have)
    for key, split in (("eval_prompts", "test"), ("train_prompts", "train")):
        configure(project, imdb_dir, tokenizer_dir, tiny_gpt2_dir, **{f"prepare.{key}": 100_000,
                                                                   "prepare.min_review_chars": 200})
        assert re.fullmatch(rf"error: prepare.{key}: 100000 prompts asked, but only \d+ {split} reviews of "
                            rf"{re.escape(str(imdb_dir))} pass prepare.min_review_chars",
                            run_in_process(project, monkeypatch, capsys))
        assert {name: (project / name).read_bytes() for name in OUTPUTS} == before
    set_params(project, **{"prepare.train_prompts": None})

    # the same params and seed give the same bytes
    configure(project, imdb_dir, tokenizer_dir, tiny_gpt2_dir, **{"prepare.min_review_chars": 200})
    assert run_in_process(project, monkeypatch, capsys) == ""
    assert all((project / name).read_bytes() == before[name] for name in OUTPUTS[:4])


def test_dvc_repro_caching_and_staleness(project: Path, imdb_dir: Path, tokenizer_dir: Path,
                                         tiny_gpt2_dir: Path) -> None:
    raw = project / "data/raw/imdb"
    shutil.copytree(imdb_dir, raw)
    configure(project, "data/raw/imdb", tokenizer_dir, tiny_gpt2_dir)
    first = dvc(project, "repro", "prepare")
    assert "outside data/raw/" not in first.stderr + first.stdout
    assert all((project / name).exists() for name in OUTPUTS)
    assert "Stage 'prepare' didn't change, skipping" in dvc(project, "repro", "prepare").stdout

    set_params(project, **{"ppo.init_kl_coef": 0.05, "ppo.steps": 3, "evaluate.batch_size": 3})
    assert "prepare" not in dvc(project, "status", "prepare").stdout

    frame = pd.read_parquet(raw / "train.parquet")
    frame.loc[0, "text"] += " An edited review that is now surely long enough to pass the filter." * 5
    frame.to_parquet(raw / "train.parquet")
    status = dvc(project, "status", "prepare").stdout
    assert "prepare:" in status and "modified:           data/raw" in status
    before = pq.read_table(project / "data/prompts/train.parquet").num_rows
    dvc(project, "repro", "prepare")
    assert pq.read_table(project / "data/prompts/train.parquet").num_rows == before + 1
