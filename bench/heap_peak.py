"""The memory each phase of a PPO iteration holds: ``python -m bench.heap_peak --config tiny-152k --iters 2``.

Runs ``bench.ppo_step`` (any of its arguments) with the trainer's rollout (``generate``, ``make_experience``: the
policy's, value head's and reference's forwards) and ``update`` watched: for each call, one line with the bytes in use
on glibc's heap (``mallinfo2``: its arenas' blocks in use plus its mmapped blocks) before it, their peak during it
(sampled every 0.5 ms by a thread) and the difference, the phase's own tensors. The process's resident set size also
counts the freed memory glibc keeps for reuse (the stages ask it to, ``keep_freed_memory``) and the libraries: it
measures the allocator as much as the phase. The sampling thread takes CPU from the iteration, so its timings are not
``bench.ppo_step``'s. Linux with glibc only.

Runs against an older checkout too (from it: ``PYTHONPATH=. python <this checkout>/bench/heap_peak.py ...``, its
config added if it lacks it): it watches the methods by name, which the trainer has had since the stage began.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

PHASES = ("generate", "make_experience", "update")
MB = 2**20


class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_reader() -> Callable[[], int]:
    """A function returning glibc's heap bytes in use (blocks handed out, mmapped ones included)."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except AttributeError:
        raise SystemExit("error: this C library has no mallinfo2 (glibc 2.33 or later)") from None
    mallinfo2.restype = MallInfo2

    def in_use() -> int:
        info = mallinfo2()
        return info.uordblks + info.hblkhd

    return in_use


class HeapPeak:
    """``with HeapPeak(in_use) as heap: ...``, then ``heap.start`` and ``heap.peak``: the bytes in use on entry and
    the most seen inside (every ``interval`` seconds, and on entry and exit)."""

    def __init__(self, in_use: Callable[[], int], interval: float = 0.0005) -> None:
        self.in_use, self.interval = in_use, interval
        self.stop = threading.Event()

    def __enter__(self) -> HeapPeak:
        self.start = self.peak = self.in_use()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def sample(self) -> None:
        while not self.stop.wait(self.interval):
            self.peak = max(self.peak, self.in_use())

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.in_use())


def watch(cls: type, name: str, in_use: Callable[[], int]) -> None:
    """Replace ``cls.name`` by the same method that prints its heap line."""
    method = getattr(cls, name)

    @functools.wraps(method)
    def watched(self: Any, *args: Any, **kwargs: Any) -> Any:
        with HeapPeak(in_use) as heap:
            result = method(self, *args, **kwargs)
        print(f"heap {name}: {heap.start / MB:.0f} MB before, peak {heap.peak / MB:.0f} MB, "
              f"{(heap.peak - heap.start) / MB:.0f} MB over", flush=True)
        return result

    setattr(cls, name, watched)


def main() -> None:
    from bench import ppo_step
    from rlhf.pipeline.cli import run_stage
    from rlhf.train.ppo_trainer import PPOTrainer

    in_use = heap_reader()
    for name in PHASES:
        watch(PPOTrainer, name, in_use)
    sys.argv[0] = "bench.heap_peak"
    run_stage(ppo_step.main)


if __name__ == "__main__":
    main()
