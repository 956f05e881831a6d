"""The preset runner validates the overlaid params before anything runs and passes each key to dvc exp run, spelled
so that DVC writes back the same value and type, and every shipped preset gets through a real ``dvc exp run``."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, dvc, error_line, set_params

from rlhf.pipeline.errors import ParamsError
from rlhf.pipeline.params import load_params, read_yaml
from tools.presets import as_override, flatten, load_preset, local_inputs, overlay, untracked_inputs

PRESETS = sorted(p.stem for p in (ROOT / "presets").glob("*.yaml"))


def run_recipe(cwd: Path, *args: str, path: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.recipe", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(cwd if path else ROOT), "PATH": path,
                               "DVC_NO_ANALYTICS": "1"})


def test_flatten_and_overlay() -> None:
    changes = {"ppo": {"steps": 2, "kl_penalty": "full"}, "seed": 3}
    assert flatten(changes) == {"ppo.steps": 2, "ppo.kl_penalty": "full", "seed": 3}
    base = {"seed": 0, "ppo": {"steps": 194, "batch_size": 128}}
    assert overlay(base, changes) == {"seed": 3, "ppo": {"steps": 2, "batch_size": 128, "kl_penalty": "full"}}
    assert base["ppo"]["steps"] == 194


@pytest.mark.parametrize("value", [
    None, True, False, 0, -3, 1000, 1e-05, 5e-05, 0.0005, 1.41e-05, 10000.0, 1e20, float("inf"),
    "data/raw/imdb", "lvwerra/distilbert-imdb", "./x", "../x", "/abs/path", "POSITIVE",
    "1", "1e5", ".5", "null", "True", "inf", "NaN", "", "a b", "x,y", "it's", "a\\b", "a\\", "a\\'b", "~/x", "-x",
    ["train", "unsupervised"], [], ["a b", "1"],
    [{"function": "rewards.text:length_bonus", "weight": 0.5}],  # reward.functions: a traceback (issue 33)
])
def test_override_values_parse_back_as_dvc_parses_them(value: object) -> None:
    # DVC hands each -S to Hydra's override parser; what it returns is what DVC writes into params.yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_override(f"key={as_override(value)}").value()
    assert parsed == value and type(parsed) is type(value)


@pytest.mark.parametrize("preset", PRESETS)
def test_shipped_presets_are_valid(preset: str, tmp_path: Path, imdb_dir: Path, tokenizer_dir: Path) -> None:
    (tmp_path / "presets").mkdir()
    shutil.copy(ROOT / "presets" / f"{preset}.yaml", tmp_path / "presets")
    shutil.copy(ROOT / "params.yaml", tmp_path)
    result = run_recipe(tmp_path, preset, "--imdb", str(imdb_dir), "--tokenizer", str(tokenizer_dir), "--dry-run")
    assert result.returncode == 0, result.stderr
    command = shlex.split(result.stdout.strip().splitlines()[-1])
    assert command[:3] == ["dvc", "exp", "run"]
    expected = [f"{key}={as_override(value)}"
                for key, value in flatten(read_yaml(ROOT / "presets" / f"{preset}.yaml")).items()]
    assert command[3::2] == ["-S"] * len(expected) and command[4::2] == expected
    if "data.source=data/raw/imdb" in expected:  # said, not done: a dry run writes nothing
        assert f"would copy {imdb_dir} -> data/raw/imdb" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml", "presets"]


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_each_preset_runs_prepare_through_real_dvc(preset: str, project: Path, imdb_dir: Path,
                                                   tokenizer_dir: Path) -> None:
    """The README's command for a preset, limited to its first stage, on the tiny data: DVC rewrites params.yaml with
    the preset's values (YAML 1.2 floats such as 5e-05) and the stage must read them back and run. The tiny data
    holds fewer eval prompts than a preset asks for (prepare refuses that), so -S lowers that one key."""
    shutil.copytree(ROOT / "presets", project / "presets")
    bin_dir = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    fewer = {"prepare.eval_prompts": 16}
    result = run_recipe(project, preset, "prepare", "--imdb", str(imdb_dir), "--tokenizer", str(tokenizer_dir),
                        *(arg for key, value in fewer.items() for arg in ("-S", f"{key}={value}")), path=bin_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Running stage 'prepare'" in result.stdout
    # a fresh clone has no dvc.lock: DVC's checkout before the run would warn once per output (tools/quiet_dvc.py)
    assert "No file hash info" not in result.stdout + result.stderr
    assert (project / "data/prompts/train.parquet").exists() and (project / "metrics/prepare.json").exists()
    written = flatten(read_yaml(project / "params.yaml"))
    for key, value in (flatten(read_yaml(ROOT / "presets" / f"{preset}.yaml")) | fewer).items():
        assert written[key] == value and type(written[key]) is type(value), key
    load_params(path=project / "params.yaml")


@pytest.mark.slow
def test_dvc_set_param_floats_reach_the_stage(project: Path, imdb_dir: Path, tokenizer_dir: Path) -> None:
    """`-S ppo.learning_rate=1e-5` is written back by DVC as `1e-05`, a YAML 1.2 float that a YAML 1.1 reader takes
    for a string; the stage must accept it."""
    set_params(project, **{"data.source": str(imdb_dir), "model.tokenizer": str(tokenizer_dir),
                           "prepare.eval_prompts": 20, "prepare.train_pairs": 30, "prepare.test_pairs": 10})
    dvc(project, "exp", "run", "-S", "ppo.learning_rate=1e-5", "-S", "ppo.init_kl_coef=5e-3", "prepare")
    text = (project / "params.yaml").read_text()
    assert "learning_rate: 1e-05" in text and "init_kl_coef: 0.005" in text
    ppo = load_params(path=project / "params.yaml").ppo
    assert (ppo.learning_rate, ppo.init_kl_coef) == (1e-05, 0.005)
    assert (project / "metrics/prepare.json").exists()


def test_a_bad_preset_fails_before_running(tmp_path: Path) -> None:
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "broken.yaml").write_text("ppo:\n  batch_size: -1\n")
    shutil.copy(ROOT / "params.yaml", tmp_path)
    error_line(run_recipe(tmp_path, "broken", "--dry-run"), "params.yaml: ppo.batch_size",
               "greater than or equal to 2", alone=True)
    error_line(run_recipe(tmp_path, "nope", "--dry-run"), "presets/nope.yaml", "no such preset (known: broken)",
               alone=True)


def test_a_bad_preset_copies_no_input(tmp_path: Path, imdb_dir: Path) -> None:
    """Validation comes before the copies into data/raw/ (a DVC dependency): a preset that would fail changes
    nothing, even without --dry-run."""
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "broken.yaml").write_text("data:\n  source: data/raw/imdb\nppo:\n  batch_size: -1\n")
    shutil.copy(ROOT / "params.yaml", tmp_path)
    error_line(run_recipe(tmp_path, "broken", "--imdb", str(imdb_dir)), "params.yaml: ppo.batch_size",
               "greater than or equal to 2",
               alone=True)
    assert not (tmp_path / "data").exists()
    # nor does an argument dvc exp run would refuse (it failed only once the inputs were copied)
    (tmp_path / "presets" / "broken.yaml").write_text("data:\n  source: data/raw/imdb\n")
    result = run_recipe(tmp_path, "broken", "--imdb", str(imdb_dir), "--bogus")
    error_line(result, "--bogus", "not arguments of dvc exp run", alone=True)
    assert not (tmp_path / "data").exists()


def test_a_source_that_cannot_be_read_is_named_before_anything_is_copied(tmp_path: Path, imdb_dir: Path,
                                                                         tokenizer_dir: Path) -> None:
    """A tokenizer folder that cannot be loaded was copied into data/raw/ and dvc exp run started; the broken copy
    left there made the next attempt refuse a good --tokenizer. Now each source is read first (dry run or not)."""
    (tmp_path / "presets").mkdir()
    shutil.copy(ROOT / "presets" / "offline-cpu.yaml", tmp_path / "presets")
    shutil.copy(ROOT / "params.yaml", tmp_path)
    broken = shutil.copytree(tokenizer_dir, tmp_path / "broken-tokenizer")
    os.truncate(broken / "tokenizer.json", 100)
    for args in ((), ("--dry-run",)):
        result = run_recipe(tmp_path, "offline-cpu", "--imdb", str(imdb_dir), "--tokenizer", str(broken), *args)
        line = error_line(result, "--tokenizer", f"cannot load a tokenizer from '{broken}'")
        assert line.endswith("(nothing was copied to data/raw/gpt2-tokenizer)") and "Traceback" not in result.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["broken-tokenizer", "params.yaml", "presets"]
    empty = tmp_path / "no-imdb"
    empty.mkdir()
    result = run_recipe(tmp_path, "offline-cpu", "--imdb", str(empty), "--tokenizer", str(tokenizer_dir))
    error_line(result, "--imdb", f"{empty}: no train.parquet")
    assert not (tmp_path / "data").exists()


def test_a_local_input_given_is_copied_or_refused_never_ignored(tmp_path: Path, imdb_dir: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """--imdb X when data/raw/imdb already exists was ignored (the run read the old copy); a file given where a
    folder is expected was a traceback from inside the copy."""
    monkeypatch.chdir(tmp_path)
    changes, target = {"data": {"source": "data/raw/imdb"}}, "data/raw/imdb"
    assert local_inputs(changes, {"imdb": imdb_dir, "tokenizer": None}) == {target: imdb_dir}
    shutil.copytree(imdb_dir, target)
    assert local_inputs(changes, {"imdb": imdb_dir, "tokenizer": None}) == {}  # the same files: nothing to do
    other = shutil.copytree(imdb_dir, tmp_path / "other")
    (other / "test.parquet").write_bytes((other / "train.parquet").read_bytes())
    with pytest.raises(ParamsError, match=rf"^--imdb: data/raw/imdb already exists and differs from {other}: remove "
                                          rf"it to copy {other} there, or leave --imdb out to use it$"):
        local_inputs(changes, {"imdb": other, "tokenizer": None})
    with pytest.raises(ParamsError, match=rf"^--imdb: {other}/train.parquet is a file, not a folder"):
        local_inputs(changes, {"imdb": other / "train.parquet", "tokenizer": None})


def test_a_preset_is_a_name_from_presets(monkeypatch: pytest.MonkeyPatch) -> None:
    """``../params`` read params.yaml itself as a preset."""
    monkeypatch.chdir(ROOT)
    with pytest.raises(ParamsError, match=r"^presets/\.\./params\.yaml: no such preset \(known: offline-cpu"):
        load_preset("../params")


def test_a_queued_point_carries_every_local_input_git_does_not_hold(project: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A queued experiment runs in a copy of the commit: a local model under data/raw/ (as the docs advise) must go
    with it, not only the presets' two inputs; Hub ids, absolute paths and the stages' own outputs need no carrying."""
    monkeypatch.chdir(project)
    Path("data/raw/policy").mkdir(parents=True)
    Path("data/raw/policy/config.json").write_text("{}")
    Path("models/sft").mkdir(parents=True)
    values = ["data/raw/policy", "data/raw/imdb", "models/sft", "stanfordnlp/imdb", str(project / "data/raw/policy"),
              "dvc.yaml", 3]
    assert untracked_inputs(values, ["data/raw/imdb"]) == ["data/raw/imdb", "data/raw/policy"]
