"""ref_logprobs: the frozen reference's log-probs of every pair dpo trains and evaluates on, for method dpo.

Reads   the pairs of dpo.pairs: data/pairs/{train,test}.parquet or data/sampled_pairs/{train,test}.parquet; the
        reference, which is the initial policy (models/sft when sft.enabled, else model.policy)
Writes  data/ref_logprobs/{train,test}.parquet  chosen, rejected: log pi_ref(response | prompt) of each pair, row for
                                                row the pairs' (responses cut to dpo.max_length), under a key of
                                                what they depend on; only a DISABLED marker unless method is dpo
They depend on the pairs, the reference and dpo.max_length alone, so DVC keeps them across runs that change dpo.beta,
dpo.tau, dpo.loss, the schedule or the seed: a sweep over those pays for the reference's pass once, not per point.
"""

from __future__ import annotations

import logging

from rlhf.pipeline.cli import run_stage
from rlhf.pipeline.io import StagedOutputs, run_switchable
from rlhf.pipeline.params import Params, initial_policy, load_params
from rlhf.pipeline.paths import REF_LOGPROBS_DIR

log = logging.getLogger("ref_logprobs")

BATCH = 64  # pairs per forward pass of the reference

STAGE = "ref_logprobs"
# what to lower when the GPU runs out of memory
OUT_OF_MEMORY = "lower dpo.max_length"


def main() -> None:
    params = load_params(STAGE)
    run_switchable(STAGE, params.method == "dpo", lambda outputs: write_reference(params, outputs),
                   REF_LOGPROBS_DIR, "computed only with method dpo", {})


def write_reference(params: Params, outputs: StagedOutputs) -> None:
    # imported here: switched off, the stage loads none of it (stages/__init__.py)
    from rlhf.models.devices import pick_device
    from rlhf.models.loading import load_initial_policy
    from rlhf.train import dpo

    cfg = params.dpo
    frames = dpo.read_pair_files(cfg.pairs, batch_size=None)
    initial = initial_policy(params)
    lm, tokenizer = load_initial_policy(initial, params.model)
    dpo.check_context(lm, cfg.max_length, initial.what)
    key = dpo.reference_key(params)
    reference = dpo.PairModel(lm, tokenizer, pick_device(), params.model.precision)
    lm.to(reference.device)
    for frame, pairs_file, path in zip(frames, dpo.PAIR_FILES[cfg.pairs][1:], dpo.REF_FILES, strict=True):
        pairs = dpo.encode_pairs(frame, tokenizer, cfg.max_length, str(pairs_file))
        with outputs.steps():
            pairs = dpo.with_reference(pairs, reference, BATCH)
        dpo.write_reference(pairs.ref_logprobs, outputs[path], key)
        log.info("ref_logprobs: %d pairs of %s", len(pairs), pairs_file)


if __name__ == "__main__":
    run_stage(main, OUT_OF_MEMORY)
