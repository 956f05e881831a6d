"""Run a reward-KL frontier sweep as DVC experiments: ``python -m tools.frontier offline-cpu``.

Each point of the sweep is one ordinary experiment (``dvc exp run -n <preset>-kl0.05 -S <preset keys> -S <knob>``):
HEAD's params.yaml, the preset's overlay (none: params.yaml as committed), every ``--set``, then the point's KL knob.
The points share the cached prepare / sft / reward outputs, so after the first point only ppo and evaluate run. A point
already present among HEAD's experiments with exactly these params is skipped, so a rerun after adding a point runs
only the new one. Then ``metrics/frontier/<preset>.csv`` (one row per point, plus the reference at KL 0) and the chart
data ``metrics/frontier/chart/<preset>.json`` are rebuilt from every experiment of the preset's sweeps
(``--collect`` does only that).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from rlhf.eval.frontier import Point, frontier_rows, grid, same, write_frontier
from rlhf.pipeline.cli import run_stage
from rlhf.pipeline.errors import ParamsError, PipelineError
from rlhf.pipeline.params import parse_params
from tools.recipe import (
    add_input_flags,
    as_override,
    copy_inputs,
    flatten,
    load_preset,
    local_inputs,
    overlay,
    parse_sets,
    run_dvc,
)

NO_PRESET = "params"  # the name of a sweep over params.yaml as committed
# on offline-cpu (BENCHMARKS.md) 0.4 gave 1.7 nats, 0.25 3.7 and 0.1 11.4 (where the policy collapses onto stock
# phrases): this grid spans that useful range, denser around the presets' 0.2
DEFAULT_KL_COEFS = [0.1, 0.15, 0.2, 0.3, 0.4]


def dvc(*args: str) -> str:
    """Run a read-only dvc command and return its stdout; its last error line when it fails."""
    result = run_dvc(["dvc", *args], capture_output=True, text=True)
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines() or ["no output"]
        raise PipelineError(f"dvc {' '.join(args)} failed: {lines[-1]}")
    return result.stdout


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
        if exp.get("name") and data:
            metrics = {file: flatten(found.get("data") or {}) for file, found in (data.get("metrics") or {}).items()}
            experiments[exp["name"]] = {"params": flatten(params(data)), "metrics": metrics}
    return params(baseline["data"]), params(workspace["data"]), experiments


def overrides(changes: dict[str, Any], workspace: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """The -S keys of one point: the preset, --set and knob keys, and any key a previous run left different."""
    keys, now = dict(changes), flatten(workspace)
    for key, value in flatten(desired).items():
        if key not in keys and not same(now.get(key), value):
            keys[key] = value
    return keys


def run_point(i: int, n: int, point: Point, keys: dict[str, Any], replace: bool, dry_run: bool) -> None:
    """Run one point as ``dvc exp run -n NAME -S ...`` (its stage logs pass through) and print one progress line."""
    if replace:
        print(f"[{i}/{n}] {point.name}: an experiment of that name has other params; replacing it", flush=True)
        command = ["dvc", "exp", "remove", point.name]
        print(" ".join(command), flush=True)
        if not dry_run and run_dvc(command).returncode != 0:
            raise PipelineError(f"{point.name}: dvc exp remove failed")
    command = ["dvc", "exp", "run", "-n", point.name]
    for key, value in keys.items():
        command += ["-S", f"{key}={as_override(value)}"]
    print(" ".join(command), flush=True)
    if dry_run:
        return
    start = time.perf_counter()
    code = run_dvc(command).returncode
    if code != 0:
        raise PipelineError(f"{point.name}: dvc exp run failed (exit {code}); earlier points are kept as experiments")
    print(f"[{i}/{n}] {point.name}: ran in {time.perf_counter() - start:.0f} s", flush=True)


def sweep(points: list[Point], changes: dict[str, Any], not_copied: dict[str, Path], dry_run: bool) -> None:
    """Validate every point's params, copy the local inputs, then run the points that are not experiments of HEAD
    with these params yet.

    ``not_copied``: the local inputs to copy ({target: source}); their sources stand in for them when the params are
    validated, so nothing is copied for a sweep that would fail."""
    baseline, workspace, experiments = head_experiments()
    desired = {point.name: overlay(baseline, changes | point.knob) for point in points}
    for point in points:  # a bad key fails here, named, before any point runs
        stand_ins = {key: str(not_copied[v]) for key, v in flatten(desired[point.name]).items()
                     if isinstance(v, str) and v in not_copied}
        parse_params(overlay(desired[point.name], stand_ins), ".")
    copy_inputs(not_copied, dry_run)
    for i, point in enumerate(points, 1):
        found = experiments.get(point.name)
        if found and same(found["params"], flatten(desired[point.name])):
            print(f"[{i}/{len(points)}] {point.name}: skipped (an experiment with these params exists)", flush=True)
            continue
        keys = overrides(changes | point.knob, workspace, desired[point.name])
        run_point(i, len(points), point, keys, replace=found is not None, dry_run=dry_run)
        workspace = desired[point.name]


def float_list(text: str) -> list[float]:
    """``0.05,0.1`` -> [0.05, 0.1] (duplicates dropped); argparse names the flag when a value is not a number."""
    values = [float(part) for part in text.split(",") if part.strip()]
    if any(value < 0 for value in values):
        raise argparse.ArgumentTypeError(f"{text!r}: values must be >= 0")
    return list(dict.fromkeys(values))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.frontier", description=__doc__.splitlines()[0])
    parser.add_argument("preset", nargs="?", help="a preset from presets/ (none: params.yaml as committed)")
    parser.add_argument("--kl-coef", type=float_list, default=None, metavar="C1,C2,...",
                        help="fixed KL coefficients (ppo.adap_kl_ctrl=false); default "
                             f"{','.join(map(str, DEFAULT_KL_COEFS))} unless --target is given")
    parser.add_argument("--target", type=float_list, default=[], metavar="T1,T2,...",
                        help="adaptive KL targets in nats (ppo.adap_kl_ctrl=true)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a params key for every point of the sweep (repeatable; needs --series)")
    parser.add_argument("--series", help="the sweep's name in experiment names and the chart (e.g. rloo)")
    parser.add_argument("--collect", action="store_true", help="only rebuild the table from existing experiments")
    parser.add_argument("--dry-run", action="store_true", help="print the dvc commands; run and write nothing")
    add_input_flags(parser)
    args = parser.parse_args()

    name = args.preset or NO_PRESET
    preset = load_preset(args.preset) if args.preset else {}
    extras = parse_sets(args.set, "--set")
    if extras and not args.series:
        raise ParamsError("--set: name the series with --series (its points need names of their own)")
    kl_coefs = DEFAULT_KL_COEFS if args.kl_coef is None and not args.target else args.kl_coef or []
    points = [] if args.collect else grid(name, args.series, kl_coefs, args.target)
    if points:
        copies = local_inputs(preset, {"imdb": args.imdb, "tokenizer": args.tokenizer})
        sweep(points, flatten(preset) | extras, copies, args.dry_run)
    if args.dry_run:
        return
    rows = frontier_rows(head_experiments()[2], name, flatten(preset))
    if not rows:
        raise PipelineError(f"no experiment of HEAD belongs to a {name} sweep (names like {name}-kl0.1)")
    table, chart = write_frontier(rows, name)
    print(f"frontier: {len(rows)} rows in {table} (chart data: {chart})", flush=True)


if __name__ == "__main__":
    run_stage(main)
