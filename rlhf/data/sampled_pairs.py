"""Preference pairs sampled as in the DPO paper's IMDb experiment: k completions per prompt from the initial policy,
ranked by a reward scorer, every pair of one prompt's completions with different scores (k = 4: 6 pairs a prompt)."""

from __future__ import annotations

import pyarrow as pa
import torch

from rlhf.data.prompts import Prompts
from rlhf.models.rollout import response_lengths
from rlhf.models.runs import Sampler, score_run
from rlhf.models.scorers import Scorer
from rlhf.rl.preference import preference_pairs

SAMPLED_PAIR_SCHEMA = pa.schema([
    ("prompt", pa.string()), ("chosen", pa.string()), ("rejected", pa.string()),
    ("chosen_score", pa.float32()), ("rejected_score", pa.float32()),
])


def sample_pairs(sampler: Sampler, prompts: Prompts, k: int, response_tokens: tuple[int, int], scorer: Scorer,
                 seed: int) -> pa.Table:
    """SAMPLED_PAIR_SCHEMA rows: for each prompt, ``k`` responses of ``sampler`` with lengths uniform in
    ``response_tokens`` (min, max), scored by ``scorer`` on query + response; every two of them with different scores
    is a pair, the higher-scored chosen. ``seed`` fixes the lengths and the draws."""
    if k < 2:
        raise ValueError(f"sample_pairs: k must be >= 2 to make a pair, got {k}")
    repeated = prompts.take([i for i in range(len(prompts)) for _ in range(k)])  # a prompt's k samples side by side
    lengths = response_lengths(len(repeated), *response_tokens, torch.Generator().manual_seed(seed))
    run = sampler.run(repeated.input_ids, lengths, seed, desc="sample pairs")
    scores = torch.from_numpy(score_run({scorer.name: scorer}, repeated.queries, run.texts, sampler.batch_size,
                                        "score pairs", run.response_ids)[scorer.name])
    prompt, chosen, rejected = preference_pairs(scores.view(-1, k))  # (M,) each
    chosen_rows, rejected_rows = (prompt * k + chosen).tolist(), (prompt * k + rejected).tolist()
    return pa.table({
        "prompt": [prompts.queries[p] for p in prompt.tolist()],
        "chosen": [run.texts[i] for i in chosen_rows],
        "rejected": [run.texts[i] for i in rejected_rows],
        "chosen_score": scores[chosen_rows].numpy(),
        "rejected_score": scores[rejected_rows].numpy(),
    }, schema=SAMPLED_PAIR_SCHEMA)
