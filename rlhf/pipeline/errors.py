"""The pipeline's exceptions: ``PipelineError`` and its kinds, for everything a user can get wrong (one line that names
the culprit), a training loop's Ctrl-C, and how to recognise a full disk or GPU out-of-memory (rlhf/pipeline/cli.py
turns each into one line and an exit status)."""

from __future__ import annotations

import contextlib
import errno
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


class Interrupted(KeyboardInterrupt):
    """Ctrl-C inside a training loop, carrying the step it was on."""

    def __init__(self, step: int) -> None:
        super().__init__(step)
        self.step = step


@contextlib.contextmanager
def interrupted_at(step: Callable[[], int]) -> Iterator[None]:
    """Ctrl-C inside the block becomes ``Interrupted(step())``."""
    try:
        yield
    except Interrupted:
        raise
    except KeyboardInterrupt:
        raise Interrupted(step()) from None


def is_disk_full(error: BaseException) -> bool:
    """ENOSPC/EDQUOT as an OSError, or as the text of a writer that wraps it (safetensors' Rust I/O error)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return any(text in str(error) for text in ("No space left on device", "Disk quota exceeded"))


def is_out_of_memory(error: BaseException) -> bool:
    torch = sys.modules.get("torch")  # a stage that never imported torch cannot have run out of GPU memory
    return torch is not None and isinstance(error, torch.OutOfMemoryError)
