"""Compare experiments in one readable table: ``python -m tools.compare``.

One row per experiment that ``dvc exp show`` lists (the workspace, HEAD and HEAD's experiments; other arguments go to
``dvc exp show``: ``-A``, ``--rev REV``, ``-n N``), the columns a review needs and no more: the method and its KL knob,
the positive rate of the training reward and of every judge (reference -> policy), the policy's KL, its objective's
share of the optimum's, fluency and diversity, its training time and how busy the GPU was meanwhile, and the params
that differ from the row's baseline commit. At most WIDTH characters wide (the changed params wrap). ``dvc exp show``
has every key; docs/stages.md says what each measures.
"""

from __future__ import annotations

import argparse
import json
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf.pipeline.cli import run_stage
from rlhf.pipeline.errors import ParamsError
from tools.presets import as_override, dvc, flatten

WIDTH = 120
MIN_CHANGED = 24  # the narrowest the changed params' column gets before they move under their row
JUDGE = re.compile(r"judge\.(.+)\.policy_positive_rate")
TRAINING = {"ppo": "ppo", "dpo": "dpo"}  # each training method's stage, whose metrics hold its wall time and system
# use (best_of_n trains none)
LEGEND = ("reward, {judges}: positive rate on the eval prompts, reference → policy (reward: the training reward; the "
          "others judge only). KL: mean sampled KL(policy || reference), nats (<=: best-of-N's bound). obj: the "
          "objective E[r] - beta KL's share of the way from the reference's to the optimum's, on the optimum's pool "
          "prompts (- without a pool, or a beta: docs/experiments.md). ppl: the "
          "reference's perplexity of the policy's responses. dist-2: distinct-2, unique / all bigrams of the "
          "responses. train: seconds the method trained. gpu: the share of that time the GPU was busy (- on CPU). "
          "compiled: the distance of its compiled step's first use from the eager step (eager: it never ran "
          "compiled). "
          "changed: params that differ from the row's baseline commit.")


@dataclass
class Row:
    """One experiment: its name, whether it is a baseline (a commit or the workspace), its flat params and metrics
    (every metrics file's keys together: each says what it measures), and its state when it has no results."""

    name: str
    baseline: bool
    params: dict[str, Any]
    metrics: dict[str, Any]
    state: str = ""


def rows(shown: list[dict]) -> list[tuple[Row, list[Row]]]:
    """``dvc exp show --json`` as (baseline row, its experiments' rows), in DVC's order."""
    def row(name: str, baseline: bool, rev: dict, state: str = "") -> Row:
        data = rev.get("data") or {}
        params = flatten((data.get("params") or {}).get("params.yaml", {}).get("data") or {})
        metrics = {key: value for found in (data.get("metrics") or {}).values()
                   for key, value in flatten(found.get("data") or {}).items()}
        return Row(name, baseline, params, metrics, "failed" if rev.get("error") else state)

    out = []
    for commit in shown:
        experiments = []
        for exp in commit.get("experiments") or []:
            rev = (exp.get("revs") or [{}])[0]
            state = (exp.get("executor") or {}).get("state") or "success"
            experiments.append(row(exp.get("name") or rev.get("rev", "")[:7], False, rev,
                                   "" if state == "success" else state))
        name = "workspace" if commit["rev"] == "workspace" else commit.get("name") or commit["rev"][:7]
        out.append((row(name, True, commit), experiments))
    return out


def baselines(groups: list[tuple[Row, list[Row]]]) -> dict[int, Row]:
    """What each row is compared with (by id): an experiment with its commit, the workspace with HEAD (the next)."""
    base = {id(row): commit for commit, exps in groups for row in exps}
    base |= {id(commit): groups[i + 1][0] if commit.name == "workspace" and i + 1 < len(groups) else commit
             for i, (commit, _) in enumerate(groups)}
    return base


def setting(params: dict[str, Any]) -> str:
    """The method and its KL knob as the frontier names points: ``ppo kl0.05``, ``rloo kl0.2 target6`` (adaptive),
    ``dpo beta0.1``, ``ipo tau0.5``, ``best-of-n n16``."""
    method = params.get("method", "ppo")
    if method == "dpo":
        loss = params.get("dpo.loss", "dpo")
        knob = "beta" if loss == "dpo" else "tau"
        return f"{loss} {knob}{params.get('dpo.' + knob)}"
    if method == "best_of_n":
        return f"best-of-n n{params.get('evaluate.best_of_n')}"
    estimator = params.get("ppo.advantage_estimator", "gae")
    target = f" target{params.get('ppo.target'):g}" if params.get("ppo.adap_kl_ctrl") else ""
    return f"{'ppo' if estimator == 'gae' else estimator} kl{params.get('ppo.init_kl_coef')}{target}"


def number(value: Any, digits: int) -> str:
    return "-" if not isinstance(value, int | float) or isinstance(value, bool) else f"{value:.{digits}f}"


def rate(metrics: dict[str, Any], prefix: str) -> str:
    """``0.41→0.68``: a scorer's positive rate before (reference) and after (policy)."""
    before, after = metrics.get(f"{prefix}.reference_positive_rate"), metrics.get(f"{prefix}.policy_positive_rate")
    return "-" if after is None else f"{number(before, 2)}→{number(after, 2)}"


def trained(row: Row, key: str) -> Any:
    """``key`` of the training stage's metrics (``seconds``, ``system.gpu_busy``); None for best_of_n."""
    stage = TRAINING.get(row.params.get("method"))
    return None if stage is None else row.metrics.get(f"{stage}.{key}")


def percent(value: Any) -> str:
    return "-" if not isinstance(value, int | float) or isinstance(value, bool) else f"{value:.0%}"


def compiled(row: Row) -> str:
    """The training stage's compiled step: the distance its first use found from the eager step, ``eager`` where it
    ran eagerly, - for a stage without one."""
    ran, found = trained(row, "compile.compiled"), trained(row, "compile.distance")
    if ran is None:
        return "-"
    return f"{found:.0e}" if ran and isinstance(found, int | float) else "compiled" if ran else "eager"


def kl(metrics: dict[str, Any]) -> str:
    bound = metrics.get("kl.best_of_n_bound")
    return f"<={bound:.2f}" if isinstance(bound, float) else number(metrics.get("kl.mean"), 2)


def changed(row: Row, base: Row) -> str:
    if row.state:
        return f"({row.state})"
    return " ".join(f"{key}={as_override(value)}" for key, value in row.params.items()
                    if base.params.get(key) != value)


@dataclass
class Column:
    header: str
    cell: Callable[[Row, Row], str]  # (row, its baseline) -> text
    sort: Callable[[Row], Any] | None = None  # the value --sort-by orders by


def columns(judges: list[str]) -> dict[str, Column]:
    """The table's columns by the name --sort-by takes."""
    return {
        "experiment": Column("experiment", lambda r, b: r.name if r.baseline else f"  {r.name}", lambda r: r.name),
        "method": Column("method", lambda r, b: setting(r.params), lambda r: setting(r.params)),
        "reward": Column("reward", lambda r, b: rate(r.metrics, "reward"),
                         lambda r: r.metrics.get("reward.policy_positive_rate")),
        **{j: Column(j, lambda r, b, j=j: rate(r.metrics, f"judge.{j}"),
                     lambda r, j=j: r.metrics.get(f"judge.{j}.policy_positive_rate")) for j in judges},
        "kl": Column("KL", lambda r, b: kl(r.metrics), lambda r: r.metrics.get("kl.mean")),
        "objective": Column("obj", lambda r, b: number(r.metrics.get("optimum.objective_fraction"), 2),
                            lambda r: r.metrics.get("optimum.objective_fraction")),
        "ppl": Column("ppl", lambda r, b: number(r.metrics.get("fluency.ref_perplexity"), 1),
                      lambda r: r.metrics.get("fluency.ref_perplexity")),
        "distinct2": Column("dist-2", lambda r, b: number(r.metrics.get("diversity.distinct2"), 3),
                            lambda r: r.metrics.get("diversity.distinct2")),
        "train": Column("train", lambda r, b: number(trained(r, "seconds"), 0), lambda r: trained(r, "seconds")),
        "gpu": Column("gpu", lambda r, b: percent(trained(r, "system.gpu_busy")),
                      lambda r: trained(r, "system.gpu_busy")),
        "compiled": Column("compiled", lambda r, b: compiled(r), lambda r: trained(r, "compile.distance")),
        "changed": Column("changed", changed),
    }


def table(groups: list[tuple[Row, list[Row]]], sort_by: str | None = None, descending: bool = False,
          markdown: bool = False) -> str:
    """The comparison: a text table at most WIDTH wide (the changed params wrapped) and its legend, or Markdown."""
    judges = list(dict.fromkeys(found[1] for base, exps in groups for row in (base, *exps)
                                for key in row.metrics if (found := JUDGE.fullmatch(key))))
    cols = columns(judges)
    if sort_by is not None:
        if cols.get(sort_by, Column("", changed)).sort is None:
            raise ParamsError(f"--sort-by: {sort_by} is not a column (one of "
                              f"{', '.join(name for name, col in cols.items() if col.sort)})")
        key = cols[sort_by].sort
        groups = [(base, sorted(exps, key=lambda r: (key(r) is None, key(r) or 0), reverse=descending))
                  for base, exps in groups]
    base = baselines(groups)
    body = [[col.cell(row, base[id(row)]) for col in cols.values()] for commit, exps in groups
            for row in (commit, *exps)]
    headers = [col.header for col in cols.values()]
    if markdown:
        lines = [headers, ["---"] * len(headers), *body]
        return "\n".join("| " + " | ".join(line) + " |" for line in lines) + "\n"
    widths = [max(len(line[i]) for line in (headers, *body)) for i in range(len(headers) - 1)]
    indent = sum(widths) + 2 * len(widths)  # where the last column, the changed params, starts: wrapped to fit
    lines = []
    for line in (headers, *body):
        cells = "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=False))
        if WIDTH - indent >= MIN_CHANGED or line is headers:
            wrapped = textwrap.wrap(line[-1], WIDTH - indent, break_on_hyphens=False) or [""]
            lines += [f"{cells}  {wrapped[0]}".rstrip(), *(" " * indent + more for more in wrapped[1:])]
        else:  # too little room beside the cells (long judge names): the changed params go under the row
            lines += [cells.rstrip(), *textwrap.wrap(line[-1], WIDTH, initial_indent=" " * 4,
                                                    subsequent_indent=" " * 4, break_on_hyphens=False)]
    legend = textwrap.fill(LEGEND.format(judges=", ".join(judges) or "judges"), WIDTH - 1)
    return "\n".join(lines) + "\n\n" + legend + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.compare", description=__doc__.splitlines()[0],
                                     epilog="Other arguments go to dvc exp show (-A, --rev REV, -n N).")
    parser.add_argument("--sort-by", help="order each commit's experiments by a column: experiment, method, reward, "
                                          "a judge's name, kl, objective, ppl, distinct2, train, gpu")
    parser.add_argument("--sort-order", choices=["asc", "desc"], default="asc")
    parser.add_argument("--md", action="store_true", help="a Markdown table (no width limit, no legend)")
    args, dvc_args = parser.parse_known_args()
    groups = rows(json.loads(dvc("exp", "show", "--json", *dvc_args)))
    print(table(groups, args.sort_by, args.sort_order == "desc", args.md), end="")


if __name__ == "__main__":
    run_stage(main)
