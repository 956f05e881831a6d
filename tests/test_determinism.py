"""Same params + same seed -> the same bytes: `dvc repro` then `dvc repro --force` of the whole DAG (sft and reward
trained, ppo checkpointing) on tiny local models, on CPU, compared file by file. Only wall times may differ."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import dvc, set_params

OUTPUT_DIRS = ("models", "data/prompts", "data/pairs", "data/rollouts", "data/eval", "metrics")
# wall times and the machine's use while training (system_use.py) differ between runs; DVCLive nests "time/step"
# under "time"
WALL_TIME = re.compile(r"seconds|_per_s$|^(time|throughput)(/|$)|^system$")


def without_wall_times(value: object) -> object:
    if isinstance(value, dict):
        return {k: without_wall_times(v) for k, v in value.items() if not WALL_TIME.search(k)}
    return value


def snapshot(project: Path) -> dict[str, object]:
    """Every output file: JSON parsed without wall-time keys, wall-time curves left out, everything else as bytes."""
    files = {}
    for folder in OUTPUT_DIRS:
        for path in sorted((project / folder).rglob("*")):
            name = path.relative_to(project).as_posix()
            if not path.is_file() or re.search(r"plots/metrics/(time|throughput)/|/system\.csv$", name):
                continue
            files[name] = without_wall_times(json.loads(path.read_text())) if path.suffix == ".json" \
                else path.read_bytes()
    return files


@pytest.mark.slow
def test_repro_twice_gives_identical_outputs(project: Path, imdb_dir: Path, tokenizer_dir: Path) -> None:
    set_params(project, **{
        "data.source": str(imdb_dir), "model.tokenizer": str(tokenizer_dir),
        "prepare.train_prompts": 16, "prepare.eval_prompts": 8, "prepare.train_pairs": 32, "prepare.test_pairs": 8,
        "sft.enabled": True, "sft.n_layer": 1, "sft.n_embd": 32, "sft.n_head": 2, "sft.n_positions": 64,
        "sft.block_size": 32, "sft.batch_size": 8, "sft.max_tokens": 8 * 32 * 10, "sft.eval_reviews": 8,
        "reward.train": True, "reward.batch_size": 8, "reward.max_length": 32,
        "ppo.steps": 3, "ppo.batch_size": 4, "ppo.mini_batch_size": 2, "ppo.checkpoint_every": 2,
        "ppo.response_min_tokens": 2, "ppo.response_max_tokens": 6, "evaluate.batch_size": 8,
        "evaluate.examples": 2,
    })
    dvc(project, "repro")
    first = snapshot(project)
    assert {"models/sft/model.safetensors", "models/reward/model.safetensors", "models/policy/model.safetensors",
            "data/eval/samples.parquet", "metrics/eval.json"} <= set(first)
    assert [p.name for p in (project / "data/checkpoints/ppo").iterdir()] == ["step-000002"]  # the last, kept
    shutil.rmtree(project / "data/checkpoints")  # kept, they would end every training at once: train again
    dvc(project, "repro", "--force")
    second = snapshot(project)
    assert sorted(second) == sorted(first)
    assert [name for name in first if first[name] != second[name]] == []
