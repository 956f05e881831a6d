"""Sampling responses and scoring them with the policy and the reference: the experience PPO learns from.

Layout of a batch: queries left-padded to P tokens, responses right-padded to R, so the response tokens of every row
are the contiguous slice ``query_responses[:, P:]`` and ``response_mask`` (B, R) marks the real ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from stages.core.policy import PolicyWithValueHead, lm_head, position_ids_from, response_logits
from stages.core.ppo import logprobs_and_entropy


@dataclass
class SamplingParams:
    top_k: int = 0
    top_p: float = 1.0
    temperature: float = 1.0


@dataclass
class Samples:
    """Sampled responses for a batch of queries."""

    query_responses: torch.Tensor  # (B, P + R) token ids
    attention_mask: torch.Tensor  # (B, P + R) 1 on real query and response tokens
    context_length: int  # P
    response_mask: torch.Tensor  # (B, R) bool: real response tokens (up to the sampled length, EOS included)
    has_eos: torch.Tensor  # (B,) bool: the response ended with EOS before its length ran out

    @property
    def responses(self) -> torch.Tensor:
        return self.query_responses[:, self.context_length:]


def response_lengths(n: int, min_tokens: int, max_tokens: int, generator: torch.Generator) -> list[int]:
    """Per-sample response lengths, uniform in [min_tokens, max_tokens] (the classic recipe's LengthSampler)."""
    return torch.randint(min_tokens, max_tokens + 1, (n,), generator=generator).tolist()


def left_pad(query_ids: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(map(len, query_ids))
    ids = torch.full((len(query_ids), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(query_ids), P), dtype=torch.long)
    for i, q in enumerate(query_ids):
        ids[i, P - len(q):] = torch.tensor(q)
        mask[i, P - len(q):] = 1
    return ids.to(device), mask.to(device)


def filter_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """(B, V) next-token logits -> the logits sampling draws from: divided by the temperature, then only the
    ``top_k`` largest and the smallest set of tokens holding ``top_p`` of the probability kept (the rest -inf), as
    Hugging Face's temperature, top-k and top-p warpers do, in that order."""
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


@torch.no_grad()
def generate(lm: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, query_ids: list[list[int]],
             lengths: list[int], sampling: SamplingParams) -> Samples:
    """Sample all responses in one batched decoding loop (KV cache), up to the longest length, then cut each row.

    A row that samples EOS stops there: the EOS token stays in the response (its choice is part of the action) and
    what follows is masked. The LM head runs in fp32 on the last position only, as in the training forward.
    """
    was_training = lm.training
    lm.eval()
    queries, query_mask = left_pad(query_ids, tokenizer.pad_token_id, lm.device)
    (B, P), R = queries.shape, max(lengths)
    responses = torch.empty((B, R), dtype=torch.long, device=lm.device)
    attention_mask, positions = query_mask, position_ids_from(query_mask)
    out = lm.base_model(input_ids=queries, attention_mask=attention_mask, position_ids=positions, use_cache=True)
    for t in range(R):
        responses[:, t] = sample_tokens(lm_head(lm, out.last_hidden_state[:, -1]), sampling)
        if t == R - 1:
            break
        # every sampled token is attended while decoding; the cut at each row's length and EOS comes after
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(B, 1)], dim=1)
        positions = positions[:, -1:] + 1
        out = lm.base_model(input_ids=responses[:, t: t + 1], attention_mask=attention_mask, position_ids=positions,
                            past_key_values=out.past_key_values, use_cache=True)
    lm.train(was_training)
    length_mask = torch.arange(R, device=lm.device) < torch.tensor(lengths, device=lm.device)[:, None]
    is_eos = (responses == tokenizer.eos_token_id) & length_mask
    after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0  # strictly after the first EOS
    response_mask = length_mask & ~after_eos
    responses = responses.masked_fill(~response_mask, tokenizer.pad_token_id)
    query_responses = torch.cat([queries, responses], dim=1)
    attention_mask = torch.cat([query_mask, response_mask.long()], dim=1)
    return Samples(query_responses, attention_mask, P, response_mask, is_eos.any(-1))


def decode_responses(tokenizer: PreTrainedTokenizerBase, samples: Samples) -> list[str]:
    return [tokenizer.decode(r[m], skip_special_tokens=True)
            for r, m in zip(samples.responses, samples.response_mask, strict=True)]


@dataclass
class ForwardOutput:
    logprobs: torch.Tensor  # (B, R)
    values: torch.Tensor | None  # (B, R), policy only
    entropy: torch.Tensor  # (B, R)
    logits: torch.Tensor | None  # (B, R, V), only when asked for (exact KL)


def forward(model: PolicyWithValueHead | PreTrainedModel, samples: Samples, temperature: float,
            keep_logits: bool = False) -> ForwardOutput:
    """Log-probs of the sampled response tokens (and values for the policy) at temperature ``temperature``.

    The same function serves the rollout (no grad) and the PPO update (with grad), so for an unchanged model the
    update's first ratio is exactly 1.
    """
    args = (samples.query_responses, samples.attention_mask, samples.context_length)
    if isinstance(model, PreTrainedModel):
        logits, values = response_logits(model, *args), None
    else:
        logits, values = model(*args)
    if temperature != 1.0:  # a (B, R, V) copy otherwise
        logits = logits / temperature
    logprobs, entropy = logprobs_and_entropy(logits, samples.responses)
    return ForwardOutput(logprobs, values, entropy, logits if keep_logits else None)
