"""Sampling and scoring a model's responses to a list of prompts, as evaluation does: one run per model, the same
lengths and seed for every model, and the reward scorer's best of N runs (best-of-N, an inference-time policy).
Kept apart from evaluation's KL, so what samples pairs for DPO does not depend on the PPO math."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.models.rollout import Samples, SamplingParams, decode_responses, generate
from rlhf.models.scorers import Scorer
from rlhf.rl.preference import best_of_n


@dataclass
class Run:
    """One model's responses to every eval prompt, batch by batch as generate() returned them, and what drew them."""

    batches: list[Samples]
    texts: list[str]
    query_ids: list[list[int]]
    lengths: list[int]
    seed: int

    @property
    def response_ids(self) -> list[list[int]]:
        return [r[m].tolist() for s in self.batches  # a batch copied to the host at once, not a row at a time
                for r, m in zip(s.responses.cpu(), s.response_mask.cpu(), strict=True)]


@dataclass(frozen=True)
class Sampler:
    """A model answering prompts through the training sampler, ``batch_size`` prompts at a time."""

    lm: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    sampling: SamplingParams
    batch_size: int

    def run(self, query_ids: list[list[int]], lengths: list[int], seed: int, desc: str) -> Run:
        """Responses to every query; reseeding first gives every run the same draws."""
        torch.manual_seed(seed)
        batches, texts = [], []
        for start in tqdm(range(0, len(query_ids), self.batch_size), desc=desc, unit="batch"):
            end = start + self.batch_size
            batches.append(generate(self.lm, self.tokenizer, query_ids[start:end], lengths[start:end], self.sampling))
            texts += decode_responses(self.tokenizer, batches[-1])
        return Run(batches, texts, query_ids, lengths, seed)


def score_run(scorers: dict[str, Scorer], queries: list[str], responses: list[str], batch_size: int,
              desc: str) -> dict[str, np.ndarray]:
    """Every scorer's (B,) scores of query + response."""
    chunks: dict[str, list[torch.Tensor]] = {name: [] for name in scorers}
    for start in tqdm(range(0, len(queries), batch_size), desc=desc, unit="batch"):
        end = start + batch_size
        for name, scorer in scorers.items():
            chunks[name].append(scorer(queries[start:end], responses[start:end]))
    return {name: torch.cat(c).float().numpy() for name, c in chunks.items()}


def best_of_n_run(sampler: Sampler, scorer: Scorer, queries: list[str], n: int, first: Run) -> Run:
    """The ``scorer``'s best of ``n`` responses of ``sampler`` to each query, with ``first``'s lengths. Draw 0 is
    ``first``, the sampler's own run (so best of 1 is that run); draw j is sampled with ``first``'s seed + j."""
    draws = [first] + [sampler.run(first.query_ids, first.lengths, first.seed + j, f"sample best-of-{n} draw {j}")
                       for j in range(1, n)]
    scores = torch.stack([torch.from_numpy(score_run({"best": scorer}, queries, draw.texts, sampler.batch_size,
                                                     f"score best-of-{n} draw {j}")["best"])
                          for j, draw in enumerate(draws)], 1)  # (P, n)
    best = best_of_n(scores)  # (P,)
    batches, start = [], 0
    for b, samples in enumerate(first.batches):
        pick = best[start:start + len(samples.has_eos)].to(samples.has_eos.device)  # (B,)
        start += len(pick)

        def chosen(field: str, b: int = b, pick: torch.Tensor = pick) -> torch.Tensor:
            stacked = torch.stack([getattr(draw.batches[b], field) for draw in draws])  # (n, B, ...)
            return stacked[pick, torch.arange(len(pick), device=pick.device)]

        batches.append(Samples(chosen("query_responses"), chosen("attention_mask"), samples.context_length,
                               chosen("response_mask"), chosen("has_eos")))
    return Run(batches, [draws[j].texts[i] for i, j in enumerate(best.tolist())], first.query_ids, first.lengths,
               first.seed)
