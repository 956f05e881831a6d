"""The pipeline's exceptions: ``PipelineError`` and its kinds, for everything a user can get wrong (one line that names
the culprit), ``Stopped``, a stop signal where the program was, and how to recognise a full disk or GPU out-of-memory
(rlhf/pipeline/cli.py turns each into one line and an exit status)."""

from __future__ import annotations

import contextlib
import errno
import signal
import sys
from collections.abc import Callable, Iterator


class PipelineError(Exception):
    """Bad input (params, data files, model paths) or a numerical fault, stated in one line that names the culprit."""


class ParamsError(PipelineError):
    """A params.yaml key (``key``, dotted, when one is to blame) is unknown, missing, mistyped or impossible."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class DataError(PipelineError):
    """A data file is missing, unreadable or has the wrong schema or content."""


class ModelError(PipelineError):
    """A model or tokenizer path/id cannot be loaded or does not fit the pipeline."""


class RewardFunctionError(PipelineError):
    """A reward function (reward.functions) cannot be imported, raises, or returns other than a finite float each."""


class TrainingError(PipelineError):
    """A numerical fault during training (NaN/inf score, loss or gradient)."""


class Stopped(KeyboardInterrupt):
    """A stop signal (Ctrl-C: SIGINT) raised where the program was, so that it unwinds as from Ctrl-C, keeping its
    checkpoint; ``step``: the training step it stopped (``interrupted_at``)."""

    def __init__(self, signum: int = signal.SIGINT, step: int | None = None) -> None:
        super().__init__(signum)
        self.signum, self.step = signal.Signals(signum), step


@contextlib.contextmanager
def interrupted_at(step: Callable[[], int]) -> Iterator[None]:
    """A stop inside the block (a plain KeyboardInterrupt is Ctrl-C's) carries the step it came at."""
    try:
        yield
    except Stopped as e:
        e.step = step() if e.step is None else e.step
        raise
    except KeyboardInterrupt:
        raise Stopped(signal.SIGINT, step()) from None


def is_disk_full(error: BaseException) -> bool:
    """ENOSPC/EDQUOT as an OSError, or as the text of a writer that wraps it (safetensors' Rust I/O error)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return any(text in str(error) for text in ("No space left on device", "Disk quota exceeded"))


def is_out_of_memory(error: BaseException) -> bool:
    torch = sys.modules.get("torch")  # a stage that never imported torch cannot have run out of GPU memory
    return torch is not None and isinstance(error, torch.OutOfMemoryError)


def processes(error: BaseException) -> int | None:
    """The process count of the multi-process run that ``error`` stopped, where it can be a collective's failure
    (another process died: gloo raises a plain RuntimeError, NCCL a DistError, itself one); None otherwise."""
    dist = sys.modules.get("torch.distributed")
    if not isinstance(error, RuntimeError) or dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_world_size() if dist.get_world_size() > 1 else None
