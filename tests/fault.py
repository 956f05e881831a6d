"""Run a pipeline stage with one fault injected from outside its code: ``python tests/fault.py STAGE --at N --kind K``.

Run in the project folder (the stages package importable). Every call of a Python function whose
``<file>:<qualified name>`` matches ``--where`` is counted (``sys.setprofile``, call events only; ``<file>`` relative
to the project for its own code, else absolute); the N-th call raises the fault at its first line, inside the real
code path, and counting stops. The stage module and what it imports are loaded before counting starts, and what
the stage imports where it uses it loads with the profile function off (``unprofiled``): calls made by imports are
not counted, and the stage runs at close to its own speed (a profile function, unlike a trace function, leaves line
events off). A C function is named ``c:<module>.<name>`` (``c:posix.replace``: every ``os.replace``) and counted on
its call too, so a kill can land between two renames (C calls are looked at only when ``--where`` contains ``c:``:
they are most of the calls).
Without ``--at`` the stage runs undisturbed. ``--count FILE`` writes the number of matching calls seen to FILE at
exit, so a test can draw a point among them.
Faults: ``error`` (a RuntimeError, i.e. a bug), ``interrupt`` (Ctrl-C), ``disk-full`` (OSError ENOSPC), ``oom``
(torch.OutOfMemoryError), ``kill`` (SIGKILL: a lost machine, exactly there), ``sigterm``, ``sighup`` (the signal, sent
to the process itself there; one the stage ignores there lets it go on), ``stop`` (SIGSTOP: the stage waits there,
stopped, until a SIGCONT, then goes on, so a test can act while it is at a known point).
"""

from __future__ import annotations

import argparse
import atexit
import builtins
import errno
import importlib
import os
import re
import runpy
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FrameType, ModuleType

SIGNALS = {"kill": signal.SIGKILL, "sigterm": signal.SIGTERM, "sighup": signal.SIGHUP, "stop": signal.SIGSTOP}


def fault(kind: str) -> BaseException | None:
    if kind in SIGNALS:
        os.kill(os.getpid(), SIGNALS[kind])  # a handled signal raises here, through the stage's handler
        if kind == "stop" or signal.getsignal(SIGNALS[kind]) == signal.SIG_IGN:
            return None  # the stage ignores it there: it goes on
        return RuntimeError(f"{kind}: the signal did not stop the stage")
    if kind == "oom":
        import torch

        return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
    return {"error": RuntimeError("injected fault"), "interrupt": KeyboardInterrupt(),
            "disk-full": OSError(errno.ENOSPC, "No space left on device")}[kind]


def unprofiled() -> None:
    """Every import (``import``, ``importlib.import_module``: transformers' lazy modules) runs with the thread's
    profile function off and puts it back after: the libraries the stages import where they need them cost seconds
    at import, as much CPU again as a tiny ppo run under the profile function; preloaded instead, a stage that never
    imports them (switched off, or loading only a tokenizer) paid for them."""

    def wrap(load: Callable[..., ModuleType]) -> Callable[..., ModuleType]:
        def loading(*args: object, **kwargs: object) -> ModuleType:
            profile = sys.getprofile()  # per thread: None inside an import, in another thread, or after the fault
            if profile is None:
                return load(*args, **kwargs)
            sys.setprofile(None)
            try:
                return load(*args, **kwargs)
            finally:
                sys.setprofile(profile)
        return loading

    builtins.__import__ = wrap(builtins.__import__)
    importlib.import_module = wrap(importlib.import_module)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage")
    parser.add_argument("--at", type=int, help="the matching call that raises (1: the first)")
    parser.add_argument("--kind", choices=["error", "interrupt", "disk-full", "oom", *SIGNALS], default="error")
    parser.add_argument("--where", default=r"^(stages|rlhf)/", help="regex over <file>:<qualified name>")
    parser.add_argument("--count", type=Path, help="write the number of matching calls here at exit")
    parser.add_argument("--rank", help="fault only in the process of this RANK (torchrun); the others run on")
    args = parser.parse_args()
    if args.rank is not None and os.environ.get("RANK", "0") != args.rank:
        args.at = None

    root, where = Path.cwd().resolve(), re.compile(args.where)
    matches: dict[CodeType, bool] = {}
    calls = 0
    c_functions = "c:" in args.where  # a C function's label is looked at only when --where names one

    def name(code: CodeType) -> str:
        path = Path(code.co_filename).resolve()
        return f"{path.relative_to(root) if path.is_relative_to(root) else path}:{code.co_qualname}"

    def count(frame: FrameType, event: str, arg: object) -> None:
        nonlocal calls
        if event == "call":
            code = frame.f_code
            found = matches.get(code)
            if found is None:
                # a module's own code runs once, at import, before run_stage takes over: a real Ctrl-C there is the
                # stages package's start-up handler's (tests/test_user_inputs.py), not a fault inside the stage
                found = matches[code] = code.co_name != "<module>" and bool(where.search(name(code)))
            if not found:
                return
            label = name(code)
        elif event == "c_call" and c_functions:
            label = f"c:{getattr(arg, '__module__', None)}.{getattr(arg, '__name__', None)}"
            if not where.search(label):
                return
        else:
            return
        calls += 1
        if calls == args.at:
            sys.setprofile(None)
            print(f"fault: {args.kind} at call {calls}: {label}", file=sys.stderr, flush=True)
            if (error := fault(args.kind)) is not None:
                raise error

    if args.count is not None:
        atexit.register(lambda: args.count.write_text(f"{calls}\n"))
    sys.argv = [f"stages.{args.stage}"]
    importlib.import_module(f"stages.{args.stage}")
    unprofiled()
    del sys.modules[f"stages.{args.stage}"]  # runpy runs it afresh as __main__ (its imports stay loaded)
    sys.setprofile(count)
    try:
        runpy.run_module(f"stages.{args.stage}", run_name="__main__", alter_sys=True)
    finally:
        sys.setprofile(None)


if __name__ == "__main__":
    main()
