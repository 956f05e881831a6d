"""The pipeline's stages (``python -m stages.<name>``) and tools (``tools.recipe``, ``tools.frontier``).

``python -m stages.X`` imports this package before X's own imports (torch, transformers: seconds), so a stop pressed
then would otherwise print a long traceback from inside them. While the package is imported on behalf of ``-m``
(sys.argv[0] is "-m" until the module is found), Ctrl-C and SIGTERM end the process with one line and the signal's
exit status; rlhf.pipeline.errors.run_stage installs the handlers that keep checkpoints once the stage starts.
"""

import os
import signal
import sys


def _stop_while_starting(signum: int, frame: object) -> None:
    os.write(2, f"{'interrupted' if signum == signal.SIGINT else 'stopped by ' + signal.Signals(signum).name} "
                "while starting; nothing was run\n".encode())
    os._exit(128 + signum)  # nothing to clean up yet; atexit hooks of half-imported libraries would print tracebacks


if sys.argv[:1] == ["-m"]:
    for _signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_signum, _stop_while_starting)
