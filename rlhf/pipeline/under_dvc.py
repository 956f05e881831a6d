"""What a running stage does about the DVC process around it, for two things DVC 3 leaves to it.

- DVC releases its repository lock while a stage's command runs (``dvc repro`` and ``dvc exp run`` alike), so a second
  ``dvc exp run`` in the same workspace can start then: it stashes the workspace and writes its ``-S`` values into
  params.yaml before its own stages are refused, under the running stage (which then trains with, or is recorded
  with, the other values). ``hold_workspace`` holds, for the stage's whole run, the lock DVC's experiment commands
  (``exp run``, ``exp run --queue``, ``exp apply``) take on the workspace before they touch it, so DVC refuses them
  at once, naming the stage. (params.changed_since_read catches a change that comes anyway, e.g. an edit by hand.)
- ``kill <pid of dvc>`` stops DVC alone: the stage runs on as an orphan whose result DVC never records, and the next
  ``dvc repro`` starts it over. ``dvc_gone`` tells a stage DVC started that DVC has exited; the stage then stops right
  after its next checkpoint, so that the rerun resumes from it. A stage run by hand is never stopped this way (a
  ``nohup`` run outlives its shell on purpose).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
from pathlib import Path

from rlhf.pipeline.errors import PipelineError
from rlhf.pipeline.paths import checkpoint_dir, checkpoints

EXPERIMENTS_LOCK = Path(".dvc/tmp/exps")  # where DVC keeps its experiment commands' rwlock (dvc/repo/experiments)


def hold_workspace(command: str) -> str | None:
    """In a DVC project (./.dvc), take DVC's experiments lock on the workspace for this process's life (released at
    exit; a killed holder's entry is dropped by DVC, which checks that its pid lives). Returns why it could not be
    taken (another DVC command is changing the workspace, or .dvc/tmp cannot be written), else None. Only the first
    process of a multi-process run takes it."""
    if not Path(".dvc").is_dir() or os.environ.get("RANK", "0") != "0":
        return None
    try:
        from dvc.fs import localfs
        from dvc.lock import LockError
        from dvc.rwlock import rwlock
    except ImportError:  # DVC is a dependency; without it nothing can start a DVC command either
        return None
    stack = contextlib.ExitStack()
    try:
        EXPERIMENTS_LOCK.mkdir(parents=True, exist_ok=True)
        stack.enter_context(rwlock(str(EXPERIMENTS_LOCK), localfs, command, [], ["workspace"], False))
    except LockError as e:
        busy = str(e).splitlines()[0] + " " + " ".join(line.strip() for line in str(e).splitlines()[1:2])
        return f"this workspace is busy: {busy} (DVC's experiments lock: wait for that command)"
    except OSError as e:  # a read-only project, an immutable or foreign-owned .dvc/tmp
        return f"{EXPERIMENTS_LOCK}: cannot take DVC's experiments lock there ({e.strerror})"
    atexit.register(stack.close)
    return None


def _is_dvc(cmdline: list[str]) -> bool:
    """``dvc ...``, ``/path/to/dvc ...``, ``python /path/to/dvc ...`` or ``python -m dvc ...``."""
    return (any(Path(arg).name == "dvc" for arg in cmdline[:2])
            or any(a == "-m" and b == "dvc" for a, b in zip(cmdline, cmdline[1:], strict=False)))


@functools.cache
def _dvc_process() -> tuple[int, float] | None:
    """(pid, start time) of the dvc process that started this stage: DVC sets DVC_STAGE for its stages' commands,
    which it runs through a shell (that may or may not exec the command): the nearest ancestor running dvc."""
    if "DVC_STAGE" not in os.environ:
        return None
    import psutil  # a DVC dependency

    for process in psutil.Process().parents():
        with contextlib.suppress(psutil.Error):
            if _is_dvc(process.cmdline()):
                return process.pid, process.create_time()
    return None


def dvc_gone() -> int | None:
    """The pid of the dvc process that started this stage once it has exited (killed); None while it runs, or when no
    dvc started the stage. The start time tells a reused pid from it; a zombie has exited."""
    found = _dvc_process()
    if found is None:
        return None
    import psutil

    pid, started = found
    try:
        process = psutil.Process(pid)
        alive = process.create_time() == started and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        alive = False
    return None if alive else pid


def stop_if_dvc_gone(stage: str, step: int, pid: int | None) -> None:
    """Right after a checkpoint of ``stage``: with ``pid`` (``dvc_gone()``, agreed by every process) the stage stops,
    keeping that checkpoint, so that the next ``dvc repro`` resumes from it."""
    if pid is not None:
        kept = checkpoints(checkpoint_dir(stage))
        raise PipelineError(f"stopped after step {step}: the dvc process that ran {stage} (pid {pid}) has exited, so "
                            f"it would never record this run; checkpoint {kept[-1] if kept else 'none'} kept: rerun "
                            "(dvc repro) to resume")
