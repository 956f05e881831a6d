"""The reward-KL frontier: sweep points over a method's knob, and the tables and chart built from their experiments.

A point is one experiment named ``<preset>[-<series>]-<label>[-s<seed>]``, the label naming its knob: ``kl<c>`` (PPO at
a fixed KL coefficient), ``target<t>`` (PPO's adaptive controller), ``beta<b>`` (DPO), ``tau<t>`` (IPO), ``n<N>``
(best-of-N). The table has one row per point and seed and, per series and seed, one KL-0 row for the reference policy
(its ``reference.*`` metrics), so every curve starts at the origin of the trade; the means table has one row per point,
each metric's mean over the seeds and its standard error. Best-of-N has no sampled KL: its rows carry the analytic
bound log N - (N-1)/N (``kl.source`` says which). Where the experiments hold the optimum stage's pool tables
(rlhf/eval/optimum.py), the limit joins as the series ``optimum`` (one point per beta) and ``best-of-n pool`` (one per
n), and each point gets its gain as a fraction of the optimum's at its KL (``optimum.*_fraction``) and, as evaluate
measured it, its objective's share at its own beta (``optimum.objective_*``). No I/O here besides ``write_frontier``.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from rlhf.eval import optimum
from rlhf.pipeline.errors import ParamsError
from rlhf.pipeline.io import write_json, write_text

FRONTIER_DIR = Path("metrics/frontier")
CHART_DIR = FRONTIER_DIR / "chart"  # a folder of its own: dvc.yaml plots every file in it with the frontier template
DEFAULT_SERIES = "ppo"  # the series of PPO points swept without --series
REFERENCE = "reference"
RM = "reward model"
OPTIMUM, POOL_BEST_OF_N = "optimum", "best-of-n pool"  # the limit's series, from the optimum stage's pool
# each kind of point: its label prefix -> (the series it joins unless --series names one, its params keys)
KINDS: dict[str, tuple[str | None, Callable[[Any], dict[str, Any]]]] = {
    "kl": (None, lambda c: {"method": "ppo", "ppo.adap_kl_ctrl": False, "ppo.init_kl_coef": c}),
    "target": (None, lambda t: {"method": "ppo", "ppo.adap_kl_ctrl": True, "ppo.target": t}),
    "beta": ("dpo", lambda b: {"method": "dpo", "dpo.loss": "dpo", "dpo.beta": b}),
    "tau": ("ipo", lambda t: {"method": "dpo", "dpo.loss": "ipo", "dpo.tau": t}),
    "n": ("best-of-n", lambda n: {"method": "best_of_n", "evaluate.best_of_n": n}),
}
# the table's knob columns, filled for the method a row ran (a PPO row's dpo.beta is an unused default)
METHOD_KNOBS = {"ppo": ["ppo.adap_kl_ctrl", "ppo.init_kl_coef", "ppo.target"],
                "dpo": ["dpo.loss", "dpo.beta", "dpo.tau", "dpo.pairs"], "best_of_n": ["evaluate.best_of_n"]}
KNOBS = ["method", *(key for keys in METHOD_KNOBS.values() for key in keys)]
EVAL = "metrics/eval.json"
TRAINING = {"ppo.seconds": "metrics/ppo.json", "ppo.samples": "metrics/ppo.json", "dpo.seconds": "metrics/dpo.json"}
OBJECTIVE = [f"optimum.objective_{key}" for key in ("fraction", "gain", "kl", "reliable")]
BOUND = "kl.best_of_n_bound"
# the same quantity for the trained policy and for the reference (the KL-0 row)
POLICY_VS_REFERENCE = {"reward.policy_mean": "reward.reference_mean",
                       "reward.policy_positive_rate": "reward.reference_positive_rate",
                       "fluency.ref_perplexity": "fluency.reference_ref_perplexity",
                       "diversity.distinct2": "diversity.reference_distinct2"}
JUDGE = re.compile(r"judge\.(.+)\.policy_positive_rate")
NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")  # a valid git ref component, as DVC requires
MEMBER = rf"-(?:(.+)-)?((?:{'|'.join(KINDS)})[0-9][0-9.e+-]*)(?:-s([0-9]+))?"


@dataclass(frozen=True)
class Point:
    name: str
    """The experiment's name: ``offline-cpu-kl0.05``, ``offline-cpu-dpo-beta0.1-s2``."""
    label: str
    """What the chart writes beside the point: ``kl0.05``, ``target6``, ``beta0.1``, ``n16``."""
    knob: dict[str, Any]
    """The dotted params keys that make the point (``method`` and its knob, and ``seed`` for a seeded point)."""


def prefix(preset: str, series: str | None) -> str:
    """The name every point of a sweep starts with; one line naming the culprit when it cannot be a git ref."""
    name = f"{preset}-{series}" if series else preset
    if not NAME.fullmatch(name) or ".." in name or name.endswith(".lock"):
        what = "--series" if series else "the preset name"
        raise ParamsError(f"{what}: {name!r} cannot start an experiment name (letters, digits, '.', '_', '-')")
    return name


def grid(preset: str, series: str | None, values: dict[str, list], seeds: list[int] | None = None) -> list[Point]:
    """One point per value of each kind in ``values`` ({"kl": [0.1], "beta": [0.1, 0.3], ...}), in the series
    ``series`` or else the kind's own, and with ``seeds`` one per seed of each (the seed's point after the point's)."""
    points = []
    for kind, knob_values in values.items():
        default, knob = KINDS[kind]
        start = prefix(preset, series or default)
        for value in knob_values:
            label = f"{kind}{value:g}"
            if not seeds:
                points.append(Point(f"{start}-{label}", label, knob(value)))
            points += [Point(f"{start}-{label}-s{seed}", label, knob(value) | {"seed": seed}) for seed in seeds or []]
    return points


def same(a: Any, b: Any) -> bool:
    """Equal params values whatever YAML loader read them (1e-05 vs 0.00001, 80 vs 80.0; True is not 1)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b


def member(name: str, preset: str) -> tuple[str, str] | None:
    """(series, label) of a sweep point of ``preset`` named ``name`` (seeded or not), or None for any other
    experiment."""
    found = re.fullmatch(re.escape(preset) + MEMBER, name)
    return (found[1] or DEFAULT_SERIES, found[2]) if found else None


def sampled_or_bound(evaluation: dict[str, Any]) -> dict[str, Any]:
    """The row's KL: the sampled estimate, or for best-of-N (which has none) the analytic bound, saying which."""
    if "kl.mean" not in evaluation and BOUND in evaluation:
        return {"kl.source": "bound", "kl.mean": evaluation[BOUND], "kl.full_mean": None}
    return {"kl.source": "sampled", "kl.mean": evaluation.get("kl.mean"),
            "kl.full_mean": evaluation.get("kl.full_mean")}


def point_row(name: str, series: str, label: str, params: dict[str, Any], metrics: dict[str, dict],
              curve: pd.DataFrame | None = None) -> dict:
    """One table row from an experiment's flat params, its metrics files and, if it has one, its optimum curve."""
    evaluation = metrics.get(EVAL, {})
    method = params.get("method", "ppo")
    row = {"experiment": name, "series": series, "point": label, "seed": params.get("seed"), "method": method,
           **{key: params.get(key) for key in METHOD_KNOBS.get(method, [])}, **sampled_or_bound(evaluation)}
    row |= {key: evaluation.get(key) for key in POLICY_VS_REFERENCE}
    row |= {key: value for key, value in evaluation.items() if JUDGE.fullmatch(key) or key in OBJECTIVE}
    row["objective/kl_coef"] = metrics.get(TRAINING["ppo.seconds"], {}).get("ppo.objective/kl_coef")
    row |= {key: metrics.get(file, {}).get(key) for key, file in TRAINING.items()}
    return row | (distances(row, evaluation, curve) if curve is not None and row["kl.mean"] is not None else {})


def distances(row: dict, evaluation: dict[str, Any], curve: pd.DataFrame) -> dict[str, Any]:
    """The point's gain over its reference as a fraction of the optimum's at its KL, for the reward model and each
    judge (``optimum.rm_fraction``, ``optimum.<judge>_fraction``), and whether the optimum is reliable there."""
    scorers = {"rm": ("reward", "reward.policy_positive_rate", "reward.reference_positive_rate")}
    scorers |= {found[1]: (found[1], key, f"judge.{found[1]}.reference_positive_rate")
                for key in evaluation if (found := JUDGE.fullmatch(key))}
    out: dict[str, Any] = {}
    for name, (column, policy, reference) in scorers.items():
        if f"{column}.positive_rate" in curve and evaluation.get(reference) is not None:
            gain = evaluation[policy] - evaluation[reference]
            out[f"optimum.{name}_fraction"], out["optimum.reliable"] = optimum.gain_fraction(
                curve, row["kl.mean"], f"{column}.positive_rate", gain)
    return out


def limit_rows(tables: dict[Any, dict[str, pd.DataFrame]]) -> list[dict]:
    """The limit's rows from each seed's pool tables ({seed: {"curve": ..., "best_of_n": ...}}): a reference row
    and a point per beta (series ``optimum``; ``optimum.reliable`` marks where the estimate holds) and per n
    (``best-of-n pool``, at its KL bound as the best-of-N runs are, the pool's estimate in ``kl.full_mean``)."""
    rows = []
    for seed, found in sorted(tables.items(), key=lambda item: str(item[0])):
        curve, best = found["curve"], found["best_of_n"]
        judges = [c.removesuffix(".positive_rate") for c in curve if c.endswith(".positive_rate")
                  and c != "reward.positive_rate"]

        def scores(r: pd.Series, judges: list[str] = judges) -> dict[str, float]:
            return {"reward.policy_mean": r["reward.mean"], "reward.policy_positive_rate": r["reward.positive_rate"],
                    **{f"judge.{j}.policy_positive_rate": r[f"{j}.positive_rate"] for j in judges}}

        for series in (OPTIMUM, POOL_BEST_OF_N):
            rows.append({"experiment": "", "series": series, "point": REFERENCE, "seed": seed, "kl.source": "pool",
                         "kl.mean": 0.0, **scores(curve.iloc[0])})
        rows += [{"experiment": "", "series": OPTIMUM, "point": f"beta{r['beta']:g}", "seed": seed,
                  "kl.source": "pool", "kl.mean": r["kl"], "optimum.reliable": bool(r["reliable"]), **scores(r)}
                 for _, r in curve.iloc[1:].iterrows()]
        rows += [{"experiment": "", "series": POOL_BEST_OF_N, "point": f"n{int(r['n'])}", "seed": seed,
                  "kl.source": "bound", "kl.mean": r["kl_bound"], "kl.full_mean": r["kl"], **scores(r)}
                 for _, r in best.iloc[1:].iterrows()]
    return rows


def reference_row(series: str, seed: Any, metrics: dict[str, dict]) -> dict:
    """The KL-0 row: the reference policy's own numbers, from any experiment of the series and seed (they share
    it)."""
    evaluation = metrics.get(EVAL, {})
    row = {"experiment": "", "series": series, "point": REFERENCE, "seed": seed,
           "kl.source": sampled_or_bound(evaluation)["kl.source"], "kl.mean": 0.0, "kl.full_mean": 0.0}
    row |= {key: evaluation.get(ref) for key, ref in POLICY_VS_REFERENCE.items()}
    for key in evaluation:
        if found := JUDGE.fullmatch(key):
            row[key] = evaluation.get(f"judge.{found[1]}.reference_positive_rate")
    return row


def frontier_rows(experiments: dict[str, dict], preset: str, changes: dict[str, Any]) -> list[dict]:
    """The table: every experiment of ``preset``'s sweeps (by name, and holding the preset's params), a series'
    reference rows (one per seed) first, then its points by their mean KL, each point's seeds together.
    ``experiments`` maps a name to ``{"params": flat dotted params, "metrics": {file: flat}}`` and, for one that ran
    the optimum stage, ``"optimum": {"curve": ..., "best_of_n": ...}``; ``changes`` are the preset's flat params. The
    limit's rows (``limit_rows``, one set per seed) come last."""
    by_series: dict[str, list[dict]] = {}
    references: dict[str, dict[Any, dict]] = {}
    limits: dict[Any, dict[str, pd.DataFrame]] = {}
    for name, exp in sorted(experiments.items()):
        found = member(name, preset)
        if not found or EVAL not in exp["metrics"]:
            continue
        if not all(same(exp["params"].get(key), value) for key, value in changes.items()):
            continue
        series, label = found
        tables = exp.get("optimum")
        row = point_row(name, series, label, exp["params"], exp["metrics"], tables and tables["curve"])
        if tables:
            limits.setdefault(row["seed"], tables)
        by_series.setdefault(series, []).append(row)
        references.setdefault(series, {}).setdefault(row["seed"], reference_row(series, row["seed"], exp["metrics"]))
    rows = []
    for series in sorted(by_series):
        kl = {key: mean_stderr([row["kl.mean"] for row in group])[0] for key, group in groups(by_series[series])}
        order = sorted(by_series[series], key=lambda row: (kl[series, row["point"]] is None,
                                                           kl[series, row["point"]] or 0.0, row["point"],
                                                           str(row["seed"])))
        rows += [references[series][seed] for seed in sorted(references[series], key=str)] + order
    return rows + limit_rows(limits)


def groups(rows: list[dict]) -> list[tuple[tuple[str, str], list[dict]]]:
    """((series, point), its rows) in order of first appearance, a seed counted once (``seed`` missing: one row)."""
    grouped: dict[tuple[str, str], dict[Any, dict]] = {}
    for row in rows:
        grouped.setdefault((row["series"], row["point"]), {}).setdefault(row.get("seed"), row)
    return [(key, list(by_seed.values())) for key, by_seed in grouped.items()]


def mean_stderr(values: list[Any]) -> tuple[float | None, float | None]:
    """The mean of the values present and its standard error, sample sd / sqrt(n) (None below two values)."""
    present = [float(value) for value in values if value is not None and not pd.isna(value)]
    if not present:
        return None, None
    stderr = statistics.stdev(present) / math.sqrt(len(present)) if len(present) > 1 else None
    return statistics.fmean(present), stderr


def numeric(rows: list[dict]) -> list[str]:
    """The metric columns a mean is taken of, in the table's order."""
    fixed = ["experiment", "series", "point", "seed", *KNOBS, "kl.source"]
    return [column for column in columns(rows) if column not in fixed]


def mean_rows(rows: list[dict]) -> list[dict]:
    """The means table: one row per point (and per series' reference) with each metric's mean over its seeds and,
    as ``<metric>.stderr``, its standard error; ``seeds`` counts them."""
    out = []
    for _, group in groups(rows):
        first = group[0]
        row = {"experiments": " ".join(r["experiment"] for r in group if r["experiment"]), "series": first["series"],
               "point": first["point"], "seeds": len(group), **{key: first.get(key) for key in KNOBS},
               "kl.source": first.get("kl.source")}
        for column in numeric(rows):
            row[column], row[f"{column}.stderr"] = mean_stderr([r.get(column) for r in group])
        out.append(row)
    return out


def columns(rows: list[dict]) -> list[str]:
    """Fixed columns in a fixed order, every judge's positive rate after the reward model's."""
    judges = sorted({key for row in rows for key in row if JUDGE.fullmatch(key)})
    fractions = sorted({key for row in rows for key in row if key.endswith("_fraction") and key not in OBJECTIVE},
                       key=lambda key: (key != "optimum.rm_fraction", key))
    objective = [key for key in OBJECTIVE if any(key in row for row in rows)]
    return ["experiment", "series", "point", "seed", *KNOBS, "kl.source", "kl.mean", "kl.full_mean",
            "reward.policy_mean", "reward.policy_positive_rate", *judges, *fractions, "optimum.reliable", *objective,
            "fluency.ref_perplexity", "diversity.distinct2", "objective/kl_coef", *TRAINING]


def chart_points(means: list[dict]) -> list[dict]:
    """The chart's data, one record per point and scorer: the mean positive rate against the mean KL, each with the
    ends of its error bar (mean +- standard error; None for a point of one seed)."""
    records = []
    for row in means:
        scorers = {RM: "reward.policy_positive_rate"}
        scorers |= {found[1]: key for key in row if (found := JUDGE.fullmatch(key))}
        bound = row.get("kl.source") == "bound"
        label = f"{row['point']} (KL bound)" if bound and row["point"] != REFERENCE else row["point"]
        if row["series"] == OPTIMUM and row["point"] != REFERENCE:
            label = f"beta{b:g}" if (b := optimum.round_beta(float(row["point"][4:]))) else ""
        reliable = row.get("optimum.reliable")
        for scorer, key in scorers.items():
            if row.get(key) is None:
                continue
            records.append({"series": row["series"], "point": row["point"], "experiments": row["experiments"],
                            "label": label, "seeds": row["seeds"], "scorer": scorer, "kl.source": row["kl.source"],
                            "reliable": row["series"] != OPTIMUM or reliable is None or reliable >= 1,
                            "kl.mean": row["kl.mean"], "positive_rate": row[key],
                            **bar("kl", row["kl.mean"], row.get("kl.mean.stderr")),
                            **bar("positive_rate", row[key], row.get(f"{key}.stderr"))})
    return records


def bar(name: str, mean: float | None, stderr: float | None) -> dict[str, float | None]:
    """``<name>_low`` and ``<name>_high``: mean -+ standard error, None without one."""
    if mean is None or stderr is None:
        return {f"{name}_low": None, f"{name}_high": None}
    return {f"{name}_low": mean - stderr, f"{name}_high": mean + stderr}


def report(means: list[dict]) -> str:
    """The means table for people: a Markdown row per point (the optimum at the chart's betas only), positive rates
    as percentages with their standard error, and each point's share of the optimum's gain at its KL."""
    judges = sorted({found[1] for row in means for key in row if (found := JUDGE.fullmatch(key))})
    rates = {"RM": "reward.policy_positive_rate"} | {j: f"judge.{j}.policy_positive_rate" for j in judges}
    shares = {"RM": "optimum.rm_fraction"} | {j: f"optimum.{j}_fraction" for j in judges}

    def cell(row: dict, key: str, scale: float = 1.0, digits: int = 1) -> str:
        value, stderr = row.get(key), row.get(f"{key}.stderr")
        if value is None or pd.isna(value):
            return ""
        spread = "" if stderr is None or pd.isna(stderr) else f" ± {stderr * scale:.{digits}f}"
        return f"{value * scale:.{digits}f}{spread}"

    header = ["series", "point", "seeds", "KL (nats)", *(f"{s} positive %" for s in rates),
              *(f"{s} share of the optimum's gain" for s in shares), "optimum reliable", "objective share"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in means:
        if row["series"] == OPTIMUM and row["point"] != REFERENCE and not optimum.round_beta(float(row["point"][4:])):
            continue
        reliable = row.get("optimum.reliable")
        lines.append("| " + " | ".join([
            row["series"], row["point"] + (" (bound)" if row.get("kl.source") == "bound" else ""), str(row["seeds"]),
            cell(row, "kl.mean", digits=2), *(cell(row, key, 100) for key in rates.values()),
            *(cell(row, key, digits=2) for key in shares.values()),
            "" if reliable is None or pd.isna(reliable) else ("yes" if reliable >= 1 else "no"),
            cell(row, OBJECTIVE[0], digits=2)]) + " |")
    return "\n".join(lines) + "\n"


def frontier_files(name: str) -> tuple[Path, Path, Path, Path]:
    """The table, the means table, the report and the chart data of the preset ``name``."""
    return (FRONTIER_DIR / f"{name}.csv", FRONTIER_DIR / f"{name}.mean.csv", FRONTIER_DIR / f"{name}.md",
            CHART_DIR / f"{name}.json")


def write_frontier(rows: list[dict], name: str) -> tuple[Path, Path]:
    """Write the table ``metrics/frontier/<name>.csv``, the means over seeds ``<name>.mean.csv`` and their report
    ``<name>.md`` beside it, and the chart data ``metrics/frontier/chart/<name>.json``, each atomically; return the
    table's and the chart's path."""
    table, mean_table, markdown, chart = frontier_files(name)
    means = mean_rows(rows)
    write_text(pd.DataFrame(rows, columns=columns(rows)).to_csv(index=False), table)
    write_text(pd.DataFrame(means).to_csv(index=False), mean_table)
    write_text(report(means), markdown)
    write_json(chart_points(means), chart)
    return table, chart
