"""``python -m stages.<stage> --help`` (or -h) prints what the stage reads and writes and the params dvc.yaml lists
for it, without loading a model or running anything; a switched-off stage loads no model either."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, set_params
from helpers import TRAINING, run_cli

from rlhf.pipeline.params import expand
from rlhf.pipeline.wiring import stages, wiring
from stages import SEVERAL_PROCESSES, stage_help


@pytest.mark.parametrize("stage", list(stages(ROOT / "dvc.yaml")))
def test_help_lists_reads_writes_and_the_params_dvc_yaml_lists(stage: str) -> None:
    out = stage_help(stage, ROOT)
    assert out.startswith(f"usage: python -m stages.{stage} [-h]\n\n{stage}: ")
    lines = out.splitlines()
    reads, writes, params = (next(i for i, line in enumerate(lines) if line.startswith(word))
                             for word in ("Reads ", "Writes ", "Params "))
    assert reads < writes < params
    listed = [line.split()[0] for line in lines[params + 1:] if line.startswith("  ") and line[2] != " "]
    assert listed == expand(wiring(stage, ROOT / "dvc.yaml").params)


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_from_the_command_line_anywhere_loads_nothing(flag: str, tmp_path: Path) -> None:
    """From a folder with no params.yaml (running the stage would fail), with transformers made unimportable: the
    help is the stages package's, before the stage's own imports (no model or tokenizer can load)."""
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text("raise ImportError('no transformers for --help')\n")
    result = subprocess.run([sys.executable, "-m", "stages.ppo", flag], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
    assert result.returncode == 0, result.stderr
    assert "prepare.prompt_max_tokens" in result.stdout and "Writes  models/policy/" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["transformers"]


@pytest.mark.parametrize("stage", [s for s in stages(ROOT / "dvc.yaml") if s not in SEVERAL_PROCESSES])
def test_a_one_process_stage_started_as_several_stops_in_one_line_before_loading_anything(stage: str,
                                                                                          tmp_path: Path) -> None:
    """torchrun or accelerate launch (WORLD_SIZE 2) on a stage that does not share its work: each process would train
    alone and write the same outputs. From a folder with no params.yaml and transformers unimportable: it stops
    before either matters, the first process saying so, the other silent."""
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text("raise ImportError('the stage must stop before this')\n")
    for rank in ("0", "1"):
        result = subprocess.run([sys.executable, "-m", f"stages.{stage}"], cwd=tmp_path, capture_output=True,
                                text=True, env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}",
                                                "WORLD_SIZE": "2", "RANK": rank})
        assert result.returncode == 1, result.stderr
        said = (f"error: stages.{stage} runs as one process, but its launcher started 2 (WORLD_SIZE): run python -m "
                f"stages.{stage}; only ppo runs over several (docs/gpu.md)\n")
        assert result.stderr == ("" if rank == "1" else said)


def test_a_switched_off_stage_writes_its_marker_without_loading_torch(project: Path) -> None:
    """Every stage whose help says it can write only a DISABLED marker, switched off (the default params and method
    best_of_n switch off all of them), writes it with torch and transformers made unimportable: it decides from its
    params before loading them (their imports took seconds a stage)."""
    for module in ("torch", "transformers"):
        (project / module).mkdir()
        (project / module / "__init__.py").write_text(f"raise ImportError('a switched-off stage loads no {module}')\n")
    set_params(project, method="best_of_n")
    switchable = [stage for stage in stages(ROOT / "dvc.yaml") if "DISABLED marker" in stage_help(stage, ROOT)]
    assert len(switchable) >= 7, switchable
    for stage in switchable:
        result = run_cli(project, stage)
        assert result.returncode == 0, result.stderr
        assert re.fullmatch(rf"{stage}: done in \d+\.\d s", result.stderr.strip().splitlines()[-1]), result.stderr
        assert [out for out in wiring(stage, project / "dvc.yaml").outputs if not (project / out).exists()] == []


# a sitecustomize that makes one module unimportable in the process it starts in
REFUSE = """import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == {name!r}:
            raise ImportError("a tokenizer-only stage imports no model classes")
sys.meta_path.insert(0, Refuse())
"""


def test_the_stages_that_load_only_a_tokenizer_never_import_transformers_modeling_layer(
        project: Path, imdb_dir: Path, tokenizer_dir: Path, tmp_path: Path) -> None:
    """prepare and tokenize (SFT on, so that tokenize writes ids) with ``transformers.modeling_utils`` made
    unimportable: importing it costs seconds of CPU in every stage process, and these two load a tokenizer only."""
    (tmp_path / "refuse").mkdir()
    (tmp_path / "refuse" / "sitecustomize.py").write_text(REFUSE.format(name="transformers.modeling_utils"))
    set_params(project, **{"data.source": str(imdb_dir), "model.tokenizer": str(tokenizer_dir),
                           "prepare.train_prompts": 8, "prepare.eval_prompts": 4, "prepare.train_pairs": 8,
                           "prepare.test_pairs": 4, **TRAINING["sft"]})
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'refuse'}{os.pathsep}{project}"}
    for stage in ("prepare", "tokenize"):
        result = subprocess.run([sys.executable, "-m", f"stages.{stage}"], cwd=project, env=env, capture_output=True,
                                text=True)
        assert result.returncode == 0, result.stderr[-3000:]
        assert [out for out in wiring(stage, project / "dvc.yaml").outputs if not (project / out).exists()] == []
    assert (project / "data/tokens/train.npy").exists()  # ids, not the switched-off marker
    refused = subprocess.run([sys.executable, "-c", "import transformers.modeling_utils"], env=env,
                             capture_output=True, text=True)
    assert "imports no model classes" in refused.stderr  # the refusal works: this test can fail


def test_the_recipe_runner_keeps_its_own_help() -> None:
    result = subprocess.run([sys.executable, "-m", "tools.recipe", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("usage: python -m tools.recipe")
    assert "--dry-run" in result.stdout
