"""The pipeline's stages, one script each (``python -m stages.<name>``), wired by dvc.yaml.

``python -m stages.X`` imports this package before X's own imports (torch, transformers: seconds). While the package
is imported on behalf of ``-m`` (sys.argv[0] is "-m" until the module is found):
- ``-h``/``--help`` is answered here, from X's docstring and dvc.yaml, so it starts at once and loads no model;
- Ctrl-C, SIGTERM and the other stop signals end the process with one line and the signal's exit status (a stop
  during the imports would otherwise print a long traceback from inside them); rlhf.pipeline.cli.run_stage installs
  the handlers that keep checkpoints once the stage starts;
- the stage takes DVC's experiments lock on the workspace (rlhf/pipeline/under_dvc.py) before anything else, so that
  a ``dvc exp run`` started beside it is refused by DVC before it rewrites params.yaml.

A stage that params switch off (all but prepare and evaluate) imports its model and data code inside the functions
that run when it is on: off, it writes its marker in about a second, without loading transformers.
"""

import os
import signal
import sys
from pathlib import Path


def _stop_while_starting(signum: int, frame: object) -> None:
    os.write(2, f"{'interrupted' if signum == signal.SIGINT else 'stopped by ' + signal.Signals(signum).name} "
                "while starting; nothing was run\n".encode())
    os._exit(128 + signum)  # nothing to clean up yet; atexit hooks of half-imported libraries would print tracebacks


if sys.argv[:1] == ["-m"]:
    from rlhf.pipeline.cli import STOP_SIGNALS

    for _signum in STOP_SIGNALS:
        signal.signal(_signum, _stop_while_starting)
    _args = sys.orig_argv[sys.orig_argv.index("-m") + 1:]  # [stages.X, its arguments...]
    if _args[0].startswith("stages.") and {"-h", "--help"} & set(_args[1:]):
        from rlhf.pipeline.cli import print_help_and_exit

        print_help_and_exit(_args[0].removeprefix("stages."), Path(__file__).resolve().parents[1])
    if _args[0].startswith("stages."):
        from rlhf.pipeline.under_dvc import hold_workspace

        if _busy := hold_workspace(f"python -m {_args[0]}"):
            print(f"error: this workspace is busy: {_busy} (DVC's experiments lock: wait for that command); nothing "
                  "was run", file=sys.stderr)
            raise SystemExit(1)
