"""The preset runner validates the overlaid params before anything runs and passes each key to dvc exp run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stages.recipe import flatten, overlay

ROOT = Path(__file__).resolve().parents[1]


def run_recipe(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stages.recipe", *args], cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": ""})


def test_flatten_and_overlay() -> None:
    changes = {"ppo": {"steps": 2, "kl_penalty": "full"}, "seed": 3}
    assert flatten(changes) == {"ppo.steps": 2, "ppo.kl_penalty": "full", "seed": 3}
    base = {"seed": 0, "ppo": {"steps": 194, "batch_size": 128}}
    assert overlay(base, changes) == {"seed": 3, "ppo": {"steps": 2, "batch_size": 128, "kl_penalty": "full"}}
    assert base["ppo"]["steps"] == 194


@pytest.mark.parametrize("preset", sorted(p.stem for p in (ROOT / "presets").glob("*.yaml")))
def test_shipped_presets_are_valid(preset: str, tmp_path: Path, imdb_dir: Path, tokenizer_dir: Path) -> None:
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / f"{preset}.yaml").write_text((ROOT / "presets" / f"{preset}.yaml").read_text())
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    result = run_recipe(tmp_path, preset, "--imdb", str(imdb_dir), "--tokenizer", str(tokenizer_dir), "--dry-run")
    assert result.returncode == 0, result.stderr
    command = result.stdout.strip().splitlines()[-1]
    assert command.startswith("dvc exp run -S ")
    for key, value in flatten(yaml.safe_load((ROOT / "presets" / f"{preset}.yaml").read_text())).items():
        assert f"-S {key}=" in command
        if value == "data/raw/imdb":
            assert (tmp_path / value / "train.parquet").exists()


def test_a_bad_preset_fails_before_running(tmp_path: Path) -> None:
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "broken.yaml").write_text("ppo:\n  batch_size: -1\n")
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    result = run_recipe(tmp_path, "broken", "--dry-run")
    assert result.returncode == 1
    assert result.stderr.strip() == "error: params.yaml: ppo.batch_size: must be > 0 (got -1)"
    result = run_recipe(tmp_path, "nope", "--dry-run")
    assert result.stderr.strip() == "error: presets/nope.yaml: no such preset (known: broken)"
