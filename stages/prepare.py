"""prepare: IMDb -> tokenized prompts and chosen/rejected preference pairs.

Reads   data.source (train and test splits), the pipeline tokenizer (never the policy model)
Writes  data/prompts/{train,eval}.parquet   query, input_ids, review_id, label
        data/pairs/{train,test}.parquet     chosen, rejected, chosen_id, rejected_id, chosen_rating, rejected_rating
        metrics/prepare.json                row counts, prompt lengths, seconds
Everything is read and checked before the first output is written; the outputs are replaced together when the
stage completes (rlhf/pipeline/io.py's StagedOutputs), or not at all.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from rlhf.data.imdb import filter_reviews, load_imdb, warn_if_untracked
from rlhf.data.prepare import Tokenized, build_pairs, build_prompts, generator, read_pairs_file, tokenize
from rlhf.models.loading import load_tokenizer
from rlhf.pipeline.cli import run_stage
from rlhf.pipeline.errors import DataError
from rlhf.pipeline.io import StagedOutputs, atomic_path, write_json
from rlhf.pipeline.params import Params, load_params
from rlhf.pipeline.paths import PAIRS_DIR, PROMPTS_DIR

log = logging.getLogger("prepare")

STAGE = "prepare"
PREPARE_METRICS = Path("metrics/prepare.json")


def main() -> None:
    params = load_params(STAGE)
    with StagedOutputs.of(STAGE) as outputs:
        prepare(params, outputs)


def prepare(params: Params, outputs: StagedOutputs) -> None:
    start = time.perf_counter()
    p, source = params.prepare, params.data.source
    warn_if_untracked(source, "data.source")
    from_imdb = p.pairs_source == "imdb"
    if not from_imdb:
        warn_if_untracked(p.pairs_source, "prepare.pairs_source")
    tokenizer = load_tokenizer(params.tokenizer_path, params.model,
                               what="model.tokenizer" if params.model.tokenizer else "model.policy")
    if not from_imdb:  # read and checked before the reviews are tokenized
        pairs = read_pairs_file(Path(p.pairs_source), generator(params.seed, "pairs/split"))
        log.info("prepare: %d train / %d test pairs from prepare.pairs_source %s (prepare.train_pairs, test_pairs, "
                 "pair_min_tokens, pair_max_tokens and pairs_by_rating apply to imdb pairs only)",
                 pairs["train"].num_rows, pairs["test"].num_rows, p.pairs_source)

    splits = load_imdb(source, params.data.revision, ["train", "test"])
    reviews = {name: filter_reviews(frame, p.min_review_chars, f"{source} [{name}]") for name, frame in splits.items()}
    for key, split, n in (("train_prompts", "train", p.train_prompts), ("eval_prompts", "test", p.eval_prompts)):
        if n is not None and n > len(reviews[split]):  # the params would name prompts the outputs do not have
            raise DataError(f"prepare.{key}: {n} prompts asked, but only {len(reviews[split])} {split} reviews of "
                            f"{source} pass prepare.min_review_chars")
    max_tokens = max(p.prompt_max_tokens, p.pair_max_tokens if from_imdb else 0)
    with outputs.steps():
        tokenized = {name: Tokenized(frame, tokenize(frame["text"].tolist(), tokenizer, max_tokens), tokenizer)
                     for name, frame in reviews.items()}
        prompts = {
            out: build_prompts(tokenized[split], n, (p.prompt_min_tokens, p.prompt_max_tokens),
                               generator(params.seed, f"prompts/{out}"))
            for out, split, n in (("train", "train", p.train_prompts), ("eval", "test", p.eval_prompts))
        }
        if from_imdb:
            pairs = {split: build_pairs(tokenized[split], n, (p.pair_min_tokens, p.pair_max_tokens),
                                        p.pairs_by_rating, generator(params.seed, f"pairs/{split}"),
                                        f"{source} [{split}]")
                     for split, n in (("train", p.train_pairs), ("test", p.test_pairs))}

    for folder, tables in ((PROMPTS_DIR, prompts), (PAIRS_DIR, pairs)):
        with atomic_path(outputs[folder]) as tmp:
            tmp.mkdir()
            for name, table in tables.items():
                pq.write_table(table, tmp / f"{name}.parquet")
    lengths = Counter(map(len, prompts["train"]["input_ids"].to_pylist()))
    metrics = {
        "reviews_read": {name: len(frame) for name, frame in splits.items()},
        "reviews_kept": {name: len(frame) for name, frame in reviews.items()},
        "prompts": {name: table.num_rows for name, table in prompts.items()},
        "pairs": {name: table.num_rows for name, table in pairs.items()},
        "prompt_tokens": {str(n): lengths[n] for n in sorted(lengths)},
        "prompt_tokens_mean": round(sum(n * c for n, c in lengths.items()) / lengths.total(), 3),
        "seconds": round(time.perf_counter() - start, 1),
    }
    write_json({"prepare": metrics}, outputs[PREPARE_METRICS])
    log.info("prepare: kept %(reviews_kept)s of %(reviews_read)s reviews; prompts %(prompts)s; pairs %(pairs)s; "
             "%(seconds).1f s", metrics)


if __name__ == "__main__":
    run_stage(main)
