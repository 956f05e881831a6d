"""docs/experiments.md's "Beyond one machine": an experiment run on one clone and sent with `dvc exp push` to a git
remote (a bare repository) and a DVC remote (a local folder) is listed and pulled by another clone, outputs and
metrics included, with the commands the page gives."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from conftest import dvc, set_params

GIT_ENV = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True, env=GIT_ENV).stdout


@pytest.mark.slow
def test_an_experiment_pushed_from_one_clone_is_pulled_into_another(project: Path, imdb_dir: Path,
                                                                    tokenizer_dir: Path, tiny_gpt2_dir: Path,
                                                                    tmp_path: Path) -> None:
    remote, storage, clone = tmp_path / "origin.git", tmp_path / "dvc-storage", tmp_path / "elsewhere"
    git(tmp_path, "init", "-q", "--bare", str(remote))
    (project / ".dvc/.gitignore").write_text("/config.local\n/tmp\n/cache\n")  # as dvc init writes it
    set_params(project, **{"data.source": str(imdb_dir), "model.tokenizer": str(tokenizer_dir),
                           "model.policy": str(tiny_gpt2_dir), "prepare.eval_prompts": 20,
                           "prepare.train_pairs": 30, "prepare.test_pairs": 10})
    dvc(project, "remote", "add", "-d", "storage", str(storage))
    git(project, "add", "-A")
    git(project, "commit", "-qm", "baseline with a DVC remote")
    git(project, "remote", "add", "origin", str(remote))
    git(project, "push", "-q", "origin", "HEAD")

    # a tiny experiment (the prepare stage alone), sent to both remotes
    dvc(project, "exp", "run", "-n", "fewer-eval", "-S", "prepare.eval_prompts=6", "prepare")
    dvc(project, "exp", "push", "origin", "fewer-eval")
    assert "fewer-eval" in git(remote, "for-each-ref", "refs/exps")
    assert any(path.is_file() for path in storage.rglob("*"))  # its outputs are in the DVC remote

    git(tmp_path, "clone", "-q", str(remote), str(clone))
    assert "fewer-eval" in dvc(clone, "exp", "list", "origin").stdout
    dvc(clone, "exp", "pull", "origin", "fewer-eval")
    dvc(project, "exp", "push", "origin", "-A")  # the page's forms for every experiment: here nothing more to send
    dvc(clone, "exp", "pull", "origin", "-A")
    shown = json.loads(dvc(clone, "exp", "show", "--json").stdout)
    (exp,) = [exp for commit in shown for exp in commit.get("experiments") or [] if exp.get("name") == "fewer-eval"]
    assert exp["revs"][0]["data"]["metrics"]["metrics/prepare.json"]["data"]["prepare"]["prompts"]["eval"] == 6
    dvc(clone, "exp", "branch", "fewer-eval", "fewer-eval-run")
    git(clone, "checkout", "-q", "fewer-eval-run")
    dvc(clone, "checkout", "prepare")  # the experiment ran prepare alone: the other stages have no outputs
    assert json.loads((clone / "metrics/prepare.json").read_text())["prepare"]["prompts"]["eval"] == 6
    # the outputs came from the DVC remote: the clone never ran a stage, and its cache was empty
    assert len(pd.read_parquet(clone / "data/prompts/eval.parquet")) == 6
