"""The SFT corpus as token ids, tokenized once by the tokenize stage and read by sft: ``data/tokens/train.npy``, the
training reviews' ids in a seeded order with EOS after each, ``data/tokens/train_labels.npy``, each of those tokens'
review label (1 positive, 0 negative, -1 unlabelled: sft.sentiment_coef's targets), and ``data/tokens/test.npy``, the
held-out reviews' for perplexity, under the key of the params they were made with (``corpus_key``: the values of the
keys dvc.yaml lists for the tokenize stage), so that sft run by hand refuses tokens of other params."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pandas as pd
from transformers import PreTrainedTokenizerBase

from rlhf.data.imdb import filter_reviews, load_imdb
from rlhf.pipeline.errors import DataError
from rlhf.pipeline.io import DISABLED_MARKER
from rlhf.pipeline.params import Params, expand, stage_values
from rlhf.pipeline.paths import TOKENS_DIR
from rlhf.pipeline.wiring import wiring

TRAIN_TOKENS, TEST_TOKENS = TOKENS_DIR / "train.npy", TOKENS_DIR / "test.npy"
TRAIN_LABELS = TOKENS_DIR / "train_labels.npy"
TOKENS_KEY = TOKENS_DIR / "params.json"
CHUNK = 2000  # reviews tokenized at a time: a small sft.max_tokens does not pay for tokenizing 75k reviews


def corpus_key(params: Params) -> dict[str, object]:
    """What the tokens depend on: the values of the params dvc.yaml lists for the tokenize stage."""
    return stage_values(params, expand(wiring("tokenize").params))


def token_stream(texts: pd.Series, tokenizer: PreTrainedTokenizerBase, max_tokens: int | None,
                 rng: np.random.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The reviews' ids as one stream, EOS after each, in a shuffled order when ``rng``; with ``max_tokens``, the
    reviews up to the first multiple of CHUNK whose tokens reach it. uint16 when the vocabulary fits (GPT-2's does),
    else int32. With it, the position in ``texts`` of each token's review (its EOS included)."""
    order = rng.permutation(len(texts)) if rng is not None else np.arange(len(texts))
    chunks: list[np.ndarray] = []
    reviews: list[np.ndarray] = []
    total = 0
    dtype = np.uint16 if len(tokenizer) <= 2**16 else np.int32
    for start in range(0, len(order), CHUNK):
        chunk = order[start: start + CHUNK]
        ids = tokenizer(texts.iloc[chunk].tolist(), add_special_tokens=False, verbose=False)["input_ids"]
        lengths = [len(review) + 1 for review in ids]
        chunks.append(np.fromiter(itertools.chain.from_iterable((*review, tokenizer.eos_token_id) for review in ids),
                                  dtype, sum(lengths)))
        reviews.append(np.repeat(chunk, lengths))
        total += len(chunks[-1])
        if max_tokens is not None and total >= max_tokens:
            break
    if not chunks:
        return np.zeros(0, dtype), np.zeros(0, np.int64)
    return np.concatenate(chunks), np.concatenate(reviews)


def tokenize_corpus(params: Params, tokenizer: PreTrainedTokenizerBase) -> dict[Path, np.ndarray]:
    """{TRAIN_TOKENS: the sft.splits reviews in a seeded order, up to sft.max_tokens; TRAIN_LABELS: each of those
    tokens' review label; TEST_TOKENS: sft.eval_reviews test-split reviews drawn at random}."""
    s = params.sft
    splits = load_imdb(params.data.source, params.data.revision, [*s.splits, "test"])
    train_reviews = pd.concat([splits[name] for name in s.splits], ignore_index=True)
    rng = np.random.default_rng(params.seed)
    train, reviews = token_stream(train_reviews["text"], tokenizer, s.max_tokens, rng)
    test = filter_reviews(splits["test"], 0, f"{params.data.source} [test]")
    held_out, _ = token_stream(test["text"].iloc[rng.permutation(len(test))[: s.eval_reviews]], tokenizer, None)
    labels = train_reviews["label"].to_numpy().astype(np.int8)[reviews]
    return {TRAIN_TOKENS: train, TRAIN_LABELS: labels, TEST_TOKENS: held_out}


def write_tokens(streams: dict[Path, np.ndarray], key: dict[str, object], folder: Path) -> None:
    """The streams and their key into ``folder`` (the staged TOKENS_DIR)."""
    folder.mkdir(parents=True, exist_ok=True)
    for path, stream in streams.items():
        np.save(folder / path.name, stream, allow_pickle=False)
    (folder / TOKENS_KEY.name).write_text(json.dumps(key, sort_keys=True) + "\n", encoding="utf-8")


def read_tokens(key: dict[str, object]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (train, train labels, test) streams the tokenize stage wrote, if written under ``key``: cheap, so checked
    before any model is built."""
    rerun = "run the tokenize stage: python -m stages.tokenize, or dvc repro"
    files = (TRAIN_TOKENS, TRAIN_LABELS, TEST_TOKENS, TOKENS_KEY)
    if (TOKENS_DIR / DISABLED_MARKER).exists() or not all(path.is_file() for path in files):
        raise DataError(f"{TOKENS_DIR}: holds no tokens ({rerun} with sft.enabled true)")
    written, wanted = json.loads(TOKENS_KEY.read_text(encoding="utf-8")), json.loads(json.dumps(key))
    if written != wanted:
        changed = sorted(k for k in written.keys() | wanted.keys() if written.get(k) != wanted.get(k))
        raise DataError(f"{TOKENS_DIR}: tokenized with other params ({', '.join(changed)}): {rerun}")
    train, labels, test = (np.load(path, allow_pickle=False) for path in (TRAIN_TOKENS, TRAIN_LABELS, TEST_TOKENS))
    return train, labels, test
