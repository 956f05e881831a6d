"""The reward-KL frontier: sweep points as DVC experiments (cached upstream stages, reruns only of new or changed
points), and the table and chart data built from those experiments."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from conftest import ALL_STAGES, ROOT, dvc, error_line, project_env
from test_experiments import git_commit

from rlhf.eval import optimum
from rlhf.eval.frontier import (
    chart_points,
    frontier_files,
    frontier_rows,
    grid,
    mean_rows,
    member,
    same,
    write_frontier,
)
from rlhf.pipeline.paths import OPTIMUM_CURVE
from tools.frontier import DEFAULT_KL_COEFS, arguments

PROGRESS = re.compile(r"^\[\d+/\d+\] (\S+): (ran in \d+ s|skipped .*)$", re.M)


def test_grid_names_each_point_after_its_knob() -> None:
    points = grid("offline-cpu", None, {"kl": [0.05, 0.2], "target": [3.0]})
    assert [p.name for p in points] == ["offline-cpu-kl0.05", "offline-cpu-kl0.2", "offline-cpu-target3"]
    assert points[0].knob == {"method": "ppo", "ppo.adap_kl_ctrl": False, "ppo.init_kl_coef": 0.05}
    assert points[2].knob == {"method": "ppo", "ppo.adap_kl_ctrl": True, "ppo.target": 3.0}
    assert grid("params", "rloo", {"kl": [1e-5]})[0].name == "params-rloo-kl1e-05"
    assert member("offline-cpu-rloo-kl0.05", "offline-cpu") == ("rloo", "kl0.05")
    assert member("offline-cpu-target6", "offline-cpu") == ("ppo", "target6")
    assert member("kl-0.05", "offline-cpu") is None and member("offline-gpu-kl0.05", "offline-cpu") is None


def test_other_methods_are_series_of_their_own_knob_and_seeds_name_their_points() -> None:
    points = grid("cpu", None, {"beta": [0.1], "tau": [0.5], "n": [16]}, seeds=[0, 2])
    assert [(p.name, p.label) for p in points] == [
        ("cpu-dpo-beta0.1-s0", "beta0.1"), ("cpu-dpo-beta0.1-s2", "beta0.1"), ("cpu-ipo-tau0.5-s0", "tau0.5"),
        ("cpu-ipo-tau0.5-s2", "tau0.5"), ("cpu-best-of-n-n16-s0", "n16"), ("cpu-best-of-n-n16-s2", "n16")]
    assert points[1].knob == {"method": "dpo", "dpo.loss": "dpo", "dpo.beta": 0.1, "seed": 2}
    assert points[2].knob == {"method": "dpo", "dpo.loss": "ipo", "dpo.tau": 0.5, "seed": 0}
    assert points[4].knob == {"method": "best_of_n", "evaluate.best_of_n": 16, "seed": 0}
    assert grid("cpu", "dpo-sampled", {"beta": [0.3]})[0].name == "cpu-dpo-sampled-beta0.3"
    series = {"beta": "dpo", "tau": "ipo", "n": "best-of-n"}
    for point in points:
        assert member(point.name, "cpu") == (series[point.label.rstrip("0123456789.")], point.label), point.name
    assert member("cpu-dpo-sampled-beta0.3-s11", "cpu") == ("dpo-sampled", "beta0.3")
    assert member("cpu-dpo-sampled-kl1e-05-s11", "cpu") == ("dpo-sampled", "kl1e-05")
    assert member("cpu-best-of-n-n64", "cpu") == ("best-of-n", "n64")
    assert member("cpu-dpo-beta0.1-seed2", "cpu") is None and member("cpu-dpo-x0.1", "cpu") is None


def test_params_compare_as_values() -> None:
    assert same({"a": [1, "x"], "b": 1e-05}, {"a": [1.0, "x"], "b": 0.00001})
    assert not same(True, 1) and not same({"a": 1}, {"a": 1, "b": 2}) and not same(0.2, 0.20001)


def experiment(kl: float, rm: float, vader: float, **params: object) -> dict:
    evaluation = {"kl.mean": kl, "kl.full_mean": kl * 0.9, "reward.policy_mean": rm - 0.5,
                  "reward.policy_positive_rate": rm, "judge.vader.policy_positive_rate": vader,
                  "fluency.ref_perplexity": 350 + 10 * kl, "diversity.distinct2": 0.87 - 0.01 * kl,
                  "reward.reference_mean": -0.1, "reward.reference_positive_rate": 0.41,
                  "judge.vader.reference_positive_rate": 0.35, "fluency.reference_ref_perplexity": 350.0,
                  "diversity.reference_distinct2": 0.874}
    return {"params": {"ppo.steps": 80, **params},
            "metrics": {"metrics/eval.json": evaluation, "metrics/ppo.json": {"ppo.seconds": 300.0}}}


def test_rows_start_at_the_reference_and_keep_only_the_presets_sweeps(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    fixed = {"ppo.adap_kl_ctrl": False}
    experiments = {
        "cpu-kl0.05": experiment(7.9, 0.80, 0.50, **fixed, **{"ppo.init_kl_coef": 0.05}),
        "cpu-kl0.4": experiment(1.5, 0.52, 0.41, **fixed, **{"ppo.init_kl_coef": 0.4}),
        "cpu-rloo-target4": experiment(4.1, 0.70, 0.55, **{"ppo.adap_kl_ctrl": True, "ppo.target": 4.0}),
        "cpu-kl0.1": {**experiment(5.0, 0.7, 0.5), "params": {"ppo.steps": 40}},  # another preset's params
        "my-run": experiment(3.0, 0.6, 0.5),
    }
    rows = frontier_rows(experiments, "cpu", {"ppo.steps": 80})
    assert [(r["series"], r["point"]) for r in rows] == [
        ("ppo", "reference"), ("ppo", "kl0.4"), ("ppo", "kl0.05"),
        ("rloo", "reference"), ("rloo", "target4")]
    assert rows[0] | {"experiment": "", "kl.mean": 0.0, "reward.policy_positive_rate": 0.41} == rows[0]
    assert rows[0].get("ppo.seconds") is None and rows[0].get("ppo.init_kl_coef") is None
    assert rows[0]["judge.vader.policy_positive_rate"] == 0.35 and rows[0]["fluency.ref_perplexity"] == 350.0
    assert rows[2]["experiment"] == "cpu-kl0.05" and rows[2]["ppo.init_kl_coef"] == 0.05
    assert rows[2]["kl.full_mean"] == pytest.approx(7.11) and rows[2]["ppo.seconds"] == 300.0

    chart = chart_points(mean_rows(rows))  # one seed each: the means are the rows, without error bars
    assert len(chart) == 2 * len(rows)
    record = next(r for r in chart if r["experiments"] == "cpu-rloo-target4" and r["scorer"] == "vader")
    assert record | {"series": "rloo", "point": "target4", "label": "target4", "seeds": 1, "kl.mean": 4.1,
                     "positive_rate": 0.55, "kl.source": "sampled", "positive_rate_low": None,
                     "kl_high": None} == record

    monkeypatch.chdir(tmp_path)
    table, chart_file = write_frontier(rows, "cpu")
    written = pd.read_csv(table)
    assert list(written.columns[:4]) == ["experiment", "series", "point", "seed"]
    assert {"judge.vader.policy_positive_rate", "kl.full_mean", "diversity.distinct2"} <= set(written.columns)
    assert len(written) == len(rows) and json.loads(chart_file.read_text()) == chart
    assert len(pd.read_csv(frontier_files("cpu")[1])) == len(rows)


def test_seeds_give_a_row_each_and_the_means_table_their_mean_and_standard_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dpo = {"method": "dpo", "dpo.loss": "dpo", "dpo.beta": 0.1, "dpo.pairs": "prepare"}
    experiments = {}
    for name, seed, kl, rm, vader in (("cpu-dpo-beta0.1", 0, 2.0, 0.6, 0.5),  # seed 0 again, under an older name
                                      ("cpu-dpo-beta0.1-s0", 0, 2.0, 0.6, 0.5),
                                      ("cpu-dpo-beta0.1-s1", 1, 3.0, 0.7, 0.4),
                                      ("cpu-dpo-beta0.1-s2", 2, 4.0, 0.8, 0.45)):
        experiments[name] = experiment(kl, rm, vader, seed=seed, **dpo)
        experiments[name]["metrics"]["metrics/dpo.json"] = {"dpo.seconds": 100.0 + seed}
    rows = frontier_rows(experiments, "cpu", {"ppo.steps": 80})
    assert [(r["point"], r["seed"]) for r in rows] == [("reference", 0), ("reference", 1), ("reference", 2),
                                                       ("beta0.1", 0), ("beta0.1", 0), ("beta0.1", 1), ("beta0.1", 2)]
    assert rows[5] | {"series": "dpo", "method": "dpo", "dpo.beta": 0.1, "dpo.seconds": 101.0} == rows[5]
    assert rows[5].get("ppo.init_kl_coef") is None

    reference, point = mean_rows(rows)
    assert reference["seeds"] == 3 and reference["reward.policy_positive_rate"] == pytest.approx(0.41)
    assert reference["reward.policy_positive_rate.stderr"] == pytest.approx(0.0)
    # seed 0 counts once; by hand: mean, and sd / sqrt(n) with the sample sd (n - 1 in its denominator)
    assert point["seeds"] == 3 and point["experiments"] == "cpu-dpo-beta0.1 cpu-dpo-beta0.1-s1 cpu-dpo-beta0.1-s2"
    for key, values in (("reward.policy_positive_rate", [0.6, 0.7, 0.8]), ("judge.vader.policy_positive_rate",
                                                                    [0.5, 0.4, 0.45]),
                        ("kl.mean", [2.0, 3.0, 4.0]), ("dpo.seconds", [100.0, 101.0, 102.0])):
        mean = sum(values) / 3
        stderr = (sum((v - mean) ** 2 for v in values) / 2) ** 0.5 / 3 ** 0.5
        assert (point[key], point[f"{key}.stderr"]) == (pytest.approx(mean), pytest.approx(stderr)), key
    assert point["ppo.seconds"] == pytest.approx(300.0) and point["dpo.beta"] == 0.1

    chart = chart_points([reference, point])
    record = next(r for r in chart if r["point"] == "beta0.1" and r["scorer"] == "reward model")
    se = point["reward.policy_positive_rate.stderr"]
    assert (record["positive_rate_low"], record["positive_rate_high"]) == (pytest.approx(0.7 - se),
                                                                          pytest.approx(0.7 + se))
    assert record["kl_high"] == pytest.approx(3 + point["kl.mean.stderr"]) and record["seeds"] == 3
    monkeypatch.chdir(tmp_path)
    write_frontier(rows, "cpu")
    means = pd.read_csv(frontier_files("cpu")[1])
    assert means["reward.policy_positive_rate.stderr"].tolist() == pytest.approx([0.0, se])


def test_best_of_n_rows_take_the_kl_bound_and_say_so() -> None:
    best = experiment(0.0, 0.7, 0.6, method="best_of_n", **{"evaluate.best_of_n": 16})
    evaluation = best["metrics"]["metrics/eval.json"]
    del evaluation["kl.mean"], evaluation["kl.full_mean"]
    evaluation["kl.best_of_n_bound"] = 1.83
    rows = frontier_rows({"cpu-best-of-n-n16": best, "cpu-kl0.4": experiment(1.5, 0.52, 0.41)}, "cpu", {})
    found = {(row["series"], row["point"]): row for row in rows}
    assert found["best-of-n", "n16"] | {"kl.source": "bound", "kl.mean": 1.83, "kl.full_mean": None,
                                        "evaluate.best_of_n": 16} == found["best-of-n", "n16"]
    assert found["best-of-n", "reference"] | {"kl.source": "bound", "kl.mean": 0.0} == found["best-of-n", "reference"]
    assert found["ppo", "kl0.4"]["kl.source"] == "sampled" and found["ppo", "kl0.4"]["kl.mean"] == 1.5
    labels = {(r["point"], r["kl.mean"], r["label"]) for r in chart_points(mean_rows(rows))}
    assert ("n16", 1.83, "n16 (KL bound)") in labels and ("kl0.4", 1.5, "kl0.4") in labels


def test_the_limit_joins_as_series_and_each_point_gets_its_share_of_the_optimum(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool tables of a seed make the optimum and best-of-n pool series; a point's gain over its reference, as a
    fraction of the optimum's gain over the pool's reference at the point's KL, is in the table, the chart's
    reliability and the report."""
    pool = pd.DataFrame({"prompt": [0] * 64, "sample": range(64), "response": "x", "length": 4,
                         "reward": np.linspace(-2, 2, 64), "vader": np.linspace(-0.5, 0.9, 64)})
    tables = {"curve": optimum.curve(pool, ["reward", "vader"]), "best_of_n": optimum.best_of_n(pool, ["reward",
                                                                                                      "vader"])}
    kl = float(tables["curve"]["kl"].iloc[10])
    point = experiment(kl, 0.55, 0.40)  # its reference: 0.41 and 0.35 (experiment())
    point["metrics"]["metrics/eval.json"] |= {"optimum.objective_fraction": 0.61, "optimum.objective_kl": 3.6}
    rows = frontier_rows({"cpu-kl0.2": point | {"optimum": tables}}, "cpu", {})
    series = [r["series"] for r in rows]
    assert series.count("optimum") == len(tables["curve"]) and series.count("best-of-n pool") == 7
    found = next(r for r in rows if r["experiment"] == "cpu-kl0.2")
    best = tables["curve"].iloc[10]
    assert found["optimum.rm_fraction"] == pytest.approx(
        (0.55 - 0.41) / (best["reward.positive_rate"] - tables["curve"]["reward.positive_rate"].iloc[0]))
    assert found["optimum.vader_fraction"] == pytest.approx(
        (0.40 - 0.35) / (best["vader.positive_rate"] - tables["curve"]["vader.positive_rate"].iloc[0]))
    assert found["optimum.reliable"] == bool(best["reliable"])
    assert (found["optimum.objective_fraction"], found["optimum.objective_kl"]) == (0.61, 3.6)
    limit = [r for r in rows if r["series"] == "optimum"]
    assert limit[0]["point"] == "reference" and limit[0]["kl.mean"] == 0
    assert [r["optimum.reliable"] for r in limit[1:]] == tables["curve"]["reliable"].iloc[1:].tolist()

    chart = chart_points(mean_rows(rows))
    unreliable = {r["point"] for r in chart if r["series"] == "optimum" and not r["reliable"]}
    assert unreliable == {f"beta{b:g}" for b in tables["curve"].query("not reliable")["beta"]}
    # each round beta names the one grid point nearest it (the grid, 20 a decade, holds few of them exactly)
    labels = {r["point"]: r["label"] for r in chart
              if r["series"] == "optimum" and r["label"] not in ("", "reference")}
    assert sorted(labels.values()) == sorted(f"beta{b:g}" for b in optimum.ROUND_BETAS)
    assert labels["beta0.316228"] == "beta0.3" and labels["beta0.1"] == "beta0.1"
    monkeypatch.chdir(tmp_path)
    write_frontier(rows, "cpu")
    text = Path(frontier_files("cpu")[2]).read_text()
    assert "RM share of the optimum's gain" in text.splitlines()[0]
    assert f"| ppo | kl0.2 | 1 | {kl:.2f} | 55.0 | 40.0 | {found['optimum.rm_fraction']:.2f} |" in text
    assert "| 0.61 |" in next(line for line in text.splitlines() if line.startswith("| ppo | kl0.2"))
    assert pd.read_csv(frontier_files("cpu")[0])["optimum.objective_fraction"].dropna().tolist() == [0.61]


def run_frontier(project: Path, *args: str) -> subprocess.CompletedProcess:
    """The command in ``project``, with this interpreter's dvc and python first on PATH (DVC runs the stages)."""
    return subprocess.run([sys.executable, "-m", "tools.frontier", *args], cwd=project, env=project_env(ROOT),
                          capture_output=True, text=True)


def test_the_tool_starts_without_torch_or_transformers() -> None:
    """The tool runs once per point and per call, and reads only tables: torch and transformers (seconds of CPU to
    import) load in the stages it starts, not in it."""
    result = subprocess.run([sys.executable, "-c", "import sys, tools.frontier; "
                             "print(sorted({'torch', 'transformers'} & set(sys.modules)))"],
                            cwd=ROOT, capture_output=True, text=True)
    assert (result.returncode, result.stdout.strip()) == (0, "[]"), result.stderr


def test_checking_an_imdb_source_loads_neither_torch_nor_transformers(imdb_dir: Path) -> None:
    """The recipe and the frontier read each source before copying it: an IMDb folder is tables, and reading it
    cost the seconds of CPU of torch and transformers' imports (the Hub check sat in the models layer)."""
    code = ("import sys; from pathlib import Path; from tools.presets import LOCAL_INPUTS, check_sources; "
            f"check_sources({{LOCAL_INPUTS['imdb']: Path({str(imdb_dir)!r})}}); "
            "print(sorted({'torch', 'transformers'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert (result.returncode, result.stdout.strip()) == (0, "[]"), result.stderr


def test_bad_arguments_fail_before_anything_runs(tmp_path: Path) -> None:
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "tiny.yaml").write_text("ppo:\n  steps: 2\n")
    result = run_frontier(tmp_path, "tiny", "--set", "ppo.advantage_whiten=false")
    error_line(result, "--set", "name the series with --series", alone=True)
    result = run_frontier(tmp_path, "tiny", "--series", "a b", "--kl-coef", "0.1")
    assert result.returncode == 1 and result.stderr.strip().startswith("error: --series: 'tiny-a b' cannot start")
    result = run_frontier(tmp_path, "tiny", "--kl-coef", "0.1,-1")
    assert result.returncode == 2 and "values must be >= 0" in result.stderr
    result = run_frontier(tmp_path, "tiny", "--best-of-n", "4,0")
    assert result.returncode == 2 and "--best-of-n: '4,0': values must be >= 1" in result.stderr
    assert "--seeds: invalid int list value: '1.5'" in run_frontier(tmp_path, "tiny", "--seeds", "1.5").stderr
    result = run_frontier(tmp_path, "tiny", "--jobs", "0")
    error_line(result, "--jobs", "must be >= 1", alone=True)
    result = run_frontier(tmp_path, "tiny", "--series", "mixed", "--kl-coef", "0.1", "--beta", "0.1")
    assert result.returncode == 1 and result.stderr.startswith("error: --series: one series is one method")
    result = run_frontier(tmp_path, "tiny", "--series", "dpo", "--set", "dpo.pairs=sampled", "--beta", "0.1")
    assert result.returncode == 1 and result.stderr.startswith("error: --series: 'dpo' is the name of a method's")
    assert "'ppo' is the name" in run_frontier(tmp_path, "tiny", "--series", "ppo", "--kl-coef", "0.1").stderr


def test_an_empty_list_of_values_is_refused(capsys: pytest.CaptureFixture) -> None:
    """``--kl-coef ''`` (a shell variable left empty) swept nothing and exited 0."""
    with pytest.raises(SystemExit) as exited:
        arguments().parse_args(["--kl-coef", ""])
    assert exited.value.code == 2 and "argument --kl-coef: '': no value" in capsys.readouterr().err


def test_a_dry_run_of_a_shipped_preset_prints_the_default_grid_and_copies_nothing(
        project: Path, imdb_dir: Path, tokenizer_dir: Path) -> None:
    (project / "presets").mkdir()
    (project / "presets" / "offline-cpu.yaml").write_text((ROOT / "presets" / "offline-cpu.yaml").read_text())
    git_commit(project, "the preset")
    result = run_frontier(project, "offline-cpu", "--imdb", str(imdb_dir), "--tokenizer", str(tokenizer_dir),
                          "--dry-run")
    assert result.returncode == 0, result.stderr
    assert f"would copy {imdb_dir} -> data/raw/imdb" in result.stdout
    commands = [line for line in result.stdout.splitlines() if line.startswith("dvc exp run")]
    assert len(commands) == 5
    assert [line.split()[4] for line in commands] == [f"offline-cpu-kl{c:g}" for c in DEFAULT_KL_COEFS]
    steps = yaml.safe_load((project / "presets" / "offline-cpu.yaml").read_text())["ppo"]["steps"]
    assert all(f"-S ppo.steps={steps} " in line and "-S ppo.adap_kl_ctrl=false " in line for line in commands)
    assert not (project / "data" / "raw" / "imdb").exists()
    assert [p.name for p in (project / "metrics" / "frontier").rglob("*") if p.is_file()] == [".keep.yaml"]

    # a series of another advantage estimator, as README gives it; a setting the ppo stage would refuse stops here
    data = ("--imdb", str(imdb_dir), "--tokenizer", str(tokenizer_dir))
    result = run_frontier(project, "offline-cpu", *data, "--series", "rloo", "--set", "ppo.advantage_estimator=rloo",
                          "--set", "ppo.samples_per_prompt=4", "--dry-run")
    commands = [line for line in result.stdout.splitlines() if line.startswith("dvc exp run")]
    assert [line.split()[4] for line in commands] == [f"offline-cpu-rloo-kl{c:g}" for c in DEFAULT_KL_COEFS]
    assert all("-S ppo.advantage_estimator=rloo -S ppo.samples_per_prompt=4 " in line for line in commands)
    # best-of-N, two seeds a point, queued to run two at a time, each queued run with the local inputs it reads
    result = run_frontier(project, "offline-cpu", *data, "--best-of-n", "1,16", "--seeds", "0,1", "--jobs", "2",
                          "--dry-run")
    lines = result.stdout.splitlines()
    commands = [line for line in lines if line.startswith("dvc exp run")]
    assert [line.split()[4] for line in commands] == [f"offline-cpu-best-of-n-n{n}-s{s}" for n in (1, 16)
                                                      for s in (0, 1)]
    assert all(" --queue -C data/raw/gpt2-tokenizer -C data/raw/imdb -S " in line and "-S method=best_of_n " in line
               for line in commands)
    assert "-S evaluate.best_of_n=16 -S seed=1" in commands[3] and lines[-1] == "dvc queue start -j 2"
    assert not (project / "data" / "raw" / "imdb").exists()
    result = run_frontier(project, "offline-cpu", *data, "--series", "grpo", "--set", "ppo.advantage_estimator=grpo",
                          "--dry-run")
    error_line(result, "params.yaml: ppo.samples_per_prompt", "must be >= 2 with ppo.advantage_estimator grpo")


def points_log(result: subprocess.CompletedProcess) -> dict[str, tuple[str, set[str]]]:
    """{point: (its progress line's verdict, the stages DVC ran for it)} from the command's output."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    log, out = {}, result.stdout + result.stderr
    start = 0
    for found in PROGRESS.finditer(out):
        log[found[1]] = (found[2].split()[0], set(re.findall(r"Running stage '(\w+)'", out[start:found.start()])))
        start = found.end()
    return log


def git(project: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=project, capture_output=True, text=True, check=True).stdout


def shown_rev(project: Path, name: str) -> str:
    """The commit of experiment ``name``."""
    rows = json.loads(dvc(project, "exp", "show", "--json").stdout)
    return next(exp["revs"][0]["rev"] for row in rows for exp in row.get("experiments") or [] if exp["name"] == name)


def exp_show(project: Path) -> dict[str, dict]:
    """{experiment name: its data} for the experiments of HEAD."""
    rows = json.loads(dvc(project, "exp", "show", "--json").stdout)
    return {exp["name"]: exp["revs"][0]["data"] for row in rows for exp in row.get("experiments") or []}


@pytest.mark.slow
def test_a_frontier_sweep_caches_its_points(project: Path, imdb_dir: Path, tiny_gpt2_dir: Path,
                                            tiny_classifier_dir: Path) -> None:
    (project / "presets").mkdir()
    preset = {"data": {"source": str(imdb_dir)}, "model": {"policy": str(tiny_gpt2_dir)},
              "reward": {"model": str(tiny_classifier_dir)},
              "prepare": {"train_prompts": 8, "eval_prompts": 8, "train_pairs": 4, "test_pairs": 4},
              "ppo": {"steps": 2, "batch_size": 4, "mini_batch_size": 4, "learning_rate": 1e-3,
                      "response_min_tokens": 2, "response_max_tokens": 6, "checkpoint_every": 0},
              "dpo": {"batch_size": 2, "learning_rate": 1e-3, "max_length": 16, "warmup_steps": 0,
                      "checkpoint_every": 0},
              "evaluate": {"judges": ["vader", str(tiny_classifier_dir)], "batch_size": 8, "examples": 2},
              "optimum": {"samples_per_prompt": 8}}
    (project / "presets" / "tiny.yaml").write_text(yaml.safe_dump(preset))
    git_commit(project, "a tiny preset")

    # the first point runs the whole DAG, the second only what the KL knob feeds (the optimum's pool is cached)
    assert points_log(run_frontier(project, "tiny", "--kl-coef", "0.5,0.05")) == {
        "tiny-kl0.5": ("ran", ALL_STAGES),
        "tiny-kl0.05": ("ran", {"ppo", "evaluate"})}
    shown = exp_show(project)
    full = pd.read_csv(project / "metrics" / "frontier" / "tiny.csv")
    table = full[full["series"] == "ppo"].reset_index(drop=True)
    assert table.loc[0, "point"] == "reference" and set(table["point"][1:]) == {"kl0.5", "kl0.05"}
    # the limit, from the pool the first point's optimum stage drew: its series, and each point's distance to it
    limit = full[full["series"] == "optimum"]
    assert limit["point"].iloc[0] == "reference" and (limit["kl.mean"].diff().dropna() > 0).all()
    assert set(full[full["series"] == "best-of-n pool"]["point"]) == {"reference", "n2", "n4", "n8"}
    committed = git(project, "show", f"{shown_rev(project, 'tiny-kl0.5')}:{OPTIMUM_CURVE.as_posix()}")
    curve = pd.read_csv(io.StringIO(committed))
    for _, row in table.iloc[1:].iterrows():
        gain = row["reward.policy_positive_rate"] - shown[row["experiment"]]["metrics"]["metrics/eval.json"]["data"][
            "reward.reference_positive_rate"]
        fraction, _ = optimum.gain_fraction(curve, row["kl.mean"], "reward.positive_rate", gain)
        assert row["optimum.rm_fraction"] == pytest.approx(fraction) or fraction is None
    for _, row in table.iloc[1:].iterrows():
        evaluation = shown[row["experiment"]]["metrics"]["metrics/eval.json"]["data"]
        for key in ("kl.mean", "kl.full_mean", "reward.policy_positive_rate", "judge.vader.policy_positive_rate",
                    "optimum.objective_fraction", "optimum.objective_kl"):
            assert row[key] == pytest.approx(evaluation[key]), key
        assert row["ppo.samples"] == 2 * 4  # steps x batch_size
        assert row["ppo.init_kl_coef"] == shown[row["experiment"]]["params"]["params.yaml"]["data"]["ppo"][
            "init_kl_coef"] and not row["ppo.adap_kl_ctrl"]
    reference = shown["tiny-kl0.5"]["metrics"]["metrics/eval.json"]["data"]
    judge = f"judge.{tiny_classifier_dir.name}"
    assert table.loc[0, "kl.mean"] == 0
    assert table.loc[0, "reward.policy_positive_rate"] == reference["reward.reference_positive_rate"]
    assert table.loc[0, f"{judge}.policy_positive_rate"] == reference[f"{judge}.reference_positive_rate"]

    # a second run with one more point runs only that one; the table gains its row
    assert points_log(run_frontier(project, "tiny", "--kl-coef", "0.5,0.05", "--target", "4")) == {
        "tiny-kl0.5": ("skipped", set()), "tiny-kl0.05": ("skipped", set()),
        "tiny-target4": ("ran", {"ppo", "evaluate"})}
    path = project / "metrics" / "frontier" / "tiny.csv"
    table, written = pd.read_csv(path), path.read_bytes()
    table = table[table["series"] == "ppo"]
    assert len(table) == 4 and table.set_index("point").loc["target4", "ppo.adap_kl_ctrl"]
    path.unlink()
    assert run_frontier(project, "tiny", "--collect").returncode == 0
    assert path.read_bytes() == written

    # points are matched by params, not by name: after a preset change every point is due again (and would replace
    # its namesake); a dry run says so, runs nothing and writes nothing
    shown = exp_show(project)
    (project / "presets" / "tiny.yaml").write_text(yaml.safe_dump({**preset, "evaluate": {**preset["evaluate"],
                                                                                          "examples": 1}}))
    dry = run_frontier(project, "tiny", "--kl-coef", "0.5,0.05", "--target", "4", "--dry-run")
    assert dry.returncode == 0 and not PROGRESS.search(dry.stdout)
    for name in shown:
        assert f"{name}: an experiment of that name has other params; replacing it" in dry.stdout
        assert re.search(rf"^dvc exp run -n {name} .*-S evaluate.examples=1\b", dry.stdout, re.M), dry.stdout
    assert "-S ppo.adap_kl_ctrl=true -S ppo.target=4.0 -S ppo.init_kl_coef=0.2" in dry.stdout
    assert exp_show(project) == shown and path.read_bytes() == written

    # a critic-free series: its --set keys reach the ppo stage, its points join the table under their series
    rloo = run_frontier(project, "tiny", "--series", "rloo", "--set", "ppo.advantage_estimator=rloo", "--set",
                        "ppo.samples_per_prompt=2", "--kl-coef", "0.5")
    assert points_log(rloo) == {"tiny-rloo-kl0.5": ("ran", {"ppo", "evaluate"})}
    ppo = exp_show(project)["tiny-rloo-kl0.5"]["params"]["params.yaml"]["data"]["ppo"]
    assert (ppo["advantage_estimator"], ppo["samples_per_prompt"]) == ("rloo", 2)
    table = pd.read_csv(path)
    assert table.loc[table["series"] == "rloo", "experiment"].dropna().tolist() == ["tiny-rloo-kl0.5"]

    # a DPO series with two seeds: one experiment per (point, seed) (the new seed reruns the whole DAG), a row each
    # in the table, and their mean and standard error in the means table
    assert points_log(run_frontier(project, "tiny", "--beta", "0.5", "--seeds", "0,1")) == {
        "tiny-dpo-beta0.5-s0": ("ran", {"ppo", "sample_pairs", "ref_logprobs", "dpo", "evaluate"}),
        "tiny-dpo-beta0.5-s1": ("ran", ALL_STAGES)}
    shown = exp_show(project)
    for seed in (0, 1):
        params = shown[f"tiny-dpo-beta0.5-s{seed}"]["params"]["params.yaml"]["data"]
        assert (params["method"], params["dpo"]["loss"], params["dpo"]["beta"], params["seed"]) == (
            "dpo", "dpo", 0.5, seed)
    table = pd.read_csv(path)
    dpo = table[table["series"] == "dpo"]
    assert dpo[["point", "seed"]].values.tolist() == [["reference", 0], ["reference", 1], ["beta0.5", 0],
                                                      ["beta0.5", 1]]
    assert dpo["method"].tolist()[2:] == ["dpo", "dpo"] and dpo["dpo.seconds"].iloc[2:].notna().all()
    means = pd.read_csv(project / frontier_files("tiny")[1]).set_index(["series", "point"])
    point, seeds = means.loc[("dpo", "beta0.5")], dpo[dpo["point"] == "beta0.5"]
    assert point["seeds"] == 2 and point["experiments"] == "tiny-dpo-beta0.5-s0 tiny-dpo-beta0.5-s1"
    for key in ("kl.mean", "reward.policy_positive_rate", f"judge.{tiny_classifier_dir.name}.policy_positive_rate"):
        assert point[key] == pytest.approx(seeds[key].mean()), key
        assert point[f"{key}.stderr"] == pytest.approx(seeds[key].std() / 2 ** 0.5), key
    assert means.loc[("rloo", "kl0.5"), "seeds"] == 1 and pd.isna(means.loc[("rloo", "kl0.5"), "kl.mean.stderr"])


def test_plots_show_reads_a_clone_without_a_frontier(project: Path) -> None:
    """Before any sweep the chart folder holds only its placeholder: an empty chart, not a plot error."""
    data = json.loads(dvc(project, "plots", "show", "--json").stdout)
    assert {"reward", "kl", "score_histogram"} <= set(data["data"])
    assert not [error for error in data.get("errors", []) if "frontier" in error["source"]], data["errors"]
