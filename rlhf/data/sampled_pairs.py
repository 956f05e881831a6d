"""Preference pairs sampled as in the DPO paper's IMDb experiment: k completions per prompt from the initial policy,
ranked by a reward scorer, every pair of one prompt's completions with different scores (k = 4: 6 pairs a prompt)."""

from __future__ import annotations

import pyarrow as pa
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.models.rollout import response_lengths
from rlhf.models.runs import sample_run, score_run
from rlhf.models.sampling import SamplingParams
from rlhf.models.scorers import Scorer
from rlhf.rl.preference import preference_pairs

SAMPLED_PAIR_SCHEMA = pa.schema([
    ("prompt", pa.string()), ("chosen", pa.string()), ("rejected", pa.string()),
    ("chosen_score", pa.float32()), ("rejected_score", pa.float32()),
])


def sample_pairs(lm: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, query_ids: list[list[int]],
                 queries: list[str], k: int, response_tokens: tuple[int, int], sampling: SamplingParams,
                 scorer: Scorer, batch_size: int, seed: int) -> pa.Table:
    """SAMPLED_PAIR_SCHEMA rows: for each prompt (token ids and text), ``k`` responses sampled from ``lm`` with
    lengths uniform in ``response_tokens`` (min, max), scored by ``scorer`` on query + response; every two of them
    with different scores is a pair, the higher-scored chosen. ``batch_size`` responses are sampled and scored at a
    time; ``seed`` fixes the lengths and the draws."""
    if k < 2:
        raise ValueError(f"sample_pairs: k must be >= 2 to make a pair, got {k}")
    repeated_ids = [ids for ids in query_ids for _ in range(k)]  # a prompt's k samples side by side
    repeated_queries = [query for query in queries for _ in range(k)]
    lengths = response_lengths(len(repeated_ids), *response_tokens, torch.Generator().manual_seed(seed))
    run = sample_run(lm, tokenizer, repeated_ids, lengths, sampling, batch_size, seed, desc="sample pairs")
    scores = torch.from_numpy(score_run({scorer.name: scorer}, repeated_queries, run.texts, batch_size,
                                        desc="score pairs")[scorer.name])
    prompt, chosen, rejected = preference_pairs(scores.view(-1, k))  # (M,) each
    chosen_rows, rejected_rows = (prompt * k + chosen).tolist(), (prompt * k + rejected).tolist()
    return pa.table({
        "prompt": [queries[p] for p in prompt.tolist()],
        "chosen": [run.texts[i] for i in chosen_rows],
        "rejected": [run.texts[i] for i in rejected_rows],
        "chosen_score": scores[chosen_rows].numpy(),
        "rejected_score": scores[rejected_rows].numpy(),
    }, schema=SAMPLED_PAIR_SCHEMA)
