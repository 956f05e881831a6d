"""How a stage script or a tool runs from the command line: every way it can fail that is not a bug is one line and an
exit status (a PipelineError, a full disk or GPU out-of-memory: 1; a stop signal: 128 + its number, Ctrl-C 130)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from rlhf.pipeline.errors import PipelineError, Stopped, is_disk_full, is_out_of_memory, processes
from rlhf.pipeline.paths import checkpoint_dir, checkpoints, output_path

# what stops a run: Ctrl-C, kill (and a scheduler's stop), a closed terminal
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STARTED = time.perf_counter()  # about when the process started: stages/__init__.py imports this module first


def stop_signals(handler: Callable[[int, object], None] | int) -> None:
    for signum in STOP_SIGNALS:
        signal.signal(signum, handler)


def stop(signum: int, frame: FrameType | None) -> None:
    """A stop signal reads like Ctrl-C where the program is, so the stage keeps its checkpoint. Those that follow are
    ignored: raised while the first unwinds, they broke off its cleanup. One that comes inside an import (a stage
    imports torch in its main) is raised once the import is done: raised inside it, a library's catch-all around an
    optional import swallowed it and left a half-imported module that failed what followed with a traceback, or torch's
    own import aborted (SIGABRT)."""
    if importing(frame):
        signal.signal(signal.SIGALRM, lambda _alarm, later: stop(signum, later))
        signal.setitimer(signal.ITIMER_REAL, 0.01)
        return
    stop_signals(signal.SIG_IGN)
    raise Stopped(signum)


def importing(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs inside an import (below importlib's frames)."""
    while frame is not None:
        if frame.f_globals.get("__name__") == "importlib._bootstrap":
            return True
        frame = frame.f_back
    return False


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
    if n := processes(error):  # that process's own output says why it died
        return (f"another process of this {n}-process run died or failed ({type(error).__name__}: "
                f"{(str(error).splitlines() or [''])[0]})" + kept(stage, None))
    return None


def kept(stage: str | None, step: int | None) -> str:
    """`` at step N; checkpoint <folder> kept; rerun to resume`` or ``; nothing written`` (a stage writes its outputs
    only when it completes); nothing for a tool. A queued or ``--temp`` experiment runs in a copy of the workspace
    under .dvc/tmp/exps/, which DVC deletes, checkpoints and all, once the run ends: no rerun can resume there."""
    if stage is None:
        return ""
    found = checkpoints(checkpoint_dir(stage))
    at = "" if step is None else f" at step {step}"
    if found and "/.dvc/tmp/exps/" in Path.cwd().as_posix() + "/":
        return (f"{at}; its checkpoint goes with DVC's temporary workspace of this queued run: queued again it starts "
                "over (dvc exp run in the workspace keeps checkpoints across a stop)")
    return at + (f"; checkpoint {found[-1]} kept; rerun to resume" if found else "; nothing written")


def under_dvc(stage: str | None) -> str:
    """What is true of a failed stage's outputs under ``dvc repro``/``dvc exp run``, which removed them before it ran
    (DVC_STAGE is DVC's variable for a stage's command); nothing elsewhere."""
    return (f" (dvc checkout {stage} brings back the outputs DVC removed before the run)"
            if stage is not None and os.environ.get("DVC_STAGE") else "")


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
    program = module.__name__ == "__main__"  # not a test calling a main
    stop_signals(stop)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        main()
    except KeyboardInterrupt as e:
        stop_signals(signal.SIG_IGN)  # a second Ctrl-C must not add a traceback to the one line
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        print(("interrupted" if signum == signal.SIGINT else f"stopped by {signum.name}")
              + kept(stage, getattr(e, "step", None)) + under_dvc(stage), file=sys.stderr)
        raise SystemExit(128 + signum) from None
    except Exception as e:
        # a stop arriving while the error is told must not add its traceback to the line: in a multi-process run,
        # torchrun stops a process whose collective just failed because another died, often at that very moment
        stop_signals(signal.SIG_IGN)
        message = one_line(e, stage, out_of_memory)
        if message is None:
            raise
        print(f"error: {message}{under_dvc(stage)}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        for signum in STOP_SIGNALS if program else ():  # a stop while a finished process exits (seconds with torch
            signal.signal(signum, signal.SIG_IGN)  # loaded) must not kill it; no project code after a stage's outputs
    if stage is not None:  # the wall time, imports included
        logging.getLogger(stage).info("%s: done in %.1f s", stage, time.perf_counter() - STARTED)
    if program and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # one of a launcher's processes, done and its group destroyed: FSDP2's device mesh keeps the gloo group
        # alive past destroy_process_group, and its threads, met by the interpreter's teardown, can abort a run that
        # succeeded (SIGABRT: "terminate called without an active exception"). So it leaves without the teardown
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

