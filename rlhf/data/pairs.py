"""Reading a chosen/rejected pairs file: prepare's data/pairs, a user's prepare.pairs_source, the sampled pairs. One
reader, and one line naming the file for each way one can be wrong."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from rlhf.pipeline.errors import DataError

SUFFIXES = (".parquet", ".jsonl")


def read_pairs(path: Path | str, key: str = "",
               missing: str = "missing (run the prepare stage first)") -> pd.DataFrame:
    """A Parquet or JSONL file with ``chosen`` and ``rejected`` columns and at least one row (other columns kept);
    ``key``: the param that named the file, ``missing``: what to say when there is no such file."""
    path = Path(path)
    if path.suffix not in SUFFIXES:
        raise DataError(f"{path}: {key or 'a pairs file'} must be a .parquet or .jsonl file")
    if not path.is_file():
        raise DataError(f"{path}: {missing}")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: empty file")
    try:
        # dtype=False: keep "5" a string, never guess types from the text
        frame = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_json(path, lines=True, dtype=False)
    except Exception as e:  # pyarrow / json raise many unrelated types for a bad file
        raise DataError(f"{path}: unreadable pairs file: {str(e).splitlines()[0]}") from None
    for column in ("chosen", "rejected"):
        if column not in frame:
            raise DataError(f"{path}: missing column {column!r} (columns: {', '.join(map(str, frame.columns))})")
    if frame.empty:
        raise DataError(f"{path}: no pairs")
    return frame
