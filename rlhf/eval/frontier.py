"""The reward-KL frontier: sweep points over the KL knob, and the table and chart built from their DVC experiments.

A point is one experiment named ``<preset>[-<series>]-kl<init_kl_coef>`` (fixed coefficient) or
``<preset>[-<series>]-target<target>`` (adaptive controller). The table has one row per point and, per series, one
KL-0 row for the reference policy (its ``reference.*`` metrics), so every curve starts at the origin of the trade.
No I/O here besides ``write_frontier``; running DVC is the job of ``tools/frontier.py``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from rlhf.pipeline.errors import ParamsError
from rlhf.pipeline.io import write_json, write_text

FRONTIER_DIR = Path("metrics/frontier")
CHART_DIR = FRONTIER_DIR / "chart"  # a folder of its own: dvc.yaml plots every file in it with the frontier template
DEFAULT_SERIES = "default"
REFERENCE = "reference"
RM = "reward model"
KNOBS = ["ppo.adap_kl_ctrl", "ppo.init_kl_coef", "ppo.target"]
EVAL = "metrics/eval.json"
PPO = "metrics/ppo.json"
# the same quantity for the trained policy and for the reference (the KL-0 row)
POLICY_VS_REFERENCE = {"policy.reward_mean": "reference.reward_mean",
                       "policy.positive_rate": "reference.positive_rate",
                       "fluency.ref_perplexity": "fluency.reference_ref_perplexity",
                       "diversity.distinct2": "diversity.reference_distinct2"}
JUDGE = re.compile(r"judge\.(.+)\.policy_positive_rate")
NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")  # a valid git ref component, as DVC requires


@dataclass(frozen=True)
class Point:
    name: str
    """The experiment's name: ``offline-cpu-kl0.05``."""
    label: str
    """What the chart writes beside the point: ``kl0.05``, ``target6``."""
    knob: dict[str, Any]
    """The dotted params keys that make the point (``ppo.adap_kl_ctrl``, ``ppo.init_kl_coef`` or ``ppo.target``)."""


def prefix(preset: str, series: str | None) -> str:
    """The name every point of a sweep starts with; one line naming the culprit when it cannot be a git ref."""
    name = f"{preset}-{series}" if series else preset
    if not NAME.fullmatch(name) or ".." in name or name.endswith(".lock"):
        what = "--series" if series else "the preset name"
        raise ParamsError(f"{what}: {name!r} cannot start an experiment name (letters, digits, '.', '_', '-')")
    return name


def grid(preset: str, series: str | None, kl_coefs: list[float], targets: list[float]) -> list[Point]:
    """One point per fixed KL coefficient (adap_kl_ctrl off) and per adaptive KL target (adap_kl_ctrl on)."""
    start = prefix(preset, series)
    points = [Point(f"{start}-kl{c:g}", f"kl{c:g}", {"ppo.adap_kl_ctrl": False, "ppo.init_kl_coef": c})
              for c in kl_coefs]
    points += [Point(f"{start}-target{t:g}", f"target{t:g}", {"ppo.adap_kl_ctrl": True, "ppo.target": t})
               for t in targets]
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
    """(series, label) of a sweep point of ``preset`` named ``name``, or None for any other experiment."""
    found = re.fullmatch(rf"{re.escape(preset)}-(?:(.+)-)?((?:kl|target)[0-9][0-9.e+-]*)", name)
    return (found[1] or DEFAULT_SERIES, found[2]) if found else None


def point_row(name: str, series: str, label: str, params: dict[str, Any], metrics: dict[str, dict]) -> dict:
    """One table row from an experiment's flat params and its metrics files."""
    evaluation, ppo = metrics.get(EVAL, {}), metrics.get(PPO, {})
    row = {"experiment": name, "series": series, "point": label, **{k: params.get(k) for k in KNOBS},
           "kl.mean": evaluation.get("kl.mean"), "kl.full_mean": evaluation.get("kl.full_mean")}
    row |= {key: evaluation.get(key) for key in POLICY_VS_REFERENCE}
    row |= {key: value for key, value in evaluation.items() if JUDGE.fullmatch(key)}
    return row | {"objective/kl_coef": ppo.get("objective/kl_coef"), "ppo.seconds": ppo.get("seconds")}


def reference_row(series: str, metrics: dict[str, dict]) -> dict:
    """The KL-0 row: the reference policy's own numbers, from any experiment of the series (they share it)."""
    evaluation = metrics.get(EVAL, {})
    row = {"experiment": "", "series": series, "point": REFERENCE, "kl.mean": 0.0, "kl.full_mean": 0.0}
    row |= {key: evaluation.get(ref) for key, ref in POLICY_VS_REFERENCE.items()}
    for key in evaluation:
        if found := JUDGE.fullmatch(key):
            row[key] = evaluation.get(f"judge.{found[1]}.reference_positive_rate")
    return row


def frontier_rows(experiments: dict[str, dict], preset: str, changes: dict[str, Any]) -> list[dict]:
    """The table: every experiment of ``preset``'s sweeps (by name, and holding the preset's params), one reference
    row per series first. ``experiments`` maps a name to ``{"params": flat dotted params, "metrics": {file: flat}}``;
    ``changes`` are the preset's flat params."""
    by_series: dict[str, list[dict]] = {}
    references: dict[str, dict] = {}
    for name, exp in sorted(experiments.items()):
        found = member(name, preset)
        if not found or EVAL not in exp["metrics"]:
            continue
        if not all(same(exp["params"].get(key), value) for key, value in changes.items()):
            continue
        series, label = found
        by_series.setdefault(series, []).append(point_row(name, series, label, exp["params"], exp["metrics"]))
        references.setdefault(series, reference_row(series, exp["metrics"]))
    rows = []
    for series in sorted(by_series):
        rows += [references[series], *sorted(by_series[series], key=lambda row: (row["kl.mean"], row["point"]))]
    return rows


def columns(rows: list[dict]) -> list[str]:
    """Fixed columns in a fixed order, every judge's positive rate after the reward model's."""
    judges = sorted({key for row in rows for key in row if JUDGE.fullmatch(key)})
    return ["experiment", "series", "point", *KNOBS, "kl.mean", "kl.full_mean", "policy.reward_mean",
            "policy.positive_rate", *judges, "fluency.ref_perplexity", "diversity.distinct2", "objective/kl_coef",
            "ppo.seconds"]


def chart_points(rows: list[dict]) -> list[dict]:
    """The chart's data, one record per row and scorer: positive rate against sampled KL."""
    records = []
    for row in rows:
        scorers = {RM: row["policy.positive_rate"]}
        scorers |= {found[1]: value for key, value in row.items() if (found := JUDGE.fullmatch(key))}
        records += [{"series": row["series"], "point": row["point"], "experiment": row["experiment"],
                     "scorer": scorer, "kl.mean": row["kl.mean"], "positive_rate": rate}
                    for scorer, rate in scorers.items() if rate is not None]
    return records


def write_frontier(rows: list[dict], name: str) -> tuple[Path, Path]:
    """Write ``metrics/frontier/<name>.csv`` (the table) and ``metrics/frontier/chart/<name>.json`` atomically."""
    table, chart = FRONTIER_DIR / f"{name}.csv", CHART_DIR / f"{name}.json"
    write_text(pd.DataFrame(rows, columns=columns(rows)).to_csv(index=False), table)
    write_json(chart_points(rows), chart)
    return table, chart
