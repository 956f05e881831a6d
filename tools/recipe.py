"""Run a named preset of the pipeline as one DVC experiment: ``python -m tools.recipe offline-cpu``.

A preset is a params overlay in ``presets/<name>.yaml`` (only the keys it changes). The runner validates params.yaml
with the overlay applied (so a bad preset fails before anything is written or run), copies local inputs the preset
expects under ``data/raw/`` when they are missing (from ``--imdb`` / ``--tokenizer``, required only then), then runs
``dvc exp run`` with one ``-S`` per key. The user's own ``-S key=value`` apply over the preset's (validated the same
way); other arguments go to ``dvc exp run``. ``--dry-run`` validates and prints the copies and the command, and writes
nothing. The result is an ordinary experiment: ``dvc exp show`` and ``dvc metrics diff`` compare it with any other.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import shlex
import sys

from rlhf.pipeline.cli import run_stage
from rlhf.pipeline.errors import ParamsError
from rlhf.pipeline.params import PARAMS_FILE, read_yaml
from tools.presets import (
    add_input_flags,
    as_override,
    copy_inputs,
    flatten,
    load_preset,
    local_inputs,
    parse_sets,
    run_dvc,
    validate,
)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.recipe", description=__doc__.splitlines()[0])
    parser.add_argument("preset", help="a preset name from presets/ (offline-cpu, offline-gpu)")
    add_input_flags(parser)
    parser.add_argument("-S", "--set-param", action="append", default=[], metavar="KEY=VALUE",
                        help="a params key over the preset's (repeatable), validated with it")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate, print the copies and the dvc command; write and run nothing")
    args, dvc_args = parser.parse_known_args()

    changes = flatten(load_preset(args.preset)) | parse_sets(args.set_param, "-S")
    copies = local_inputs(changes, {"imdb": args.imdb, "tokenizer": args.tokenizer})
    validate(read_yaml(PARAMS_FILE), changes, copies)
    check_dvc_arguments(dvc_args)
    copy_inputs(copies, args.dry_run)

    command = ["dvc", "exp", "run", *dvc_args]
    for key, value in flatten(changes).items():
        command += ["-S", f"{key}={as_override(value)}"]
    print(shlex.join(command), flush=True)
    if not args.dry_run:
        sys.exit(run_dvc(command).returncode)


def check_dvc_arguments(dvc_args: list[str]) -> None:
    """The arguments passed on to ``dvc exp run``, checked by DVC's own parser before anything is copied: an unknown
    one failed only once the inputs had been copied."""
    from dvc.cli import DvcParserError, parse_args

    logging.disable(logging.ERROR)  # DVC's parser logs its reason and prints its whole usage
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            parse_args(["exp", "run", *dvc_args])
    except DvcParserError:
        raise ParamsError(f"{shlex.join(dvc_args)}: not arguments of dvc exp run (dvc exp run --help lists "
                          "them)") from None
    finally:
        logging.disable(logging.NOTSET)


if __name__ == "__main__":
    run_stage(main)
