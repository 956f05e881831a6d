"""IMDb from any of its usual shapes -> one DataFrame per split with columns text, label, rating, review_id.

``data.source`` may be
- a Hub dataset id (``stanfordnlp/imdb``): ``datasets.load_dataset(source, revision=data.revision)``;
- a folder of Parquet splits: ``train.parquet``, ``test.parquet``, optional ``unsupervised.parquet`` (../shared/imdb);
- one ``.csv`` (comma, semicolon or tab separated), ``.jsonl`` or ``.parquet`` file holding every split: a
  ``split`` column (train/test/unsupervised) places each row, else a hash of the review text sends half the rows to
  train and half to test, like IMDb's own 25k/25k. A hash, not a shuffle: a review stays on its side whatever the seed
  and whatever rows are added or removed, and duplicates of a review land on the same side;
- an extracted ``aclImdb/`` folder (``{train,test}/{pos,neg}/<id>_<rating>.txt``, ``train/unsup/``) or its parent.

Columns may be text/label or review/sentiment (Kaggle's "IMDB Dataset.csv"); labels positive/negative (pos/neg) read as
1/0. A missing rating is 0. ``review_id`` is ``<split>/<pos|neg|unsup>/<id>`` (the path of the review in aclImdb/),
where ``<id>`` is the source's own review_id or, without one, the row number in the source file: ../shared/imdb numbers
positive and negative reviews separately, and this makes ids unique across splits and labels. Every problem is one
DataError that names the file.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from rlhf.models.hub import unreachable_hub_id
from rlhf.pipeline.errors import DataError
from rlhf.pipeline.paths import RAW, SPLITS, is_local

log = logging.getLogger(__name__)

COLUMNS = ["text", "label", "rating", "review_id"]
RENAMES = {"review": "text", "sentiment": "label"}
LABEL_NAMES = {"positive": 1, "pos": 1, "negative": 0, "neg": 0}
LABEL_DIRS = {1: "pos", 0: "neg", -1: "unsup"}
TABLE_SUFFIXES = (".csv", ".jsonl", ".parquet")


def load_imdb(source: str, revision: str | None, splits: Sequence[str]) -> dict[str, pd.DataFrame]:
    """Load the requested splits from ``source`` as DataFrames with columns text, label, rating, review_id."""
    unknown = [s for s in splits if s not in SPLITS]
    if unknown:
        raise DataError(f"unknown split {unknown[0]!r} (known: {', '.join(SPLITS)})")
    path = Path(source).expanduser()
    if path.is_file():
        frames = _split_table(_read_table(path), path, splits)
    elif path.is_dir() and (root := _aclimdb_root(path)) is not None:
        frames = {split: (_read_aclimdb(root, split), f"{root}/{split}") for split in splits}
    elif path.is_dir():
        frames = {split: _read_split_file(path, split) for split in splits}
    elif is_local(source):
        raise DataError(f"{source}: no such file or folder")
    elif (reason := unreachable_hub_id(source, "dataset")) is not None:
        raise DataError(f"data.source: {source}: no such local path, and not reachable as a Hub id ({reason})")
    else:
        frames = _read_hub(source, revision, splits)
    return {split: _normalise(frame, where, split) for split, (frame, where) in frames.items()}


def filter_reviews(frame: pd.DataFrame, min_chars: int, where: str) -> pd.DataFrame:
    """Keep reviews with more than ``min_chars`` characters (the classic recipe's ``len(text) > 200``)."""
    lengths = frame["text"].str.len()
    kept = frame[lengths > min_chars].reset_index(drop=True)
    if kept.empty:
        raise DataError(f"{where}: no review is longer than prepare.min_review_chars={min_chars} characters "
                        f"(longest of {len(frame)}: {int(lengths.max()) if len(frame) else 0})")
    return kept


def warn_if_untracked(path: str, key: str) -> None:
    """One warning line when a local input lies outside data/raw/, the folder DVC watches for changes."""
    local = Path(path).expanduser()
    # abspath, not resolve: a symlink under data/raw/ is where DVC looks, wherever it points
    if local.exists() and not Path(os.path.abspath(local)).is_relative_to(os.path.abspath(RAW)):
        log.warning("%s: %s is outside data/raw/, so editing it will not rerun prepare (copy it under data/raw/)",
                    key, path)


def _read_split_file(folder: Path, split: str) -> tuple[pd.DataFrame, str]:
    path = folder / f"{split}.parquet"
    if not path.is_file():
        raise DataError(f"{folder}: no {split}.parquet (a Parquet source folder holds train.parquet, test.parquet "
                        "and optionally unsupervised.parquet; or use a .csv/.jsonl/.parquet file or an aclImdb/ "
                        "folder)")
    return _read_parquet(path), str(path)


def _read_parquet(path: Path) -> pd.DataFrame:
    try:
        return pd.read_parquet(path)
    except Exception as e:  # pyarrow raises several unrelated types for a corrupt file
        raise DataError(f"{path}: unreadable Parquet file: {str(e).splitlines()[0]}") from None


def _read_table(path: Path) -> pd.DataFrame:
    if path.suffix.lower() not in TABLE_SUFFIXES:
        raise DataError(f"{path}: not a .csv, .jsonl or .parquet file (data.source is a Hub id, a folder of Parquet "
                        "splits, a .csv/.jsonl/.parquet file or an aclImdb/ folder)")
    if path.suffix.lower() == ".parquet":
        return _read_parquet(path)
    try:
        if path.suffix.lower() == ".jsonl":  # dtype=False: keep "5" a string, never guess types from the text
            return pd.read_json(path, lines=True, dtype=False, encoding="utf-8")
        with path.open(encoding="utf-8") as f:
            header = f.readline()
        # a spreadsheet's export in a European locale separates with ';', some exports with tabs
        sep = max(",;\t", key=header.count)
        return pd.read_csv(path, encoding="utf-8", sep=sep)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason})") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError, ValueError) as e:
        raise DataError(f"{path}: unreadable {path.suffix.lower()[1:].upper()}: {str(e).splitlines()[0]}") from None


def _split_table(frame: pd.DataFrame, path: Path, splits: Sequence[str]) -> dict[str, tuple[pd.DataFrame, str]]:
    """Rows of a one-file source per split: by its ``split`` column, else by a hash of the text (half/half)."""
    frame = _with_columns(frame, str(path))
    if "review_id" not in frame:
        frame["review_id"] = np.arange(len(frame))
    if "split" in frame:
        side = frame["split"]
        bad = ~side.isin(SPLITS)
        if bad.any():
            row = int(bad.to_numpy().argmax())
            raise DataError(f"{path}: row {row}: split {shown(side, row)} is not one of {', '.join(SPLITS)}")
    else:
        in_test = pd.util.hash_pandas_object(frame["text"], index=False).to_numpy() % 2 == 1
        side = pd.Series(np.where(in_test, "test", "train"), index=frame.index)
    out = {}
    for split in splits:
        part = frame[side == split]
        if part.empty:
            how = "its split column" if "split" in frame else "a split column (without one: half train, half test)"
            raise DataError(f"{path}: no {split!r} rows (a one-file source gets its splits from {how})")
        out[split] = (part.drop(columns="split", errors="ignore"), f"{path} [{split}]")
    return out


def _aclimdb_root(path: Path) -> Path | None:
    for root in (path, path / "aclImdb"):
        if (root / "train" / "pos").is_dir() or (root / "test" / "pos").is_dir():
            return root
    return None


def _read_aclimdb(root: Path, split: str) -> pd.DataFrame:
    """aclImdb/<split>/{pos,neg}/<id>_<rating>.txt; the unsupervised reviews live in train/unsup/."""
    parts = [("train/unsup", -1)] if split == "unsupervised" else [(f"{split}/pos", 1), (f"{split}/neg", 0)]
    rows = []
    for sub, label in parts:
        for file in sorted((root / sub).glob("*.txt")):
            match = re.fullmatch(r"(\d+)_(\d+)", file.stem)
            if match is None:
                raise DataError(f"{file}: name is not <id>_<rating>.txt")
            try:
                text = file.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            rows.append((text, label, int(match[2]), match[1]))
    if not rows:
        raise DataError(f"{root}: no reviews for split {split!r} (expected {' and '.join(s for s, _ in parts)}/*.txt)")
    return pd.DataFrame(rows, columns=COLUMNS)


def _read_hub(source: str, revision: str | None, splits: Sequence[str]) -> dict[str, tuple[pd.DataFrame, str]]:
    import datasets

    try:
        dataset = datasets.load_dataset(source, revision=revision)
    except Exception as e:  # the Hub client raises many types; all mean "cannot get this dataset"
        raise DataError(f"data.source: cannot load Hub dataset {source!r}: {str(e).splitlines()[0]}") from None
    missing = [s for s in splits if s not in dataset]
    if missing:
        raise DataError(f"data.source: Hub dataset {source!r} has no split {missing[0]!r} "
                        f"(it has: {', '.join(dataset)})")
    return {split: (dataset[split].to_pandas(), f"{source} [{split}]") for split in splits}


def _with_columns(frame: pd.DataFrame, where: str) -> pd.DataFrame:
    renamed = frame.rename(columns=RENAMES)
    for column in ("text", "label"):
        if column not in renamed:
            raise DataError(f"{where}: missing column {column!r} (columns: {', '.join(map(str, frame.columns))}; "
                            "expected text/label or review/sentiment)")
    return renamed


def _first_bad(bad: pd.Series) -> int:
    return int(bad.to_numpy().argmax())


def shown(values: pd.Series, row: int) -> str:
    """repr of one cell as the user wrote it (2, not np.int64(2))."""
    value = values.iloc[row]
    return repr(value.item() if isinstance(value, np.generic) else value)


def _labels(raw: pd.Series, where: str, split: str) -> np.ndarray:
    """0/1 (or positive/negative, pos/neg); the unsupervised split also allows -1 (unlabelled)."""
    values = raw if pd.api.types.is_numeric_dtype(raw) else raw.map(
        lambda v: LABEL_NAMES.get(v.strip().lower(), v) if isinstance(v, str) else v)
    labels = pd.to_numeric(values, errors="coerce")
    allowed = [-1, 0, 1] if split == "unsupervised" else [0, 1]
    bad = ~labels.isin(allowed)
    if bad.any():
        row = _first_bad(bad)
        raise DataError(f"{where}: row {raw.index[row]}: label {shown(raw, row)} is not one of {allowed} "
                        f"or positive/negative ({int(bad.sum())} such rows)")
    return labels.to_numpy().astype("int64")


def ratings(values: pd.Series, where: str, column: str = "rating") -> np.ndarray:
    """Star ratings as int64, 0 where missing; a value that is not a number is a DataError naming its row."""
    numbers = pd.to_numeric(values, errors="coerce")
    bad = numbers.isna() & values.notna()
    if bad.any():
        row = _first_bad(bad)
        raise DataError(f"{where}: row {values.index[row]}: {column} {shown(values, row)} is not a number")
    return numbers.fillna(0).to_numpy().astype("int64")


def _normalise(frame: pd.DataFrame, where: str, split: str) -> pd.DataFrame:
    frame = _with_columns(frame, where)
    if frame.empty:
        raise DataError(f"{where}: no rows")
    not_text = ~frame["text"].map(lambda t: isinstance(t, str))
    if not_text.any():
        row = _first_bad(not_text)
        raise DataError(f"{where}: row {frame.index[row]}: text is missing or not a string "
                        f"({shown(frame['text'], row)})")
    labels = _labels(frame["label"], where, split)
    source_ids = frame["review_id"].astype(str) if "review_id" in frame else pd.Series(range(len(frame))).astype(str)
    review_id = pd.Series([f"{split}/{LABEL_DIRS[label]}/{i}" for label, i in zip(labels, source_ids, strict=True)])
    repeated = review_id.duplicated()
    if repeated.any():
        row = _first_bad(repeated)
        raise DataError(f"{where}: row {frame.index[row]}: review_id {shown(source_ids, row)} appears twice "
                        f"among the {LABEL_DIRS[labels[row]]} reviews")
    return pd.DataFrame({
        "text": frame["text"].to_numpy(),
        "label": labels,
        "rating": ratings(frame["rating"], where) if "rating" in frame else np.zeros(len(frame), dtype="int64"),
        "review_id": review_id.to_numpy(),
    })
