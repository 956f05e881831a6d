"""tokenize: the SFT corpus as token ids, tokenized once: sft reads them, so a change to its training keys (block
size, batch, schedule, shape) reruns sft alone, and its reruns read ids instead of tokenizing the corpus again.

Reads   data.source (sft.splits for training, the test split for perplexity), the tokenizer (model.tokenizer, else
        sft.base's or model.policy's)
Writes  data/tokens/train.npy     the sft.splits reviews' ids in an order drawn from the seed, EOS after each, up to
                                  the first 2,000 reviews that reach sft.max_tokens tokens
        data/tokens/test.npy      sft.eval_reviews test-split reviews' ids, EOS after each (held-out perplexity)
        data/tokens/params.json   the params they were made with (sft refuses tokens of others)
        metrics/tokenize.json     the tokens of each stream
Only a DISABLED marker when sft.enabled is false. The outputs are replaced together when the stage completes, or not
at all (rlhf/pipeline/io.py's StagedOutputs).
"""

from __future__ import annotations

import logging
from pathlib import Path

from rlhf.pipeline.cli import run_stage
from rlhf.pipeline.io import StagedOutputs, run_switchable, write_json
from rlhf.pipeline.params import Params, load_params
from rlhf.pipeline.paths import TOKENS_DIR

STAGE = "tokenize"
TOKENIZE_METRICS = Path("metrics/tokenize.json")


def main() -> None:
    params = load_params(STAGE)
    run_switchable(STAGE, params.sft.enabled, lambda outputs: tokenize(params, outputs), TOKENS_DIR,
                   "sft.enabled is false: nothing to tokenize", {TOKENIZE_METRICS: '{"tokenize": {"tokens": 0}}\n'})


def tokenize(params: Params, outputs: StagedOutputs) -> None:
    # imported here: switched off, the stage loads none of it (stages/__init__.py)
    from rlhf.data import tokens
    from rlhf.models.loading import load_tokenizer

    tokenizer = load_tokenizer(params.tokenizer_path, params.model,
                               what="model.tokenizer" if params.model.tokenizer else "sft.base or model.policy")
    with outputs.steps():
        streams = tokens.tokenize_corpus(params, tokenizer)
    tokens.write_tokens(streams, tokens.corpus_key(params), outputs[TOKENS_DIR])
    metrics = {"tokens": len(streams[tokens.TRAIN_TOKENS]), "test_tokens": len(streams[tokens.TEST_TOKENS])}
    write_json({"tokenize": metrics}, outputs[TOKENIZE_METRICS])
    logging.getLogger(STAGE).info("tokenize: %(tokens)d training tokens, %(test_tokens)d held out", metrics)


if __name__ == "__main__":
    run_stage(main)
