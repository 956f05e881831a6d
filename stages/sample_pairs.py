"""sample_pairs: preference pairs sampled as in the DPO paper's IMDb experiment, for dpo.pairs sampled.

Reads   data/prompts/train.parquet (the first dpo.sample_prompts), the initial policy (models/sft when sft.enabled,
        else model.policy), the reward (models/reward when reward.train, else reward.model, plus
        reward.functions)
Writes  data/sampled_pairs/{train,test}.parquet  prompt, chosen, rejected, chosen_score, rejected_score: every two of
                                                 a prompt's dpo.samples_per_prompt completions with different reward
                                                 scores, the higher-scored chosen; test holds the pairs of the last
                                                 tenth of the prompts. Only a DISABLED marker unless method is dpo
                                                 and dpo.pairs is sampled.
Completions are sampled as ppo samples (ppo's response lengths, top_k, top_p, temperature), so the pairs are what the
initial policy writes. The output is cached by DVC: it is sampled again only when one of these inputs changes.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from rlhf.pipeline.cli import run_stage
from rlhf.pipeline.errors import DataError
from rlhf.pipeline.io import StagedOutputs, run_switchable, write_parquet
from rlhf.pipeline.params import Params, initial_policy, load_params, reward_model
from rlhf.pipeline.paths import (
    SAMPLED_PAIRS_DIR,
    SAMPLED_TEST_PAIRS,
    SAMPLED_TRAIN_PAIRS,
    TRAIN_PROMPTS,
)
from rlhf.pipeline.wiring import wiring

if TYPE_CHECKING:
    from rlhf.data.prompts import Prompts

log = logging.getLogger("sample_pairs")

BATCH = 64  # responses sampled and scored at a time; a constant, as the draws depend on how rows are batched
TEST_SHARE = 10  # one prompt in TEST_SHARE (the last ones) gives the held-out test pairs

STAGE = "sample_pairs"


def main() -> None:
    params = load_params(STAGE)
    enabled = params.method == "dpo" and params.dpo.pairs == "sampled"
    run_switchable(STAGE, enabled, lambda outputs: write_pairs(params, outputs), SAMPLED_PAIRS_DIR,
                   "sampled only with method dpo and dpo.pairs sampled", {})


def split(prompts: Prompts, limit: int | None) -> tuple[list[int], list[int]]:
    """(train, test) prompt indices: the first ``limit`` prompts (all when None), the last tenth of them for test."""
    if limit is not None and limit > len(prompts):  # the params would name prompts the pairs do not come from
        raise DataError(f"dpo.sample_prompts: {limit} prompts asked, but {TRAIN_PROMPTS} holds {len(prompts)}")
    n = len(prompts) if limit is None else limit
    if n < 2:
        raise DataError(f"{TRAIN_PROMPTS}: {len(prompts)} prompts; sampled pairs need 2 or more (one for test pairs)")
    test = max(1, n // TEST_SHARE)
    return list(range(n - test)), list(range(n - test, n))


def write_pairs(params: Params, outputs: StagedOutputs) -> None:
    # imported here: switched off, the stage loads none of it (stages/__init__.py)
    from rlhf.data.prompts import check_prompts, read_prompts
    from rlhf.data.sampled_pairs import sample_pairs
    from rlhf.models.decoding import SamplingParams
    from rlhf.models.devices import pick_device
    from rlhf.models.loading import load_initial_policy
    from rlhf.models.reward_functions import load_functions
    from rlhf.models.runs import Sampler
    from rlhf.models.scorers import make_reward_scorer
    from rlhf.train.rng import seed_everything

    prompts = read_prompts(TRAIN_PROMPTS)
    indices = split(prompts, params.dpo.sample_prompts)
    seed_everything(params.seed)
    device = pick_device()
    longest = prompts.longest + params.ppo.response_max_tokens
    functions = load_functions(params.reward.functions, prompts, STAGE, wiring(STAGE).deps)
    scorer = make_reward_scorer(functions, *reward_model(params), params.reward.positive_label, params.model, device,
                                longest)
    lm, tokenizer = load_initial_policy(initial_policy(params), params.model)
    cfg = params.ppo
    check_prompts(TRAIN_PROMPTS, prompts, tokenizer, lm, cfg.response_max_tokens, "the initial policy")
    lm.to(device).eval()
    sampler = Sampler(lm, tokenizer, SamplingParams.of(cfg), BATCH)
    for offset, (idx, path) in enumerate(zip(indices, (SAMPLED_TRAIN_PAIRS, SAMPLED_TEST_PAIRS), strict=True)):
        with outputs.steps():
            table = sample_pairs(sampler, prompts.take(idx), params.dpo.samples_per_prompt,
                                 (cfg.response_min_tokens, cfg.response_max_tokens), scorer, params.seed + offset)
        if table.num_rows == 0:
            raise DataError(f"{path}: every completion of its {len(idx)} prompts scored the same: no pairs (raise "
                            "dpo.samples_per_prompt or dpo.sample_prompts)")
        write_parquet(table, outputs[path])
        log.info("sample_pairs: %d pairs from %d prompts in %s", table.num_rows, len(idx), path)


if __name__ == "__main__":
    run_stage(main)
