"""Write dvc.yaml's ``stages:`` from the stage records (``STAGE`` in each stages/<name>.py): ``python -m
tools.dvc_yaml``. The rest of dvc.yaml (its top-level plots) is kept as written. ``--check`` exits 1 when dvc.yaml is
not what the records give (tests/test_pipeline_wiring.py runs it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlhf.pipeline.io import write_text
from rlhf.pipeline.registry import ROOT, Output, Stage, stage, stage_names

DVC_YAML = ROOT / "dvc.yaml"
HEADER = """\
# The pipeline: prepare -> sft (optional) -> reward (optional) -> by method, ppo or [sample_pairs ->] ref_logprobs ->
# dpo -> evaluate.
# Written by `python -m tools.dvc_yaml` from each stage's record (STAGE in stages/<name>.py): edit the record, not
# this section. A stage's code deps are the project modules its script imports; its params are what it reads.
# Optional stages always run but write only a marker when switched off, so toggling one reruns exactly what depends
# on it.
"""


def _output(output: Output) -> list[str]:
    lines = [f"      # {output.comment}"] if output.comment else []
    options = ({} if output.cache else {"cache": "false"}) | output.plot
    if not options:
        return [*lines, f"      - {output.path.as_posix()}"]
    return [*lines, f"      - {output.path.as_posix()}:", *(f"          {k}: {v}" for k, v in options.items())]


def render_stage(record: Stage) -> list[str]:
    lines = [f"  {record.name}:", f"    cmd: python -m {record.module}", "    deps:"]
    lines += [f"      - {dep}" for dep in [*record.code, *(p.as_posix() for p in record.deps)]]
    lines += ["    params:", *(f"      - {key}" for key in record.params)]
    for kind in ("outs", "metrics", "plots"):
        outputs = [output for output in record.outputs if output.kind == kind]
        if outputs:
            lines += [f"    {kind}:", *(line for output in outputs for line in _output(output))]
    return lines


def render(current: str) -> str:
    """dvc.yaml with its ``stages:`` section written from the records and everything after it kept."""
    rest = current[current.index("\nplots:"):] if "\nplots:" in current else "\n"
    stages = "\n\n".join("\n".join(render_stage(stage(name))) for name in stage_names())
    return f"{HEADER}stages:\n{stages}\n{rest}"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.dvc_yaml", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only say whether dvc.yaml is current (exit 1 if not)")
    args = parser.parse_args()
    current = DVC_YAML.read_text(encoding="utf-8")
    wanted = render(current)
    if args.check:
        if current != wanted:
            print(f"{DVC_YAML.name} is not what the stage records give: run python -m tools.dvc_yaml", file=sys.stderr)
            raise SystemExit(1)
        return
    if current != wanted:
        write_text(wanted, Path(DVC_YAML))
        print(f"wrote {DVC_YAML.name}")


if __name__ == "__main__":
    main()
