"""The pipeline's stages, one script each (``python -m stages.<name>``), wired by dvc.yaml.

``python -m stages.X`` imports this package before X's own imports (torch, transformers: seconds). While the package
is imported on behalf of ``-m`` (sys.argv[0] is "-m" until the module is found):
- ``-h``/``--help`` is answered here, from X's docstring and dvc.yaml, so it starts at once and loads no model;
- Ctrl-C, SIGTERM and the other stop signals end the process with one line and the signal's exit status (a stop
  during the imports would otherwise print a long traceback from inside them); rlhf.pipeline.cli.run_stage installs
  the handlers that keep checkpoints once the stage starts;
- the stage takes DVC's experiments lock on the workspace (``hold_workspace``) before anything else.

A stage that params switch off (all but prepare and evaluate) imports its model and data code inside the functions
that run when it is on: off, it writes its marker in about a second, without loading transformers.
"""

import atexit
import contextlib
import os
import signal
import sys
from pathlib import Path


def _stop_while_starting(signum: int, frame: object) -> None:
    os.write(2, f"{'interrupted' if signum == signal.SIGINT else 'stopped by ' + signal.Signals(signum).name} "
                "while starting; nothing was run\n".encode())
    os._exit(128 + signum)  # nothing to clean up yet; atexit hooks of half-imported libraries would print tracebacks


def hold_workspace(command: str) -> str | None:
    """In a DVC project, hold for this process's life the lock DVC's experiment commands (``exp run``, ``exp run
    --queue``, ``exp apply``) take on the workspace before they touch it: DVC releases its repository lock while a
    stage runs, so a second ``dvc exp run`` would otherwise stash the workspace and write its ``-S`` values into
    params.yaml under this stage (params.changed_since_read catches a change that comes anyway, e.g. by hand). DVC
    drops a killed holder's entry. Returns why the lock could not be taken (another DVC command is changing the
    workspace, or .dvc/tmp cannot be written), else None; only rank 0 takes it."""
    if not Path(".dvc").is_dir() or os.environ.get("RANK", "0") != "0":
        return None
    try:
        from dvc.fs import localfs
        from dvc.lock import LockError
        from dvc.rwlock import rwlock
    except ImportError:  # DVC is a dependency; without it nothing can start a DVC command either
        return None
    lock = Path(".dvc/tmp/exps")  # where DVC's experiment commands keep their rwlock (dvc/repo/experiments)
    stack = contextlib.ExitStack()
    try:
        lock.mkdir(parents=True, exist_ok=True)
        stack.enter_context(rwlock(str(lock), localfs, command, [], ["workspace"], False))
    except LockError as e:
        busy = str(e).splitlines()[0] + " " + " ".join(line.strip() for line in str(e).splitlines()[1:2])
        return f"this workspace is busy: {busy} (DVC's experiments lock: wait for that command)"
    except OSError as e:  # a read-only project, an immutable or foreign-owned .dvc/tmp
        return f"{lock}: cannot take DVC's experiments lock there ({e.strerror})"
    atexit.register(stack.close)
    return None


if sys.argv[:1] == ["-m"]:
    from rlhf.pipeline.cli import STOP_SIGNALS

    for _signum in STOP_SIGNALS:
        signal.signal(_signum, _stop_while_starting)
    _args = sys.orig_argv[sys.orig_argv.index("-m") + 1:]  # [stages.X, its arguments...]
    if _args[0].startswith("stages.") and {"-h", "--help"} & set(_args[1:]):
        from rlhf.pipeline.cli import print_help_and_exit

        print_help_and_exit(_args[0].removeprefix("stages."), Path(__file__).resolve().parents[1])
    if _args[0].startswith("stages.") and (_refused := hold_workspace(f"python -m {_args[0]}")):
        print(f"error: {_refused}; nothing was run", file=sys.stderr)
        raise SystemExit(1)
