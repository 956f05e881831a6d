"""``python -m stages.<stage> --help`` (or -h) prints what the stage reads and writes, params included, and runs
nothing."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.pipeline.cli import run_stage
from rlhf.pipeline.registry import stage as stage_record
from rlhf.pipeline.registry import stage_names
from rlhf.pipeline.schema import params_model
from rlhf.pipeline.sections import read_keys

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("stage", stage_names())
def test_help_lists_reads_params_and_writes_and_runs_nothing(stage: str, flag: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)  # no params.yaml here: running the stage would fail
    monkeypatch.setattr(sys, "argv", [f"stages/{stage}.py", flag])
    module = importlib.import_module(f"stages.{stage}")
    with pytest.raises(SystemExit) as exit_:
        run_stage(module.main)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m stages.{stage} [-h]\n\n{stage}: ")
    lines = out.splitlines()
    reads, writes, params = (next(i for i, line in enumerate(lines) if line.startswith(word))
                             for word in ("Reads ", "Writes ", "Params "))
    assert reads < writes < params
    listed = [line.split()[0] for line in lines[params + 1:] if line.startswith("  ") and line[2] != " "]
    assert listed == read_keys(params_model(), stage_record(stage).params)
    assert not list(tmp_path.iterdir())


def test_help_from_the_command_line() -> None:
    result = subprocess.run([sys.executable, "-m", "stages.ppo", "--help"], cwd=ROOT / "tests", capture_output=True,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert "prepare.prompt_max_tokens" in result.stdout and "Writes  models/policy/" in result.stdout


def test_the_recipe_runner_keeps_its_own_help(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from tools import recipe

    monkeypatch.setattr(sys, "argv", ["tools/recipe.py", "--help"])
    with pytest.raises(SystemExit) as exit_:
        run_stage(recipe.main)
    assert exit_.value.code == 0
    assert "--dry-run" in capsys.readouterr().out
