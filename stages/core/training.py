"""Pieces every training stage shares: device choice, mixed precision, the LR schedule, the off-switch marker."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

from stages.core.io import atomic_path, write_text

DISABLED_MARKER = "DISABLED"


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA; fp32 on CPU, where bf16 matmuls are emulated on CPUs without AVX-512 BF16."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                  floor: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the base LR, then cosine decay to ``floor`` x base LR at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def write_disabled(folder: Path | str, reason: str, files: dict[str, str]) -> None:
    """The outputs of a switched-off stage: a folder holding one fixed line, so its hash (and everything downstream)
    stays put, plus ``files`` (path -> fixed text: the stage's metrics and empty plot files)."""
    with atomic_path(folder) as tmp:
        tmp.mkdir()
        (tmp / DISABLED_MARKER).write_text(reason + "\n", encoding="utf-8")
    for path, text in files.items():
        write_text(text, path)
