"""IMDb from any of its usual shapes -> one DataFrame per split with columns text, label, rating, review_id.

Sources: a Hub dataset id, a folder of Parquet splits (``train.parquet``, ``test.parquet``, optional
``unsupervised.parquet``, as in ../shared/imdb), a CSV file (``text``/``label`` or Kaggle's ``review``/``sentiment``),
or an extracted ``aclImdb/`` folder. Every problem is a DataError that names the file.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from stages.core.errors import DataError

log = logging.getLogger(__name__)

COLUMNS = ["text", "label", "rating", "review_id"]
SPLITS = ("train", "test", "unsupervised")
SENTIMENT_NAMES = {"negative": 0, "positive": 1, "neg": 0, "pos": 1}
CSV_TEST_SHARE = 0.5  # a single CSV without a `split` column is cut in half, like IMDb's own 25k/25k


def load_imdb(source: str, revision: str | None, splits: Sequence[str]) -> dict[str, pd.DataFrame]:
    """Load the requested splits from ``source`` as DataFrames with columns text, label, rating, review_id."""
    for split in splits:
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r} (known: {', '.join(SPLITS)})")
    path = Path(source).expanduser()
    if path.is_file() and path.suffix.lower() == ".csv":
        frames = _read_csv(path, splits)
    elif path.is_dir() and (path / "train" / "pos").is_dir():
        frames = {split: _read_aclimdb(path, split) for split in splits}
    elif path.is_dir():
        frames = {split: _read_parquet(path, split) for split in splits}
    elif path.exists() or source.startswith((".", "/", "~")):
        raise DataError(f"{source}: not a Parquet folder, a CSV file or an aclImdb/ folder")
    else:
        frames = _read_hub(source, revision, splits)
    return {split: _normalise(frame, f"{source} [{split}]", split) for split, frame in frames.items()}


def _read_parquet(folder: Path, split: str) -> pd.DataFrame:
    path = folder / f"{split}.parquet"
    if not path.exists():
        raise DataError(f"{path}: missing (a Parquet source folder needs {split}.parquet)")
    try:
        return pd.read_parquet(path)
    except Exception as e:  # pyarrow raises several unrelated types for a corrupt file
        raise DataError(f"{path}: unreadable Parquet file: {str(e).splitlines()[0]}") from None


def _read_csv(path: Path, splits: Sequence[str]) -> dict[str, pd.DataFrame]:
    """One CSV holds every split: by its ``split`` column, else a stable half/half cut by row hash."""
    try:
        frame = pd.read_csv(path, encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as e:
        raise DataError(f"{path}: unreadable CSV: {str(e).splitlines()[0]}") from None
    frame = frame.rename(columns={"review": "text", "sentiment": "label"})
    if "label" in frame and not pd.api.types.is_numeric_dtype(frame["label"]):
        frame["label"] = frame["label"].str.lower().map(SENTIMENT_NAMES).fillna(-2)
    if "split" not in frame:
        # hash of the row index, not a shuffle: the cut must not move when the seed or other params change
        in_test = pd.util.hash_pandas_object(pd.Series(np.arange(len(frame))), index=False) % 2 == 1
        frame["split"] = np.where(in_test, "test", "train")
    out = {}
    for split in splits:
        part = frame[frame["split"] == split].drop(columns="split")
        if split == "unsupervised" and part.empty:
            continue
        out[split] = part.reset_index(drop=True)
    return out


def _read_aclimdb(folder: Path, split: str) -> pd.DataFrame:
    """aclImdb/<split>/{pos,neg,unsup}/<id>_<rating>.txt (unsup lives under train/)."""
    parts = [("train/unsup", -1)] if split == "unsupervised" else [(f"{split}/pos", 1), (f"{split}/neg", 0)]
    rows = []
    for sub, label in parts:
        for file in sorted((folder / sub).glob("*.txt")):
            match = re.fullmatch(r"(\d+)_(\d+)", file.stem)
            if match is None:
                raise DataError(f"{file}: name is not <id>_<rating>.txt")
            try:
                text = file.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            rows.append((text, label, int(match[2]), f"{sub.replace('/', '_')}_{match[1]}"))
    if not rows:
        raise DataError(f"{folder}: no reviews found for split {split!r} (expected {parts[0][0]}/*.txt)")
    return pd.DataFrame(rows, columns=COLUMNS)


def _read_hub(source: str, revision: str | None, splits: Sequence[str]) -> dict[str, pd.DataFrame]:
    import datasets

    try:
        dataset = datasets.load_dataset(source, revision=revision)
    except Exception as e:  # the Hub client raises many types; all mean "cannot get this dataset"
        raise DataError(f"data.source: cannot load Hub dataset {source!r}: {str(e).splitlines()[0]}") from None
    missing = [s for s in splits if s not in dataset]
    if missing:
        raise DataError(f"data.source: Hub dataset {source!r} has no split {missing[0]!r}")
    return {split: dataset[split].to_pandas() for split in splits}


def _normalise(frame: pd.DataFrame, where: str, split: str) -> pd.DataFrame:
    for column in ("text", "label"):
        if column not in frame:
            raise DataError(f"{where}: missing column {column!r} (columns: {', '.join(map(str, frame.columns))})")
    if frame.empty:
        raise DataError(f"{where}: no rows")
    if not frame["text"].map(lambda t: isinstance(t, str)).all():
        raise DataError(f"{where}: column 'text' has non-text values")
    allowed = {-1} if split == "unsupervised" else {0, 1}
    labels = pd.to_numeric(frame["label"], errors="coerce")
    bad = ~labels.isin(allowed)
    if bad.any():
        raise DataError(f"{where}: label {frame['label'][bad].tolist()[0]!r} outside {sorted(allowed)} "
                        f"({int(bad.sum())} rows)")
    rating = frame["rating"] if "rating" in frame else pd.Series(0, index=frame.index)
    review_id = frame["review_id"] if "review_id" in frame else pd.Series([f"{split}_{i}" for i in range(len(frame))])
    return pd.DataFrame({
        "text": frame["text"].to_numpy(),
        "label": labels.astype("int64").to_numpy(),
        "rating": pd.to_numeric(rating, errors="coerce").fillna(0).astype("int64").to_numpy(),
        "review_id": review_id.astype(str).to_numpy(),
    })


def filter_reviews(frame: pd.DataFrame, min_chars: int, where: str) -> pd.DataFrame:
    """Keep reviews with more than ``min_chars`` characters (the classic recipe's ``len(text) > 200``)."""
    kept = frame[frame["text"].str.len() > min_chars].reset_index(drop=True)
    if kept.empty:
        raise DataError(f"{where}: no review is longer than prepare.min_review_chars={min_chars} characters")
    return kept
