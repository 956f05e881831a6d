"""Log-probabilities of tokens under a causal LM's logits, as pure tensor functions: per-token log-probs, entropies
and the exact KL to a reference (PPO's rollout and update, evaluation's KL; ``head_stats``, which takes the LM head's
input and never holds more than a chunk of the logits) and the mean next-token cross-entropy (SFT's loss).

Logits are (B, T, V) or (N, V) with a V of 50k (GPT-2) to 150k (Qwen2), so every function works in at least float32
on row chunks of bounded size and never materialises a (B, T, V) log-softmax.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def upcast(x: torch.Tensor) -> torch.Tensor:
    """At least float32: a bf16 logsumexp or softmax over 50k entries keeps too few digits."""
    return x if x.dtype == torch.float64 else x.float()


CHUNK_ELEMENTS = 2**24  # 64 MB per fp32 temporary: few kernel launches, bounded peak memory
RECOMPUTE_FROM = 3  # chunks of logits from which head_stats recomputes them in the backward rather than keep them


def in_chunks(fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]], *tensors: torch.Tensor):
    """``fn`` on chunks of whole batch rows, concatenated: its fp32 temporaries stay near CHUNK_ELEMENTS, not
    (B, T, V), which for GPT-2's 50k vocabulary would double or triple the memory of the logits themselves."""
    rows = max(1, CHUNK_ELEMENTS // max(1, tensors[0][0].numel()))
    outs = [fn(*chunk) for chunk in zip(*(x.split(rows) for x in tensors), strict=True)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outs, strict=True))
    return torch.cat(outs)


def _softmax_stats(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(b, T, V) logits, (b, T) labels -> log p(label) (b, T), entropy (b, T), softmax p (b, T, V).

    One temporary of the logits' size (p, built in place) and no log_softmax copy: every fresh (b, T, V) tensor
    costs page faults on the CPU, as much as the arithmetic.
    """
    z = upcast(logits)
    top = z.amax(-1, keepdim=True)
    p = torch.sub(z, top).exp_()  # shifted by the max so exp cannot overflow
    total = p.sum(-1, keepdim=True)
    p.div_(total)
    lse = (top + total.log()).squeeze(-1)  # logsumexp(z)
    logprobs = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    entropy = lse - torch.linalg.vecdot(p, z)  # logsumexp(z) - sum_v p_v z_v
    return logprobs, entropy, p


class _LogprobsEntropy(torch.autograd.Function):
    """Differentiable in the log-probs, whose gradient d log p_y / dz = onehot(y) - p reuses the forward's softmax.

    The entropy is a diagnostic (no gradient). Backward overwrites the saved softmax, so it runs once.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs, entropy, p = _softmax_stats(logits, labels)
        ctx.save_for_backward(p, labels)
        ctx.logits_dtype = logits.dtype
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor) -> tuple[torch.Tensor, None]:
        p, labels = ctx.saved_tensors
        g = grad_logprobs.unsqueeze(-1).to(p.dtype)
        grad = p.mul_(-g).scatter_add_(-1, labels.unsqueeze(-1), g)  # g * (onehot(y) - p), in p's memory
        return grad.to(ctx.logits_dtype), None


def logprobs_and_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, V) logits, (B, T) labels -> log p(label) and the entropy of softmax(logits), each (B, T), in at least
    float32 (float64 for float64 logits). Differentiable in the log-probs.

    Equals ``log_softmax(logits).gather(labels)`` and ``-(softmax * log_softmax).sum(-1)`` without materialising
    the (B, T, V) log_softmax. Without gradients it runs on row chunks to bound the temporaries' memory.
    """
    if torch.is_grad_enabled() and logits.requires_grad:
        return _LogprobsEntropy.apply(logits, labels)
    return in_chunks(lambda z, y: _softmax_stats(z, y)[:2], logits, labels)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits, (B, T) labels -> (B, T) log p(label): ``logprobs_and_entropy`` without the entropy."""
    return logprobs_and_entropy(logits, labels)[0]


def full_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """(..., V) logits of the policy and of the reference (or their log-probs) -> (...) KL(pi || pi_ref) over the
    vocabulary, in at least float32, differentiable in both."""
    logp, ref_logp = F.log_softmax(upcast(logits), -1), F.log_softmax(upcast(ref_logits), -1)
    return (logp.exp() * (logp - ref_logp)).sum(-1)


Head = Callable[[torch.Tensor], torch.Tensor]  # an LM head: (n, H) hidden states -> (n, V) logits


class Reference(NamedTuple):
    """The reference model at the policy's positions, for the exact KL: its LM head and that head's input."""

    head: Head
    hidden: torch.Tensor  # (B, T, H)


class TokenStats(NamedTuple):
    """Per-token statistics of a policy at the sampled tokens, each (B, T) in at least float32."""

    logprobs: torch.Tensor  # log pi(label), differentiable
    entropy: torch.Tensor  # of pi, a diagnostic without gradient
    kl: torch.Tensor | None = None  # KL(pi || pi_ref) over the vocabulary, differentiable; with a Reference only
    ref_logprobs: torch.Tensor | None = None  # log pi_ref(label); with a Reference only


def _chunk_stats(head: Head, ref_head: Head | None, hidden: torch.Tensor, labels: torch.Tensor,
                 ref_hidden: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """``head_stats`` of (n, H) rows, as a tuple of (n,) tensors."""
    logits = head(hidden)
    logprobs, entropy = logprobs_and_entropy(logits, labels)
    if ref_hidden is None:
        return logprobs, entropy
    ref_logp = F.log_softmax(upcast(ref_head(ref_hidden)), -1)
    return logprobs, entropy, full_kl(logits, ref_logp), ref_logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def head_stats(head: Head, hidden: torch.Tensor, labels: torch.Tensor,
               vocab_size: int, ref: Reference | None = None) -> TokenStats:
    """(B, T, H) inputs of an LM head, (B, T) labels -> the ``TokenStats`` of the logits ``head`` ((n, H) -> (n, V))
    gives them (with ``ref``: also the exact KL to the reference and its log-probs), each value and gradient that of
    the whole (B, T, V) logits, which exist whole only under gradients and in fewer than RECOMPUTE_FROM chunks: the
    head runs on equal chunks of positions of at most CHUNK_ELEMENTS logits (smaller chunks cost a GPT-2 update more
    in the head's weight-sized work per chunk than they save: BENCHMARKS.md#the-lm-head-in-chunks).

    With gradients each chunk but the last is checkpointed (torch.utils.checkpoint): its logits are freed after its
    statistics and computed again in the backward, so the backward holds one chunk's at a time too. The last chunk
    keeps what its backward needs, which comes first there: recomputing it would lower no peak. Under gradients,
    fewer than RECOMPUTE_FROM chunks run as one: recomputing the first of two saves one chunk's memory for a forward
    of the head on it, and unrecomputed chunks, all kept for the backward, hold as much as one chunk would, for the
    head's weight-sized work once more (the offline-cpu preset's update: BENCHMARKS.md#the-lm-head-in-chunks).
    """
    positions = labels.numel()
    chunks = -(-positions // max(1, CHUNK_ELEMENTS // vocab_size))
    if torch.is_grad_enabled() and chunks < RECOMPUTE_FROM:
        chunks = 1
    rows = -(-positions // chunks)  # equal chunks: a ragged last one would be one more size for the allocator
    hiddens = hidden.reshape(-1, hidden.shape[-1]).split(rows)
    ref_hiddens = [None] * len(hiddens) if ref is None else ref.hidden.reshape(-1, ref.hidden.shape[-1]).split(rows)
    ref_head = None if ref is None else ref.head
    outs = []
    for i, chunk in enumerate(zip(hiddens, labels.reshape(-1).split(rows), ref_hiddens, strict=True)):
        if torch.is_grad_enabled() and i < len(hiddens) - 1:
            outs.append(checkpoint(_chunk_stats, head, ref_head, *chunk, use_reentrant=False))
        else:
            outs.append(_chunk_stats(head, ref_head, *chunk))
    return TokenStats(*(torch.cat(parts).view(labels.shape) for parts in zip(*outs, strict=True)))


def _row_chunks(logits: torch.Tensor) -> tuple[list[slice], torch.Tensor]:
    """(N, V) -> slices of at most CHUNK_ELEMENTS // V rows, and one fp32 buffer of a chunk's size they all reuse."""
    rows = min(len(logits), max(1, CHUNK_ELEMENTS // logits.shape[1]))
    buffer = torch.empty((rows, logits.shape[1]), dtype=upcast(logits[:0]).dtype, device=logits.device)
    return [slice(i, i + rows) for i in range(0, len(logits), rows)], buffer


def _softmax_into(out: torch.Tensor, logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(logits - lse) in ``out``'s fp32 memory: (n, V), (n,) -> (n, V)."""
    return torch.sub(logits, lse.unsqueeze(-1), out=out).exp_()


class _CrossEntropy(torch.autograd.Function):
    """Mean of -log p(label) over (N, V) logits; saves only the logits and their (N,) logsumexp, and works through
    row chunks in one reused fp32 buffer, forward and backward (which recomputes each chunk's softmax)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        chunks, buffer = _row_chunks(logits)
        lse = torch.empty(len(logits), dtype=buffer.dtype, device=logits.device)
        for rows in chunks:
            z = buffer[: len(logits[rows])].copy_(logits[rows])
            top = z.amax(-1)
            lse[rows] = top + _softmax_into(z, z, top).sum(-1).log()
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1).to(lse.dtype)
        ctx.save_for_backward(logits, labels, lse)
        return (lse - picked).mean()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        scale = grad_loss.to(lse.dtype) / len(logits)
        chunks, buffer = _row_chunks(logits)
        for rows in chunks:
            p = _softmax_into(buffer[: len(logits[rows])], logits[rows], lse[rows])
            p.scatter_add_(-1, labels[rows].unsqueeze(-1), torch.full_like(p[:, :1], -1.0))  # softmax - onehot
            grad[rows] = p.mul_(scale)
        return grad, None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(N, V) logits, (N,) labels -> the mean of -log softmax(logits)[label], in at least float32.

    ``F.cross_entropy`` on bf16 logits upcast to fp32 keeps two (N, V) fp32 tensors alive and writes four more, each a
    fresh allocation (on the CPU, as costly in page faults as the arithmetic); this keeps none beyond a chunk-sized
    buffer. The gradient is cast back to the logits' dtype, as autocast's upcast would.
    """
    return _CrossEntropy.apply(logits, labels)
