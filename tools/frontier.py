"""Run a reward-KL frontier sweep as DVC experiments: ``python -m tools.frontier offline-cpu``.

Each point of the sweep is one ordinary experiment (``dvc exp run -n <preset>-kl0.05 -S <preset keys> -S <knob>``):
HEAD's params.yaml, the preset's overlay (none: params.yaml as committed), every ``--set``, then the point's KL knob.
The points share the cached prepare / sft / reward outputs, so after the first point only ppo and evaluate run. A point
already present among HEAD's experiments with exactly these params is skipped, so a rerun after adding a point runs
only the new one. Then ``metrics/frontier/<preset>.csv`` (one row per point, plus the reference at KL 0) and the chart
data ``metrics/frontier/chart/<preset>.json`` are rebuilt from every experiment of the preset's sweeps
(``--collect`` does only that). Other methods are series of their own knob: ``--beta`` (DPO), ``--tau`` (IPO),
``--best-of-n``; ``--seeds`` runs each point once per seed (``<name>-s<seed>``) and the means table and chart show the
mean over seeds and its standard error. ``--jobs N`` (N > 1) queues the points and runs N at a time with DVC's
experiment queue (``dvc exp run --queue``, ``dvc queue start -j N``), each in a temporary copy of the project.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from rlhf.eval.frontier import DEFAULT_SERIES, KINDS, Point, frontier_files, frontier_rows, grid, same, write_frontier
from rlhf.pipeline.cli import run_stage
from rlhf.pipeline.errors import ParamsError, PipelineError
from rlhf.pipeline.params import parse_params
from rlhf.pipeline.paths import OPTIMUM_BEST_OF_N, OPTIMUM_CURVE, OPTIMUM_METRICS
from tools.presets import (
    add_input_flags,
    as_override,
    copy_inputs,
    dvc,
    flatten,
    load_preset,
    local_inputs,
    overlay,
    parse_sets,
    run_dvc,
    untracked_inputs,
)

NO_PRESET = "params"  # the name of a sweep over params.yaml as committed
# on offline-cpu (docs/experiments.md) the useful range of KL is spanned by these, from a few nats to the coefficients
# where the policy collapses onto stock phrases; denser around the presets' 0.2
DEFAULT_KL_COEFS = [0.1, 0.15, 0.2, 0.3, 0.4]
POLL_SECONDS = 5  # between two looks at the queue: a point takes minutes
IDLE_POLLS = 6  # looks that find our points queued and no worker at all before the queue counts as stalled


def head_experiments() -> tuple[dict[str, Any], dict[str, Any], dict[str, dict]]:
    """HEAD's params, the workspace's params, and HEAD's experiments as {name: {"params": flat, "metrics": {file:
    flat}}}, read from ``dvc exp show --json`` (so params are compared as DVC itself loads them)."""
    rows = json.loads(dvc("exp", "show", "--json"))
    workspace = next(row for row in rows if row["rev"] == "workspace")
    baseline = next((row for row in rows if row["rev"] != "workspace"), None)
    if baseline is None:
        raise PipelineError("dvc exp show: no commit to run experiments on (commit the project first)")

    def params(data: dict) -> dict[str, Any]:
        return (data.get("params") or {}).get("params.yaml", {}).get("data") or {}

    experiments = {}
    for exp in baseline.get("experiments") or []:
        data = (exp.get("revs") or [{}])[0].get("data")
        if not exp.get("name") or not data:
            continue
        if (exp.get("executor") or {}).get("state", "success") != "success" or exp["revs"][0].get("error"):
            experiments[exp["name"]] = {"params": {}, "metrics": {}}  # a failed or unfinished queued run: run again
            continue
        metrics = {file: flatten(found.get("data") or {}) for file, found in (data.get("metrics") or {}).items()}
        experiments[exp["name"]] = {"params": flatten(params(data)), "metrics": metrics}
        if metrics.get(OPTIMUM_METRICS.as_posix(), {}).get("optimum.samples"):
            experiments[exp["name"]]["optimum"] = pool_tables(exp["revs"][0]["rev"])
    return params(baseline["data"]), params(workspace["data"]), experiments


def pool_tables(rev: str) -> dict[str, pd.DataFrame] | None:
    """The optimum stage's curve and best-of-n tables as the experiment ``rev`` committed them (they are small files
    Git keeps, not DVC metrics: a column per beta would flood ``dvc exp show``)."""
    tables = {}
    for key, path in (("curve", OPTIMUM_CURVE), ("best_of_n", OPTIMUM_BEST_OF_N)):
        result = subprocess.run(["git", "show", f"{rev}:{path.as_posix()}"], capture_output=True, text=True)
        if result.returncode != 0 or not result.stdout.strip():
            return None
        tables[key] = pd.read_csv(io.StringIO(result.stdout))
    return tables


def overrides(changes: dict[str, Any], workspace: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """The -S keys of one point: the preset, --set and knob keys, and any key a previous run left different."""
    keys, now = dict(changes), flatten(workspace)
    for key, value in flatten(desired).items():
        if key not in keys and not same(now.get(key), value):
            keys[key] = value
    return keys


def run_point(i: int, n: int, point: Point, keys: dict[str, Any], replace: bool, dry_run: bool,
              queue: list[str] | None = None) -> None:
    """Run one point as ``dvc exp run -n NAME -S ...`` (its stage logs pass through) and print one progress line;
    with ``queue`` (the untracked paths its temporary copy needs) only queue it."""
    if replace:
        print(f"[{i}/{n}] {point.name}: an experiment of that name has other params; replacing it", flush=True)
        command = ["dvc", "exp", "remove", point.name]
        print(" ".join(command), flush=True)
        if not dry_run and run_dvc(command).returncode != 0:
            raise PipelineError(f"{point.name}: dvc exp remove failed")
    command = ["dvc", "exp", "run", "-n", point.name]
    if queue is not None:
        command += ["--queue", *(arg for path in queue for arg in ("-C", path))]
    for key, value in keys.items():
        command += ["-S", f"{key}={as_override(value)}"]
    print(" ".join(command), flush=True)
    if dry_run:
        return
    if queue is not None:
        if run_dvc(command).returncode != 0:
            raise PipelineError(f"{point.name}: dvc exp run --queue failed")
        return
    start = time.perf_counter()
    code = run_dvc(command).returncode
    if code != 0:
        raise PipelineError(f"{point.name}: dvc exp run failed (exit {code}); earlier points are kept as experiments")
    print(f"[{i}/{n}] {point.name}: ran in {time.perf_counter() - start:.0f} s", flush=True)


def sweep(points: list[Point], changes: dict[str, Any], not_copied: dict[str, Path], dry_run: bool,
          jobs: int = 1) -> None:
    """Validate every point's params, copy the local inputs, then run the points that are not experiments of HEAD
    with these params yet: one at a time in the workspace, or with ``jobs`` > 1 through DVC's queue.

    ``not_copied``: the local inputs to copy ({target: source}); their sources stand in for them when the params are
    validated, so nothing is copied for a sweep that would fail."""
    baseline, workspace, experiments = head_experiments()
    desired = {point.name: overlay(baseline, changes | point.knob) for point in points}
    for point in points:  # a bad key fails here, named, before any point runs
        stand_ins = {key: str(not_copied[v]) for key, v in flatten(desired[point.name]).items()
                     if isinstance(v, str) and v in not_copied}
        parse_params(overlay(desired[point.name], stand_ins), ".")
    copy_inputs(not_copied, dry_run)
    queued = []
    for i, point in enumerate(points, 1):
        found = experiments.get(point.name)
        if found and same(found["params"], flatten(desired[point.name])):
            print(f"[{i}/{len(points)}] {point.name}: skipped (an experiment with these params exists)", flush=True)
            continue
        keys = overrides(changes | point.knob, workspace, desired[point.name])
        # a queued point runs in a copy of the commit: the local inputs it reads, ignored by git, go with it
        queue = untracked_inputs(flatten(desired[point.name]).values(), not_copied)
        run_point(i, len(points), point, keys, replace=found is not None, dry_run=dry_run,
                  queue=queue if jobs > 1 else None)
        if jobs > 1:
            queued.append(point.name)
        else:  # a queued run leaves the workspace as it was
            workspace = desired[point.name]
    if jobs > 1:
        run_queue(queued, jobs, dry_run)


def queue_status() -> tuple[dict[str, set[str]], bool]:
    """{experiment name: the statuses of its tasks} from ``dvc queue status``, and whether any worker is up."""
    statuses: dict[str, set[str]] = {}
    workers = True
    for line in dvc("queue", "status").splitlines():
        parts = line.split()
        if line.startswith("Worker status:"):
            workers = line.replace(",", "").split()[2:5:2] != ["0", "0"]  # "N active, M idle"
        elif len(parts) >= 4 and parts[0] != "Task":
            statuses.setdefault(parts[1], set()).add(parts[-1])
    return statuses, workers


def run_queue(names: list[str], jobs: int, dry_run: bool) -> None:
    """Start ``jobs`` queue workers and wait until every queued point has run, one progress line each."""
    if not names:
        return
    command = ["dvc", "queue", "start", "-j", str(jobs)]
    print(" ".join(command), flush=True)
    if dry_run:
        return
    if run_dvc(command).returncode != 0:
        raise PipelineError("dvc queue start failed; the points stay queued (dvc queue status)")
    start, waiting, failed, idle = time.perf_counter(), list(names), [], 0
    while waiting:
        time.sleep(POLL_SECONDS)
        statuses, workers = queue_status()
        idle = 0 if workers else idle + 1
        for name in list(waiting):
            if not statuses.get(name, set()) & {"Queued", "Running"}:
                waiting.remove(name)
                ok = "Failed" not in statuses.get(name, set())
                if not ok:
                    failed.append(name)
                verdict = f"ran in {time.perf_counter() - start:.0f} s" if ok else f"failed (dvc queue logs {name})"
                print(f"[{len(names) - len(waiting)}/{len(names)}] {name}: {verdict}", flush=True)
        if waiting and idle >= IDLE_POLLS:
            raise PipelineError(f"dvc queue: no worker runs {', '.join(waiting)} (dvc queue start -j {jobs} resumes)")
    if failed:
        raise PipelineError(f"{', '.join(failed)}: failed in the queue (dvc queue logs NAME); the other points are "
                            "kept as experiments")


def number_list(cast: Callable[[str], float], minimum: int) -> Callable[[str], list]:
    """An argparse type: ``0.05,0.1`` -> [0.05, 0.1] (duplicates dropped), each value >= ``minimum``; argparse names
    the flag when a value is not a number of that kind."""
    def parse(text: str) -> list:
        values = [cast(part) for part in text.split(",") if part.strip()]
        if not values:  # an empty shell variable swept nothing and exited 0
            raise argparse.ArgumentTypeError(f"{text!r}: no value")
        if any(value < minimum for value in values):
            raise argparse.ArgumentTypeError(f"{text!r}: values must be >= {minimum}")
        return list(dict.fromkeys(values))

    parse.__name__ = f"{getattr(cast, '__name__', 'number')} list"  # argparse's "invalid <name> value"
    return parse


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools.frontier", description=__doc__.splitlines()[0])
    parser.add_argument("preset", nargs="?", help="a preset from presets/ (none: params.yaml as committed)")
    parser.add_argument("--kl-coef", type=number_list(float, 0), default=None, metavar="C1,C2,...",
                        help="PPO at fixed KL coefficients (ppo.adap_kl_ctrl=false); default "
                             f"{','.join(map(str, DEFAULT_KL_COEFS))} unless another knob is given")
    parser.add_argument("--target", type=number_list(float, 0), default=[], metavar="T1,T2,...",
                        help="PPO at adaptive KL targets in nats (ppo.adap_kl_ctrl=true)")
    parser.add_argument("--beta", type=number_list(float, 0), default=[], metavar="B1,B2,...",
                        help="DPO (method=dpo, dpo.loss=dpo) at these dpo.beta; series 'dpo' unless --series")
    parser.add_argument("--tau", type=number_list(float, 0), default=[], metavar="T1,T2,...",
                        help="IPO (method=dpo, dpo.loss=ipo) at these dpo.tau; series 'ipo' unless --series")
    parser.add_argument("--best-of-n", type=number_list(int, 1), default=[], metavar="N1,N2,...",
                        help="best-of-N (method=best_of_n) at these evaluate.best_of_n; series 'best-of-n'")
    parser.add_argument("--seeds", type=number_list(int, 0), default=[], metavar="S1,S2,...",
                        help="run each point once per seed (param seed; names end in -s<seed>)")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="points run at a time through DVC's experiment queue (default 1: one by one, no queue)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a params key for every point of the sweep (repeatable; needs --series)")
    parser.add_argument("--series", help="the sweep's name in experiment names and the chart (e.g. rloo)")
    parser.add_argument("--collect", action="store_true", help="only rebuild the table from existing experiments")
    parser.add_argument("--dry-run", action="store_true", help="print the dvc commands; run and write nothing")
    add_input_flags(parser)
    return parser


def main() -> None:
    args = arguments().parse_args()
    name = args.preset or NO_PRESET
    preset = load_preset(args.preset) if args.preset else {}
    extras = parse_sets(args.set, "--set")
    if extras and not args.series:
        raise ParamsError("--set: name the series with --series (its points need names of their own)")
    if args.jobs < 1:
        raise ParamsError(f"--jobs: must be >= 1 (got {args.jobs})")
    values = {"kl": args.kl_coef or [], "target": args.target, "beta": args.beta, "tau": args.tau,
              "n": args.best_of_n}
    if args.kl_coef is None and not any(values.values()):
        values["kl"] = DEFAULT_KL_COEFS
    values = {kind: knob_values for kind, knob_values in values.items() if knob_values}
    if args.series in {DEFAULT_SERIES, *(series for series, _ in KINDS.values() if series)}:
        raise ParamsError(f"--series: {args.series!r} is the name of a method's own series (its points would mix "
                          "with that method's); choose another")
    if args.series and len({KINDS[kind][0] for kind in values}) > 1:
        raise ParamsError("--series: one series is one method: give it --kl-coef/--target, --beta, --tau or "
                          "--best-of-n, not several")
    points = [] if args.collect else grid(name, args.series, values, args.seeds)
    if points:
        copies = local_inputs(preset, {"imdb": args.imdb, "tokenizer": args.tokenizer})
        sweep(points, flatten(preset) | extras, copies, args.dry_run, args.jobs)
    if args.dry_run:
        return
    rows = frontier_rows(head_experiments()[2], name, flatten(preset))
    if not rows:
        raise PipelineError(f"no experiment of HEAD belongs to a {name} sweep (names like {name}-kl0.1)")
    table, chart = write_frontier(rows, name)
    print(f"frontier: {len(rows)} rows in {table}, the means over seeds in {frontier_files(name)[1]} and "
          f"{frontier_files(name)[2]} (chart data: {chart})", flush=True)


if __name__ == "__main__":
    run_stage(main)
