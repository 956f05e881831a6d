"""Prompts and preference pairs from IMDb reviews: openings tokenized in batches, cut by seeded generators."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from rlhf.data.imdb import ratings, shown
from rlhf.data.pairs import read_pairs
from rlhf.models.texts import opening_texts
from rlhf.pipeline.errors import DataError

PROMPT_SCHEMA = pa.schema([
    ("query", pa.string()), ("input_ids", pa.list_(pa.int32())), ("review_id", pa.string()), ("label", pa.int64()),
])
PAIR_SCHEMA = pa.schema([
    ("chosen", pa.string()), ("rejected", pa.string()), ("chosen_id", pa.string()), ("rejected_id", pa.string()),
    ("chosen_rating", pa.int64()), ("rejected_rating", pa.int64()),
])
PAIRS_TEST_SHARE = 0.1  # a pairs file without a `split` column gives a tenth of its rows to the test set
CHARS_PER_TOKEN = 8  # generous: English BPE averages ~4.5 characters per token
TAIL_TOKENS = 8  # tokens the cut text must yield beyond the ones kept before its opening is trusted
BATCH = 2048


def generator(seed: int, output: str) -> np.random.Generator:
    """One generator per output, so each output depends only on the seed and its own params."""
    return np.random.default_rng([seed, zlib.crc32(output.encode())])


def _encode(texts: list[str], tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]


def _opening(text: str, chars: int) -> str:
    """``text`` cut at its last space before ``chars`` characters (uncut when it is shorter or has no space there)."""
    if len(text) <= chars:
        return text
    space = text.rfind(" ", 0, chars)
    return text[:space] if space > 0 else text


def tokenize(texts: Sequence[str], tokenizer: PreTrainedTokenizerBase, max_tokens: int) -> list[list[int]]:
    """The first ``max_tokens`` token ids of each text, the same ids as tokenizing the whole text gives.

    A review averages ~1,300 characters but a prompt or pair snippet needs a few dozen tokens, so each text is cut at
    a space after about ``CHARS_PER_TOKEN * (max_tokens + TAIL_TOKENS)`` characters and only that opening is tokenized
    (much less work). No token of a byte-level BPE, WordPiece or SentencePiece tokenizer spans the space that starts
    a word, so the opening's tokens are the whole text's; as a safety margin an opening must also yield TAIL_TOKENS
    more tokens than are kept, else (very dense text) the whole text is tokenized. Batched fast-tokenizer calls, never
    one call per text.
    """
    chars = CHARS_PER_TOKEN * (max_tokens + TAIL_TOKENS)
    openings = [_opening(text, chars) for text in texts]
    ids: list[list[int]] = []
    with tqdm(total=len(texts), desc="tokenize", unit=" reviews", leave=False) as bar:
        for start in range(0, len(openings), BATCH):
            batch = openings[start: start + BATCH]
            ids.extend(_encode(batch, tokenizer))
            bar.update(len(batch))
    redo = [i for i, (text, opening) in enumerate(zip(texts, openings, strict=True))
            if len(opening) < len(text) and len(ids[i]) < max_tokens + TAIL_TOKENS]
    if redo:
        for i, row in zip(redo, _encode([texts[i] for i in redo], tokenizer), strict=True):
            ids[i] = row
    return [row[:max_tokens] for row in ids]


@dataclass(frozen=True)
class Tokenized:
    """A split's reviews, the token ids of their openings (``tokenize``) and the tokenizer that made them."""

    reviews: pd.DataFrame
    ids: list[list[int]]
    tokenizer: PreTrainedTokenizerBase

    def cut(self, rows: np.ndarray, tokens: tuple[int, int], rng: np.random.Generator) -> list[list[int]]:
        """The first N tokens of each selected row, N uniform in ``tokens`` (min, max; the classic LengthSampler)."""
        lengths = rng.integers(tokens[0], tokens[1] + 1, size=len(rows))
        return [self.ids[row][:n] for row, n in zip(rows, lengths, strict=True)]


def build_prompts(split: Tokenized, n: int | None, tokens: tuple[int, int], rng: np.random.Generator) -> pa.Table:
    """``n`` prompts (all when None; at most as many as reviews) from the reviews, in file order: query text (less
    a character the cut split: texts.opening_texts), its token ids, the review."""
    reviews = split.reviews
    rows = np.arange(len(reviews)) if n is None or n >= len(reviews) else np.sort(
        rng.choice(len(reviews), size=n, replace=False))
    prefixes = split.cut(rows, tokens, rng)
    return pa.table({
        "query": opening_texts(split.tokenizer, prefixes),
        "input_ids": prefixes,
        "review_id": reviews["review_id"].to_numpy()[rows],
        "label": reviews["label"].to_numpy()[rows],
    }, schema=PROMPT_SCHEMA)


def _draw(rows: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` of ``rows`` in random order, each used once before any is used again (repeats only when n > len)."""
    rounds = -(-n // len(rows))
    return np.concatenate([rng.permutation(rows) for _ in range(rounds)])[:n]


def _rating_pairs(rating: np.ndarray, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(higher, lower) rows: each round pairs the halves of a shuffle of the rated reviews, keeping unequal ones."""
    rated = np.flatnonzero(rating > 0)
    higher, lower = [], []
    while sum(map(len, higher)) < n:
        order = rng.permutation(rated)
        a, b = order[: len(order) // 2], order[len(order) // 2: 2 * (len(order) // 2)]
        keep = rating[a] != rating[b]
        a, b = a[keep], b[keep]
        higher.append(np.where(rating[a] > rating[b], a, b))
        lower.append(np.where(rating[a] > rating[b], b, a))
    return np.concatenate(higher)[:n], np.concatenate(lower)[:n]


def build_pairs(split: Tokenized, n: int, tokens: tuple[int, int], by_rating: bool, rng: np.random.Generator,
                where: str) -> pa.Table:
    """``n`` (chosen, rejected) review openings, each side cut to its own length in ``tokens`` (min, max).

    Chosen is a positive review and rejected a negative one, or with ``by_rating`` the higher and the lower of two
    different star ratings. Reviews repeat only when a side has fewer reviews than ``n``. ``where`` names the source
    in errors.
    """
    reviews = split.reviews
    if by_rating:
        rating = reviews["rating"].to_numpy()
        if len(np.unique(rating[rating > 0])) < 2:
            raise DataError(f"{where}: prepare.pairs_by_rating needs reviews with at least two different star "
                            "ratings (this source has none or one; ratings 0 mean unknown)")
        chosen, rejected = _rating_pairs(rating, n, rng)
    else:
        pos = np.flatnonzero(reviews["label"].to_numpy() == 1)
        neg = np.flatnonzero(reviews["label"].to_numpy() == 0)
        if len(pos) == 0 or len(neg) == 0:
            raise DataError(f"{where}: pairs need positive and negative reviews ({len(pos)} positive, "
                            f"{len(neg)} negative after the filter)")
        chosen, rejected = _draw(pos, n, rng), _draw(neg, n, rng)
    columns = {}
    for side, rows in (("chosen", chosen), ("rejected", rejected)):
        columns[side] = opening_texts(split.tokenizer, split.cut(rows, tokens, rng))
        columns[f"{side}_id"] = reviews["review_id"].to_numpy()[rows]
        columns[f"{side}_rating"] = reviews["rating"].to_numpy()[rows]
    return pa.table(columns, schema=PAIR_SCHEMA)


def read_pairs_file(path: Path, rng: np.random.Generator) -> dict[str, pa.Table]:
    """A user's chosen/rejected file (Parquet or JSONL), validated and copied into PAIR_SCHEMA, split train/test.

    A ``split`` column (train/test) places each row, else a seeded tenth goes to test. A ``prompt`` column (TRL's
    preference format with an explicit prompt) is put before each side, as TRL's reward trainer joins them. Missing
    ids become ``chosen_<row>``/``rejected_<row>``, missing ratings 0; other columns are dropped.
    """
    frame = read_pairs(path, "prepare.pairs_source", "no such file (prepare.pairs_source)")
    frame = frame.reset_index(drop=True)
    for side in ("prompt", "chosen", "rejected") if "prompt" in frame else ("chosen", "rejected"):
        if isinstance(frame[side].iloc[0], list):
            raise DataError(f"{path}: {side} holds lists of messages (TRL's conversational format): apply the chat "
                            "template first, so that each side is one text")
        empty_ok = side == "prompt"
        bad = ~frame[side].map(lambda t, empty_ok=empty_ok: isinstance(t, str) and (empty_ok or t.strip() != ""))
        if bad.any():
            row = int(bad.to_numpy().argmax())
            raise DataError(f"{path}: row {row}: {side} is {shown(frame[side], row)}, not a non-empty string")
    if "prompt" in frame:  # a prompt alone is a shared prefix: the pair still differs in what follows it
        frame["chosen"], frame["rejected"] = frame["prompt"] + frame["chosen"], frame["prompt"] + frame["rejected"]
    for side in ("chosen", "rejected"):
        if f"{side}_id" not in frame:
            frame[f"{side}_id"] = [f"{side}_{i}" for i in range(len(frame))]
        frame[f"{side}_id"] = frame[f"{side}_id"].astype(str)
        frame[f"{side}_rating"] = (ratings(frame[f"{side}_rating"], str(path), f"{side}_rating")
                                   if f"{side}_rating" in frame else 0)
    same = (frame["chosen"] == frame["rejected"]).to_numpy()
    if same.any():  # a pair that prefers a text to itself teaches nothing, and scores as a wrong answer
        raise DataError(f"{path}: row {int(same.argmax())}: chosen equals rejected ({int(same.sum())} of {len(frame)} "
                        "pairs): a pair must hold two different texts")
    if "split" in frame:
        bad = ~frame["split"].isin(["train", "test"])
        if bad.any():
            row = int(bad.to_numpy().argmax())
            raise DataError(f"{path}: row {row}: split {shown(frame['split'], row)} is not train or test")
        in_test = (frame["split"] == "test").to_numpy()
    else:
        in_test = np.zeros(len(frame), dtype=bool)
        in_test[rng.choice(len(frame), size=round(PAIRS_TEST_SHARE * len(frame)), replace=False)] = True
    if in_test.all() or not in_test.any():
        raise DataError(f"{path}: needs pairs for both train and test ({int(in_test.sum())} of {len(frame)} are test)")
    return {split: pa.Table.from_pandas(frame.loc[rows, PAIR_SCHEMA.names], schema=PAIR_SCHEMA, preserve_index=False)
            for split, rows in (("train", ~in_test), ("test", in_test))}
