"""How a stage script or a tool runs from the command line: every way it can fail that is not a bug is one line and an
exit status (a PipelineError, a full disk or GPU out-of-memory: 1; a stop signal: 128 + its number, Ctrl-C 130), and
a stage's ``--help``."""

from __future__ import annotations

import ast
import ctypes
import logging
import os
import signal
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

from rlhf.pipeline.errors import PipelineError, is_disk_full, is_out_of_memory, lost_peer
from rlhf.pipeline.paths import checkpoint_dir, checkpoints, output_path

# Ctrl-C, Ctrl-\, kill's and a scheduler's stop, a closed terminal, a scheduler's warning before its time limit
# (SIGUSR1/2: SLURM's --signal) and a CPU-time limit: each would otherwise end the stage without a word
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                signal.SIGXCPU)
STOPPED_BY = [signal.SIGINT]  # the signal that stopped the run, for the message and the exit status
PROGRAM = [False]  # run_stage runs the program (python -m stages.X, a tool), not a test calling a main
STARTED = time.perf_counter()  # about when the process started: stages/__init__.py imports this module first
# glibc gives a large freed block back to the OS, so a training step's large tensors are faulted in afresh, page by
# page, at every step (kernel time, not compute); served from the heap and kept there, they are reused. The variables
# that set this at start-up -> (glibc's mallopt parameter, the value; mallopt takes an int); a user's own setting of
# either wins.
MALLOC_KEEP = {"MALLOC_MMAP_THRESHOLD_": (-3, 1 << 30), "MALLOC_TRIM_THRESHOLD_": (-1, 1 << 30)}


def keep_freed_memory() -> bool:
    """Have glibc's malloc serve blocks up to 1 GiB from its heap and keep freed memory for reuse (``MALLOC_KEEP``),
    unless the environment sets either already; False where that is so or the C library has no ``mallopt``."""
    if any(name in os.environ for name in MALLOC_KEEP):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return all([mallopt(param, value) for param, value in MALLOC_KEEP.values()])


def stage_help(stage: str, root: Path) -> str:
    """``python -m stages.<stage> --help``: the script's docstring (what it reads and writes) and the params that
    ``root``'s dvc.yaml lists for it, each with its doc. Reads the script without importing it (no torch)."""
    from rlhf.pipeline.params import declaration, expand
    from rlhf.pipeline.wiring import wiring

    doc = ast.get_docstring(ast.parse((root / "stages" / f"{stage}.py").read_text(encoding="utf-8"))) or ""
    keys = expand(wiring(stage, root / "dvc.yaml").params)
    width = max(map(len, keys)) + 1
    params = "\n".join(textwrap.fill(" ".join((declaration(key).description or "").split()), 119,
                                     initial_indent=f"  {key:<{width}}", subsequent_indent=" " * (width + 2))
                       for key in keys)
    return (f"usage: python -m stages.{stage} [-h]\n\n{doc.strip()}\n\n"
            f"Params  (params.yaml; the keys dvc.yaml lists for {stage})\n{params}\n")


def print_help_and_exit(stage: str, root: Path) -> None:
    """``-h``/``--help`` of a stage: its help, exit status 0; a PipelineError (no dvc.yaml there) is one line."""
    try:
        print(stage_help(stage, root), end="")
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    raise SystemExit(0)


def one_line(error: Exception, stage: str | None, out_of_memory: str | None) -> str | None:
    """What to tell the user about ``error``; None for a bug, which keeps its traceback. A full disk that no writer
    named (io.naming_disk_full) names the file the OS reported, if any."""
    if isinstance(error, PipelineError):
        return str(error)
    if is_disk_full(error):
        filename = getattr(error, "filename", None)
        return (f"disk full writing {output_path(Path(filename))}" if filename
                else f"disk full ({str(error).splitlines()[0]})")
    if is_out_of_memory(error) and out_of_memory:
        return f"out of GPU memory in {stage}: {out_of_memory}"
    if why := lost_peer(error):  # that process's own output says why it died
        return f"another process of this run died ({why})" + kept(stage, None)
    return None


def kept(stage: str | None, step: int | None) -> str:
    """`` at step N; checkpoint <folder> kept; rerun to resume`` or ``; nothing written`` (a stage writes its outputs
    only when it completes); nothing for a tool."""
    if stage is None:
        return ""
    found = checkpoints(checkpoint_dir(stage))
    return ("" if step is None else f" at step {step}") + (
        f"; checkpoint {found[-1]} kept; rerun to resume" if found else "; nothing written")


def stop_signals(handler: Callable[[int, object], None] | int) -> None:
    """Every signal of STOP_SIGNALS gets ``handler``."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, handler)


def finishing() -> None:
    """A program ignores stop signals once its outputs start going in (io.StagedOutputs.commit) and once its main is
    over: a stop then reported a finished run as failed (DVC recorded nothing and the rerun started over, its
    checkpoints gone), and during the interpreter's exit (seconds with torch loaded) it killed the finished process
    outright, Python having put the default handlers back."""
    if PROGRAM[0]:
        stop_signals(signal.SIG_IGN)


def raise_interrupt(signum: int, frame: object) -> None:
    """A stop signal reads like Ctrl-C: a KeyboardInterrupt where the stage is, so it keeps its checkpoint. Those that
    follow are ignored: raised while the first unwinds, they broke off its cleanup."""
    stop_signals(signal.SIG_IGN)
    STOPPED_BY[0] = signal.Signals(signum)
    raise KeyboardInterrupt


def run_stage(main: Callable[[], None], out_of_memory: str | None = None) -> None:
    """Run the ``main`` of a stage script (module ``stages.<name>``) or a tool: a PipelineError, a full disk or GPU
    out-of-memory (``out_of_memory``: what to lower) is ``error: <message>``, exit status 1; a stop signal is one
    ``interrupted`` (``stopped by SIGTERM``) line saying what was kept, exit status 128 + the signal. A stage takes
    no argument (``-h`` is answered before it loads: stages/__init__.py): any other is refused, exit status 2; so is
    a stage run as a file, without the start-up stages/__init__.py gives ``python -m``."""
    module = sys.modules[main.__module__]
    name = module.__spec__.name if module.__spec__ else module.__name__
    if name == "__main__" and Path(module.__file__).parent.name == "stages":  # python stages/ppo.py
        print(f"error: run a stage as python -m stages.{Path(module.__file__).stem} from the project root (dvc.yaml's "
              "command), not as a file", file=sys.stderr)
        raise SystemExit(2)
    stage = name.removeprefix("stages.") if name.startswith("stages.") else None
    if stage is not None and sys.argv[1:]:
        print(f"error: python -m stages.{stage} takes no arguments but -h (got {' '.join(sys.argv[1:])}): set "
              "params in params.yaml or with dvc exp run -S key=value", file=sys.stderr)
        raise SystemExit(2)
    PROGRAM[0] = module.__name__ == "__main__"
    if PROGRAM[0]:
        keep_freed_memory()
    stop_signals(raise_interrupt)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        main()
        finishing()
        if stage is not None:  # the wall time, imports included
            logging.getLogger(stage).info("%s: done in %.1f s", stage, time.perf_counter() - STARTED)
    except KeyboardInterrupt as e:
        stop_signals(signal.SIG_IGN)  # a second Ctrl-C must not add a traceback to the one line
        stopped = "interrupted" if STOPPED_BY[0] == signal.SIGINT else f"stopped by {STOPPED_BY[0].name}"
        print(stopped + kept(stage, getattr(e, "step", None)), file=sys.stderr)
        raise SystemExit(128 + STOPPED_BY[0]) from None
    except Exception as e:
        message = one_line(e, stage, out_of_memory)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        finishing()
