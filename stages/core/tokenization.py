"""Prompts and preference pairs from IMDb reviews: tokenized once per split in batches, cut by a seeded generator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
from transformers import PreTrainedTokenizerBase

from stages.core.errors import DataError

PROMPT_SCHEMA = pa.schema([
    ("query", pa.string()), ("input_ids", pa.list_(pa.int32())), ("review_id", pa.string()), ("label", pa.int64()),
])
PAIR_SCHEMA = pa.schema([
    ("chosen", pa.string()), ("rejected", pa.string()), ("chosen_id", pa.string()), ("rejected_id", pa.string()),
    ("chosen_rating", pa.int64()), ("rejected_rating", pa.int64()),
])
PAIRS_TEST_SHARE = 0.1  # a local pairs file without a `split` column gives a tenth to the test set


def tokenize(texts: pd.Series, tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """Token ids of every text in one batched (Rust) call."""
    return tokenizer(texts.tolist(), add_special_tokens=False, verbose=False)["input_ids"]


def cut(ids: list[list[int]], rows: np.ndarray, min_tokens: int, max_tokens: int,
        rng: np.random.Generator) -> list[list[int]]:
    """The first N tokens of each selected row, N uniform in [min_tokens, max_tokens] (the seed's LengthSampler)."""
    lengths = rng.integers(min_tokens, max_tokens + 1, size=len(rows))
    return [ids[row][:n] for row, n in zip(rows, lengths, strict=True)]


def build_prompts(reviews: pd.DataFrame, ids: list[list[int]], tokenizer: PreTrainedTokenizerBase, n: int | None,
                  min_tokens: int, max_tokens: int, rng: np.random.Generator) -> pa.Table:
    """``n`` prompts (all when None) from the reviews: query text, its token ids, the review it came from."""
    rows = np.arange(len(reviews)) if n is None or n >= len(reviews) else np.sort(
        rng.choice(len(reviews), size=n, replace=False))
    prefixes = cut(ids, rows, min_tokens, max_tokens, rng)
    return pa.table({
        "query": tokenizer.batch_decode(prefixes),
        "input_ids": prefixes,
        "review_id": reviews["review_id"].to_numpy()[rows],
        "label": reviews["label"].to_numpy()[rows],
    }, schema=PROMPT_SCHEMA)


def _pair_rows(reviews: pd.DataFrame, n: int, by_rating: bool, rng: np.random.Generator,
               where: str) -> tuple[np.ndarray, np.ndarray]:
    """Row indices (chosen, rejected): a positive vs a negative review, or a higher vs a lower star rating."""
    if not by_rating:
        pos = np.flatnonzero(reviews["label"].to_numpy() == 1)
        neg = np.flatnonzero(reviews["label"].to_numpy() == 0)
        if len(pos) == 0 or len(neg) == 0:
            raise DataError(f"{where}: pairs need both positive and negative reviews")
        return (rng.choice(pos, size=n, replace=n > len(pos)), rng.choice(neg, size=n, replace=n > len(neg)))
    rating = reviews["rating"].to_numpy()
    rated = np.flatnonzero(rating > 0)
    if len(np.unique(rating[rated])) < 2:
        raise DataError(f"{where}: prepare.pairs_by_rating needs reviews with at least two different ratings")
    chosen, rejected = [], []
    while len(chosen) < n:
        a, b = rng.choice(rated, size=(2, 2 * n))
        keep = rating[a] != rating[b]
        hi = np.where(rating[a] > rating[b], a, b)[keep]
        lo = np.where(rating[a] > rating[b], b, a)[keep]
        chosen.extend(hi.tolist())
        rejected.extend(lo.tolist())
    return np.array(chosen[:n]), np.array(rejected[:n])


def build_pairs(reviews: pd.DataFrame, ids: list[list[int]], tokenizer: PreTrainedTokenizerBase, n: int,
                min_tokens: int, max_tokens: int, by_rating: bool, rng: np.random.Generator, where: str) -> pa.Table:
    """``n`` chosen/rejected pairs of review openings, each cut to a response-like token length."""
    chosen, rejected = _pair_rows(reviews, n, by_rating, rng, where)
    columns = {}
    for side, rows in (("chosen", chosen), ("rejected", rejected)):
        columns[side] = tokenizer.batch_decode(cut(ids, rows, min_tokens, max_tokens, rng))
        columns[f"{side}_id"] = reviews["review_id"].to_numpy()[rows]
        columns[f"{side}_rating"] = reviews["rating"].to_numpy()[rows]
    return pa.table(columns, schema=PAIR_SCHEMA)


def read_pairs_file(path: Path, rng: np.random.Generator) -> dict[str, pa.Table]:
    """A user's chosen/rejected file (Parquet or JSONL), validated, split into train/test, in PAIR_SCHEMA."""
    try:
        frame = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_json(path, lines=True)
    except Exception as e:  # pyarrow / json raise many unrelated types for a bad file
        raise DataError(f"{path}: unreadable pairs file: {str(e).splitlines()[0]}") from None
    for column in ("chosen", "rejected"):
        if column not in frame:
            raise DataError(f"{path}: missing column {column!r} (columns: {', '.join(map(str, frame.columns))})")
        text_ok = frame[column].map(lambda t: isinstance(t, str) and t.strip() != "")
        if not text_ok.all():
            row = int((~text_ok).argmax())
            raise DataError(f"{path}: column {column!r} has an empty or non-text value in row {row}")
    if frame.empty:
        raise DataError(f"{path}: no pairs")
    for side in ("chosen", "rejected"):
        if f"{side}_id" not in frame:
            frame[f"{side}_id"] = [f"{side}_{i}" for i in range(len(frame))]
        frame[f"{side}_rating"] = frame.get(f"{side}_rating", pd.Series(0, index=frame.index)).fillna(0)
    in_test = ((frame["split"] == "test").to_numpy() if "split" in frame
               else rng.random(len(frame)) < PAIRS_TEST_SHARE)
    if in_test.all() or not in_test.any():
        raise DataError(f"{path}: needs pairs for both train and test ({int(in_test.sum())} of {len(frame)} are test)")
    columns = PAIR_SCHEMA.names
    return {split: pa.Table.from_pandas(frame.loc[mask, columns].astype({c: str for c in columns[:4]}),
                                        schema=PAIR_SCHEMA, preserve_index=False)
            for split, mask in (("train", ~in_test), ("test", in_test))}
