"""Sampling responses and scoring them with the policy and the reference: the experience PPO learns from.

Layout of a batch: queries left-padded to P tokens, responses right-padded to R, so the response tokens of every row
are the contiguous slice ``query_responses[:, P:]`` and ``response_mask`` (B, R) marks the real ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.models.decoding import decode
from rlhf.models.policy import PolicyWithValueHead, backbone_hidden, head_at, response_stats
from rlhf.models.sampling import SamplingParams
from rlhf.models.texts import response_texts
from rlhf.rl.logprobs import Reference


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

    @property
    def response_ids(self) -> list[list[int]]:
        """Each response's real token ids (EOS included), as lists: what a reward function gets as TRL's
        ``completion_ids``."""
        return real_rows(self.responses, self.response_mask)

    @property
    def prompt_ids(self) -> list[list[int]]:
        """Each prompt's real token ids (its left padding dropped), as lists."""
        P = self.context_length
        return real_rows(self.query_responses[:, :P], self.attention_mask[:, :P].bool())

    def __getitem__(self, idx: torch.Tensor) -> Samples:
        """The rows ``idx`` (a mini-batch)."""
        return Samples(self.query_responses[idx], self.attention_mask[idx], self.context_length,
                       self.response_mask[idx], self.has_eos[idx])

    def padded(self, context_length: int, response_length: int, pad_id: int) -> Samples:
        """The same samples laid out as (B, context_length + response_length): more left padding before the
        queries, more right padding after the responses, both masked (no real token moves relative to another)."""
        left, right = context_length - self.context_length, response_length - self.responses.shape[1]
        if left < 0 or right < 0:
            raise ValueError(f"Samples.padded: ({context_length}, {response_length}) is shorter than the samples' "
                             f"({self.context_length}, {self.responses.shape[1]})")
        return Samples(F.pad(self.query_responses, (left, right), value=pad_id),
                       F.pad(self.attention_mask, (left, right)), context_length,
                       F.pad(self.response_mask, (0, right)), self.has_eos)


def real_rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """The tokens ``mask`` keeps of each row, as lists: one copy to the host (picking each row's tokens on the GPU
    would wait for it twice a row)."""
    ids, mask = ids.cpu(), mask.cpu()
    return [row[keep].tolist() for row, keep in zip(ids, mask, strict=True)]


def response_lengths(n: int, min_tokens: int, max_tokens: int, generator: torch.Generator) -> list[int]:
    """Per-sample response lengths, uniform in [min_tokens, max_tokens] (the classic recipe's LengthSampler)."""
    return torch.randint(min_tokens, max_tokens + 1, (n,), generator=generator).tolist()


def evaluation_lengths(n: int, min_tokens: int, max_tokens: int, seed: int) -> list[int]:
    """The response length of each of ``n`` eval prompts, drawn from ``seed``: the same in every run and for every
    model (the optimum's pool samples its prompts at these lengths too)."""
    return response_lengths(n, min_tokens, max_tokens, torch.Generator().manual_seed(seed))


def left_pad(query_ids: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    P = max(map(len, query_ids))
    ids = torch.full((len(query_ids), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(query_ids), P), dtype=torch.long)
    for i, q in enumerate(query_ids):
        ids[i, P - len(q):] = torch.tensor(q)
        mask[i, P - len(q):] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def generate(lm: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, query_ids: list[list[int]],
             lengths: list[int], sampling: SamplingParams, cuda_graph: bool = True) -> Samples:
    """Sample all responses in one batched decoding loop (``decoding.decode``), up to the longest length, then cut
    each row. ``cuda_graph``: on CUDA, replay the decoding step as a CUDA graph (no effect elsewhere).

    A row that samples EOS stops there: the EOS token stays in the response (its choice is part of the action) and
    what follows is masked.
    """
    was_training = lm.training
    lm.eval()
    queries, query_mask = left_pad(query_ids, tokenizer.pad_token_id, lm.device)
    P, R = queries.shape[1], max(lengths)
    responses = decode(lm, queries, query_mask, R, sampling, cuda_graph)
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
    """The text of each response, as a scorer reads it after its prompt's text (``texts.response_texts``: a
    character the prompt's last tokens cut is the response's)."""
    return response_texts(tokenizer, samples.prompt_ids, samples.response_ids)


@dataclass
class ForwardOutput:
    logprobs: torch.Tensor  # (B, R)
    values: torch.Tensor | None  # (B, R), policy only
    entropy: torch.Tensor  # (B, R)
    kl: torch.Tensor | None  # (B, R) exact KL to the reference, only when one is given
    ref_logprobs: torch.Tensor | None  # (B, R) the reference's, only when one is given


def forward(model: PolicyWithValueHead | PreTrainedModel, samples: Samples, temperature: float,
            ref: Reference | None = None) -> ForwardOutput:
    """Log-probs of the sampled response tokens (and values for the policy) at temperature ``temperature``; with
    ``ref`` (``reference_at``) also the exact KL to it at each position, and its log-probs.

    The same function serves the rollout (no grad) and the PPO update (with grad), so for an unchanged model the
    update's first ratio is exactly 1.
    """
    args = (samples.query_responses, samples.attention_mask, samples.context_length)
    if isinstance(model, PreTrainedModel):
        stats = response_stats(model, backbone_hidden(model.base_model, *args), samples.responses, temperature, ref)
        values = None
    else:
        stats, values = model(*args, temperature, ref)
    return ForwardOutput(stats.logprobs, values, stats.entropy, stats.kl, stats.ref_logprobs)


def reference_at(lm: PreTrainedModel, samples: Samples, temperature: float) -> Reference:
    """``lm`` as the reference of a ``forward``'s exact KL on ``samples``: its head at ``temperature`` and that
    head's input at the response positions."""
    hidden = backbone_hidden(lm.base_model, samples.query_responses, samples.attention_mask, samples.context_length)
    return Reference(head_at(lm, temperature), hidden)
