"""How a stage script runs from the command line: ``--help`` from its record, and every way it can fail turned into one
line and an exit status (a PipelineError, a full disk or GPU out-of-memory: 1; Ctrl-C: 130). Anything else is a bug
and keeps its traceback."""

from __future__ import annotations

import signal
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from rlhf.pipeline.errors import PipelineError, is_disk_full, is_out_of_memory
from rlhf.pipeline.paths import checkpoints, output_path
from rlhf.pipeline.registry import Stage, stage
from rlhf.pipeline.schema import params_model
from rlhf.pipeline.sections import key_doc, read_keys


def stage_help(record: Stage, doc: str) -> str:
    """``--help``: the script's docstring (what it reads and writes) and the params the stage reads, each key with
    its doc (a section it reads whole, key by key)."""
    keys = read_keys(params_model(), record.params)
    width = max(map(len, keys)) + 1
    params = "\n".join(textwrap.fill(key_doc(params_model(), key), 119, initial_indent=f"  {key:<{width}}",
                                      subsequent_indent=" " * (width + 2)) for key in keys)
    return (f"usage: python -m {record.module} [-h]\n\n{doc.strip()}\n\n"
            f"Params  (params.yaml; dvc.yaml lists the same)\n{params}\n")


def interrupted_message(record: Stage | None, step: int | None) -> str:
    """``interrupted at step N; checkpoint <folder> kept; rerun to resume``, or ``...; nothing written`` (a stage
    writes its outputs only when it completes); plain ``interrupted`` for a tool that is no stage."""
    if record is None:
        return "interrupted"
    where = "" if step is None else f" at step {step}"
    kept = checkpoints(record.checkpoints)
    return f"interrupted{where}; " + (f"checkpoint {kept[-1]} kept; rerun to resume" if kept else "nothing written")


def one_line(error: Exception, record: Stage | None) -> str | None:
    """What to tell the user about ``error``; None for a bug, which keeps its traceback. A full disk not met inside
    a writer that names its output (io.atomic_path) names the file the OS reported, if any."""
    if isinstance(error, PipelineError):
        return str(error)
    if is_disk_full(error):
        filename = getattr(error, "filename", None)
        return (f"disk full writing {output_path(Path(filename))}" if filename
                else f"disk full ({str(error).splitlines()[0]})")
    if is_out_of_memory(error) and record is not None and record.out_of_memory:
        return f"out of GPU memory in {record.name}: {record.out_of_memory}"
    return None


def stop_signals(handler: Callable[[int, object], None] | int) -> None:
    """Ctrl-C (SIGINT) and a scheduler's or ``kill``'s stop (SIGTERM) alike get ``handler``."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handler)


STOP_SIGNAL = [signal.SIGINT]  # the signal that stopped the run, for the message and the exit status


def raise_interrupt(signum: int, frame: object) -> None:
    """SIGTERM reads like Ctrl-C: a KeyboardInterrupt where the stage is, so it keeps its checkpoint."""
    STOP_SIGNAL[0] = signal.Signals(signum)
    raise KeyboardInterrupt


def check_no_arguments(record: Stage) -> None:
    """A stage reads params.yaml only: an argument it would ignore (``--steps 10``) is refused, not dropped."""
    if sys.argv[1:]:
        print(f"error: python -m {record.module} takes no arguments but -h (got {' '.join(sys.argv[1:])}): set "
              "params in params.yaml or with dvc exp run -S key=value", file=sys.stderr)
        raise SystemExit(2)


def run_stage(main: Callable[[], None]) -> None:
    """Run the ``main`` of a stage script (its module holds the ``STAGE`` record) or of a tool: a PipelineError, a
    full disk or GPU out-of-memory is ``error: <message>`` and exit status 1; Ctrl-C or SIGTERM one ``interrupted``
    line and exit status 130 (143). A stage's ``-h`` prints its help; any other argument of a stage is refused
    (exit status 2)."""
    module = sys.modules[main.__module__]
    name = module.__spec__.name if module.__spec__ else module.__name__
    record = stage(name.removeprefix("stages.")) if name.startswith("stages.") else None
    if record is not None:
        if {"-h", "--help"} & set(sys.argv[1:]):
            print(stage_help(record, module.__doc__ or ""), end="")
            raise SystemExit(0)
        check_no_arguments(record)
    stop_signals(raise_interrupt)
    try:
        main()
    except KeyboardInterrupt as e:
        stop_signals(signal.SIG_IGN)  # a second Ctrl-C must not add a traceback to the one line
        message = interrupted_message(record, getattr(e, "step", None))
        if STOP_SIGNAL[0] != signal.SIGINT:
            message = message.replace("interrupted", f"stopped by {STOP_SIGNAL[0].name}", 1)
        print(message, file=sys.stderr)
        raise SystemExit(128 + STOP_SIGNAL[0]) from None
    except Exception as e:
        message = one_line(e, record)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(1) from None
