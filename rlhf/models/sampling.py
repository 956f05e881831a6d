"""The sampler: top-k / top-p filtering and a draw from the temperature-scaled next-token distribution."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rlhf.pipeline.ppo_params import PpoParams


@dataclass(frozen=True)
class SamplingParams:
    top_k: int = 0
    top_p: float = 1.0
    temperature: float = 1.0

    @classmethod
    def of(cls, cfg: PpoParams) -> SamplingParams:
        """The ppo section's sampling keys: what training, evaluation, sampled pairs and the optimum's pool share."""
        return cls(cfg.top_k, cfg.top_p, cfg.temperature)


def filter_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """(B, V) next-token logits -> the logits sampling draws from: divided by the temperature, then only the
    ``top_k`` largest and the smallest set of tokens holding ``top_p`` of the probability kept (the rest -inf), as
    Hugging Face's temperature, top-k and top-p warpers do, in that order. Each step runs only where it changes
    something: with the defaults the logits pass through untouched."""
    if sampling.temperature != 1.0:
        logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1)  # ascending
        outside = sorted_logits.softmax(-1).cumsum(-1) <= 1 - sampling.top_p
        outside[:, -1] = False  # the most likely token always stays
        logits = logits.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
    return logits


def sample_tokens(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """(B, V) next-token logits -> (B,) sampled token ids; top_k 1 is greedy decoding.

    Inverse-CDF sampling: one uniform draw per row where ``torch.multinomial`` draws one exponential per vocabulary
    entry (50k per row, most of the sampling time on a CPU).
    """
    if sampling.top_k == 1:
        return logits.argmax(-1)
    cdf = filter_logits(logits.float(), sampling).softmax(-1).cumsum(-1)  # (B, V)
    u = torch.rand(len(cdf), 1, device=cdf.device) * cdf[:, -1:]
    # right=True: the first token whose cdf exceeds u, so a zero-probability token (a flat step) is never drawn
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)


