"""Stage processes for the tests without their imports: ``python tests/zygote.py`` imports the libraries the stages
load (torch, transformers' model classes, pandas, pyarrow, ...) once, then forks a child for each stage run asked of
it; the child becomes ``python -m stages.<name> ...`` (or ``python <script> ...``) in the request's folder and
environment and runs to its own exit, as a fresh interpreter would from there on: its own exit status, signals,
atexit handlers and finalisation. A test pays its stage's work instead of the seconds of imports before it.

One JSON request per line on stdin: ``{"argv", "cwd", "env", "out", "err"}`` (``argv`` without the interpreter; the
child's stdout and stderr go to the files ``out`` and ``err``, its stdin is the null device). When the child has
ended, one line on stdout: its return code as ``subprocess`` gives it (``-N``: killed by signal N). EOF on stdin ends
the zygote. tests/helpers.py's ``run`` sends each run of this Python here whose environment matches the zygote's but
for the variables of its ``PER_RUN`` (PYTHONPATH: the child puts it on ``sys.path``): what a library reads from the
environment at import is the zygote's.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import random
import runpy
import sys
import threading
import warnings

import numpy

# transformers' lazy top-level names load from these (the model loading path and GPT-2, the tests' model)
PRELOAD = ("accelerate.utils", "dvclive", "pandas", "psutil", "pyarrow.parquet", "pydantic", "safetensors.torch",
           "torch.distributed.checkpoint", "tqdm", "transformers", "transformers.modeling_utils",
           "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto",
           "transformers.models.gpt2.modeling_gpt2", "transformers.tokenization_utils_fast")


def preload() -> None:
    """What every stage process would import (the costly part), and nothing of the project: each test's project
    folder has its own ``rlhf`` and ``stages``. No Python thread may run at the fork (the child would hold its locks
    with nobody to release them); the native ones started at import (OpenBLAS's pool, jemalloc's background thread)
    are made fork-safe by their libraries, as for PyTorch's forked data loader workers; nothing has computed yet, so
    no OpenMP pool exists."""
    for name in PRELOAD:
        importlib.import_module(name)
    if threading.active_count() != 1:
        raise RuntimeError(f"a preloaded library started a thread: {threading.enumerate()}")
    import torch

    if torch.cuda.is_initialized():  # a forked child could not use the GPU
        raise RuntimeError("a preloaded library initialised CUDA")


def serve() -> dict:
    """Answer requests until EOF; in each child, return its request (the child leaves the loop, so that the stage
    runs at the top of the stack and its exit is the interpreter's own)."""
    preload()
    gc.freeze()  # a child's collections would walk the preloaded objects, copying the pages they touch
    # Python 3.12+ warns at each fork of a process with native threads; those here are fork-safe (preload's docstring)
    warnings.filterwarnings("ignore", r"This process \(pid=\d+\) is multi-threaded", DeprecationWarning)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return request
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)
    sys.exit(0)


def become(request: dict) -> None:
    """Turn this child into the requested process: folder, environment, standard streams, ``sys.path`` and
    ``sys.argv`` as the interpreter would set them, then run the module or script as ``__main__``."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, opened in ((0, os.open(os.devnull, os.O_RDONLY)),
                       (1, os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)),
                       (2, os.open(request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))):
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the buffered one may hold what the zygote read ahead)
    random.seed()  # the generators seeded from the OS at import, as a fresh interpreter's are
    numpy.random.seed()
    argv = request["argv"]
    python_path = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    module = argv[1] if argv[0] == "-m" else None
    sys.path[:] = [os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0])), *python_path,
                   *sys.path[1:]]
    if module:
        sys.argv = [module, *argv[2:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    become(serve())
