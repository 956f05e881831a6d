"""Atomic output writing and seeding: a failed or killed stage never leaves a half-written file behind."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python, NumPy and torch (all devices); return a CPU generator for the stage's own draws."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` (file or folder) and move it into place only if the block succeeds.

    An existing ``path`` is replaced in one rename for files; for folders the old one is removed just before the move.
    On error the temporary is deleted and ``path`` keeps its previous content.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    target = tmp / path.name
    try:
        yield target
        if target.is_dir() and path.exists():
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        os.replace(target, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_parquet(table: pa.Table, path: Path | str) -> None:
    """Write a Parquet file atomically."""
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def write_json(obj: Any, path: Path | str) -> None:
    """Write pretty JSON atomically (DVC metrics files are read by people too)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_text(text: str, path: Path | str) -> None:
    """Write a text file atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def remove_outputs(*paths: Path | str) -> None:
    """Delete stale outputs so a failed run cannot leave a previous run's files looking current."""
    for path in map(Path, paths):
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
