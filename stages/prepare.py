"""prepare: IMDb -> tokenized prompts and chosen/rejected preference pairs.

Reads   data.source (train and test splits), the pipeline tokenizer
Params  seed, data.*, model.policy/tokenizer/revision, sft.enabled/base (which tokenizer), prepare.*
Writes  data/prompts/{train,eval}.parquet   query, input_ids, review_id, label
        data/pairs/{train,test}.parquet     chosen, rejected, chosen_id, rejected_id, chosen_rating, rejected_rating
        metrics/prepare.json                row counts and timing
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from stages.core.data import filter_reviews, load_imdb
from stages.core.errors import run_stage
from stages.core.io import atomic_path, write_json
from stages.core.modeling import load_tokenizer
from stages.core.params import load_params
from stages.core.tokenization import build_pairs, build_prompts, read_pairs_file, tokenize

log = logging.getLogger("prepare")
RAW = Path("data/raw")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    params = load_params()
    p = params.prepare
    source = Path(params.data.source)
    if source.exists() and RAW.resolve() not in source.resolve().parents:
        log.warning("data.source %s is outside data/raw/: DVC will not rerun prepare when it changes", source)
    tokenizer_key = "model.tokenizer" if params.model.tokenizer else "model.policy"
    tokenizer = load_tokenizer(params.tokenizer_path, params.model, what=tokenizer_key)

    splits = load_imdb(params.data.source, params.data.revision, ["train", "test"])
    reviews = {name: filter_reviews(frame, p.min_review_chars, f"{params.data.source} [{name}]")
               for name, frame in splits.items()}
    ids = {name: tokenize(frame["text"], tokenizer) for name, frame in reviews.items()}

    # seeding: one generator, consumed in a fixed order, so every output is a function of the seed
    rng = np.random.default_rng(params.seed)
    prompts = {
        "train": build_prompts(reviews["train"], ids["train"], tokenizer, p.train_prompts,
                               p.prompt_min_tokens, p.prompt_max_tokens, rng),
        "eval": build_prompts(reviews["test"], ids["test"], tokenizer, p.eval_prompts,
                              p.prompt_min_tokens, p.prompt_max_tokens, rng),
    }
    if p.pairs_source == "imdb":
        pairs = {name: build_pairs(reviews[name], ids[name], tokenizer, n, p.pair_min_tokens, p.pair_max_tokens,
                                   p.pairs_by_rating, rng, f"{params.data.source} [{name}]")
                 for name, n in (("train", p.train_pairs), ("test", p.test_pairs))}
    else:
        pairs = read_pairs_file(Path(p.pairs_source), rng)

    for folder, tables in (("data/prompts", prompts), ("data/pairs", pairs)):
        with atomic_path(folder) as tmp:
            tmp.mkdir()
            for name, table in tables.items():
                pq.write_table(table, tmp / f"{name}.parquet")
    elapsed = time.perf_counter() - start
    lengths = pc.list_value_length(prompts["train"]["input_ids"])
    metrics = {
        "reviews_read": {name: len(frame) for name, frame in splits.items()},
        "reviews_kept": {name: len(frame) for name, frame in reviews.items()},
        "prompts": {name: table.num_rows for name, table in prompts.items()},
        "pairs": {name: table.num_rows for name, table in pairs.items()},
        "prompt_tokens_mean": round(pc.mean(lengths).as_py(), 3),
        "seconds": round(elapsed, 1),
    }
    write_json(metrics, "metrics/prepare.json")
    log.info("prepare: kept %(reviews_kept)s of %(reviews_read)s reviews; prompts %(prompts)s; pairs %(pairs)s",
             metrics)
    log.info("prepare: %.1f s", elapsed)


if __name__ == "__main__":
    run_stage(main)
