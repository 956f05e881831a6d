"""The experiment workflow end to end on tiny local models (CPU): `dvc repro`, then `dvc exp run -S ...`; exactly the
stages downstream of a changed param rerun, and `dvc metrics diff` / `dvc exp show` / `dvc plots diff` compare runs."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ALL_STAGES, dvc, project_env, set_params
from helpers import ran_stages


def compare(project: Path, *args: str) -> str:
    """``python -m tools.compare`` in ``project``, with this environment's dvc."""
    result = subprocess.run([sys.executable, "-m", "tools.compare", *args], cwd=project, env=project_env(project),
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


def git_commit(project: Path, message: str) -> None:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", "add", "-A"], cwd=project, check=True)
    subprocess.run(["git", "commit", "-qm", message], cwd=project, check=True, env=env)


@pytest.mark.slow
def test_repro_then_experiments_rerun_only_what_changed(project: Path, imdb_dir: Path, tiny_gpt2_dir: Path,
                                                        tiny_classifier_dir: Path) -> None:
    judge = tiny_classifier_dir.name
    set_params(project, **{
        "data.source": str(imdb_dir), "model.policy": str(tiny_gpt2_dir), "reward.model": str(tiny_classifier_dir),
        "prepare.train_prompts": 16, "prepare.eval_prompts": 8, "prepare.train_pairs": 8, "prepare.test_pairs": 4,
        "ppo.steps": 2, "ppo.batch_size": 4, "ppo.mini_batch_size": 4, "ppo.learning_rate": 1e-3,
        "ppo.response_min_tokens": 2, "ppo.response_max_tokens": 6, "ppo.checkpoint_every": 0,
        "evaluate.judges": ["vader", str(tiny_classifier_dir)], "evaluate.batch_size": 8, "evaluate.examples": 4,
    })

    assert ran_stages(dvc(project, "repro")) == ALL_STAGES
    baseline = json.loads((project / "metrics" / "eval.json").read_text())
    assert {"reward.policy_mean", "reward.reference_positive_rate", "kl.full_mean", "judge.vader.policy_positive_rate",
            "fluency.ref_perplexity", "diversity.distinct2"} <= set(baseline)
    git_commit(project, "baseline")

    # a ppo param reruns ppo and evaluate, and `dvc metrics diff` (HEAD vs workspace) shows what moved
    assert ran_stages(dvc(project, "exp", "run", "-n", "kl-low", "-S", "ppo.init_kl_coef=0.05")) == {"ppo", "evaluate"}
    diff = json.loads(dvc(project, "metrics", "diff", "--json").stdout)["metrics/eval.json"]
    assert "kl.full_mean" in diff and "kl.mean" in diff
    assert diff["kl.full_mean"]["old"] == baseline["kl.full_mean"]
    # the reference samples the same prompts with the same seed and lengths in every experiment
    assert not [key for key in diff if ".reference_" in key]

    # on top of that workspace, an evaluate param reruns evaluate alone, and only its keys move (and its times)
    assert ran_stages(dvc(project, "exp", "run", "-n", "greedy", "-S", "evaluate.greedy=true")) == {"evaluate"}
    greedy = json.loads(dvc(project, "metrics", "diff", "kl-low", "greedy", "--json").stdout)["metrics/eval.json"]
    assert "reward.policy_greedy_mean" in greedy and greedy["reward.policy_greedy_mean"]["old"] is None
    assert all("greedy" in key or key.startswith("evaluate.time/") for key in greedy), greedy
    times = json.loads((project / "metrics" / "eval.json").read_text())["evaluate"]
    assert set(times) == {"time/setup", "time/steps", "time/teardown"}
    assert times["time/setup"] > 0 and times["time/steps"] > 0  # teardown (files moving in) can round to 0.00

    show = {row["Experiment"]: row for row in csv.DictReader(io.StringIO(dvc(project, "exp", "show", "--csv").stdout))}
    assert float(show["kl-low"]["kl.full_mean"]) == pytest.approx(diff["kl.full_mean"]["new"])
    assert show["kl-low"]["ppo.init_kl_coef"] == "0.05" and show["greedy"]["reward.policy_greedy_mean"]

    # the README's review: one table, at most 120 columns, a row per run with the columns a review needs
    table = compare(project)
    lines = table.splitlines()
    assert max(map(len, lines)) <= 120, table
    assert lines[0].split() == ["experiment", "method", "reward", judge, "vader", "KL", "obj", "ppl", "dist-2",
                                "train", "gpu", "compiled", "changed"]
    rows: dict[str, list[str]] = {}
    for line in lines[1:lines.index("")]:
        if line.startswith("    "):  # the changed params, wrapped
            rows[list(rows)[-1]] += line.split()
        else:
            rows[line.split()[0]] = line.split()
    assert list(rows) == ["workspace", "master", "greedy", "kl-low"], table
    kl_low = json.loads(dvc(project, "exp", "show", "--json").stdout)[1]["experiments"]
    kl_low = next(e for e in kl_low if e["name"] == "kl-low")["revs"][0]["data"]["metrics"]
    shown = kl_low["metrics/eval.json"]["data"]
    assert rows["kl-low"][1:3] == ["ppo", "kl0.05"] and rows["master"][2] == "kl0.2"
    assert rows["kl-low"][4] == (f"{shown['reward.reference_positive_rate']:.2f}→"
                                 f"{shown['reward.policy_positive_rate']:.2f}")
    assert rows["kl-low"][7] == f"{shown['kl.mean']:.2f}"
    assert rows["kl-low"][8] == "-"  # the objective's share: no optimum's pool here (tests/test_frontier.py has one)
    assert rows["kl-low"][10] == f"{shown['diversity.distinct2']:.3f}"
    assert rows["kl-low"][11] == f"{kl_low['metrics/ppo.json']['data']['ppo']['seconds']:.0f}"
    assert rows["kl-low"][12] == "-"  # the share of the training time the GPU was busy: no GPU here
    assert kl_low["metrics/ppo.json"]["data"]["ppo"]["system"]["cpu_cores"] > 0
    assert {row[13] for row in rows.values()} == {"eager"}  # ppo.compile: auto compiles nothing on a CPU
    assert rows["kl-low"][14:] == ["ppo.init_kl_coef=0.05"] and rows["master"][14:] == []
    assert rows["greedy"][14:] == rows["workspace"][14:] == ["ppo.init_kl_coef=0.05", "evaluate.greedy=true"]

    plots = json.loads(dvc(project, "plots", "diff", "HEAD", "kl-low", "--json", "--split").stdout)
    assert not plots.get("errors"), plots["errors"]
    for plot_id in ("reward", "kl", "score_histogram"):
        assert plots["data"][plot_id][0]["revisions"] == ["HEAD", "kl-low"], plot_id
