"""The LM head in chunks of positions (``logprobs.head_stats``): log-probs, entropies and the exact KL, values and
gradients, equal those of the whole (B, T, V) logits, which it never builds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlhf.models.loading import load_causal_lm
from rlhf.models.policy import PolicyWithValueHead, disable_dropout
from rlhf.models.rollout import Samples, forward, reference_at
from rlhf.pipeline.params import defaults
from rlhf.rl import logprobs as lp

B, T, H, V = 3, 5, 8, 11


def assert_close(ours: torch.Tensor, truth: torch.Tensor) -> None:
    """Equal within fp32's rounding of sums in another order: 1e-5 of each entry or of the tensor's largest."""
    torch.testing.assert_close(ours, truth, rtol=1e-5, atol=1e-5 * truth.abs().max().item())


def whole_logits_stats(head, hidden, labels, ref_head, ref_hidden) -> tuple[torch.Tensor, ...]:
    """The slow reference, straight from the formulas on the whole logits: log p(label), entropy, KL(p || q), log
    q(label)."""
    logp = torch.log_softmax(head(hidden), -1)
    ref_logp = torch.log_softmax(ref_head(ref_hidden), -1)
    p = logp.exp()
    pick = labels.unsqueeze(-1)
    return (logp.gather(-1, pick).squeeze(-1), -(p * logp).sum(-1), (p * (logp - ref_logp)).sum(-1),
            ref_logp.gather(-1, pick).squeeze(-1))


def problem(seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    weight, ref_weight = (torch.randn(V, H, generator=g).requires_grad_() for _ in range(2))
    hidden, ref_hidden = (torch.randn(B, T, H, generator=g).requires_grad_() for _ in range(2))
    labels = torch.randint(0, V, (B, T), generator=g)
    weights = torch.randn(2, B, T, generator=g)  # of the log-probs and of the KL in the loss
    return weight, ref_weight, hidden, ref_hidden, labels, weights


@pytest.mark.parametrize("chunk_elements", [None, 4 * V, V], ids=["one-chunk", "4-rows", "1-row"])
def test_values_and_every_gradient_equal_the_whole_logits(chunk_elements: int | None,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    if chunk_elements is not None:
        monkeypatch.setattr(lp, "CHUNK_ELEMENTS", chunk_elements)
    weight, ref_weight, hidden, ref_hidden, labels, weights = problem(0)
    leaves = (weight, ref_weight, hidden, ref_hidden)

    def head(h: torch.Tensor) -> torch.Tensor:
        return h @ weight.T / 0.7  # at a temperature

    def ref_head(h: torch.Tensor) -> torch.Tensor:
        return h @ ref_weight.T / 0.7

    got = lp.head_stats(head, hidden, labels, V, lp.Reference(ref_head, ref_hidden))
    assert not got.entropy.requires_grad  # a diagnostic
    got_grads = torch.autograd.grad((weights[0] * got.logprobs + weights[1] * got.kl).sum(), leaves)
    expected = whole_logits_stats(head, hidden, labels, ref_head, ref_hidden)
    expected_grads = torch.autograd.grad((weights[0] * expected[0] + weights[1] * expected[2]).sum(), leaves)
    for ours, truth in zip((*got, *got_grads), (*expected, *expected_grads), strict=True):
        assert_close(ours, truth.detach())
    with torch.no_grad():
        unreferenced = lp.head_stats(head, hidden, labels, V)
    assert unreferenced.kl is None and unreferenced.ref_logprobs is None
    assert_close(unreferenced.logprobs, expected[0].detach())
    assert_close(unreferenced.entropy, expected[1].detach())


# the rows the head sees, forward then backward, for 15 positions at most 4 or 8 a chunk, without and with gradients
HEAD_CALLS = {(4, False): [4, 4, 4, 3], (4, True): [4, 4, 4, 3, 4, 4, 4], (8, False): [8, 7], (8, True): [15]}


@pytest.mark.parametrize(("chunk_rows", "grad"), HEAD_CALLS)
def test_the_head_never_sees_more_than_a_chunk_of_positions(chunk_rows: int, grad: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """At most 4 a chunk: 4 equal chunks forward; with gradients the first 3 again in the backward, the last not. At
    most 8, 2 chunks: under gradients one pass over all 15 and none again (recomputing the first would save one
    chunk's memory for a forward of the head on it)."""
    monkeypatch.setattr(lp, "CHUNK_ELEMENTS", chunk_rows * V + 1)
    weight, _, hidden, _, labels, _ = problem(1)
    rows: list[int] = []

    def head(h: torch.Tensor) -> torch.Tensor:
        rows.append(len(h))
        return h @ weight.T

    with torch.set_grad_enabled(grad):
        stats = lp.head_stats(head, hidden, labels, V)
    if grad:
        stats.logprobs.sum().backward()
    assert rows == HEAD_CALLS[chunk_rows, grad]


def test_the_policy_s_logprobs_kl_values_and_gradients_do_not_depend_on_the_chunks(
        tiny_gpt2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the model's own head (``policy.lm_head``) and a value head: 3 positions a chunk against one chunk."""
    torch.manual_seed(0)
    lm, ref_lm = (load_causal_lm(str(tiny_gpt2_dir), defaults().model) for _ in range(2))
    for model in (lm, ref_lm):
        disable_dropout(model)
    with torch.no_grad():  # a reference that differs from the policy
        for weight in ref_lm.parameters():
            weight.add_(0.05 * torch.randn_like(weight))
    policy = PolicyWithValueHead(lm, "shared")
    vocab = lm.config.vocab_size
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab, (3, 9), generator=g)
    attention = torch.ones_like(ids)
    attention[0, :2] = 0  # a left-padded prompt
    response_mask = torch.ones(3, 5, dtype=torch.bool)
    response_mask[1, 3:] = False
    samples = Samples(ids, attention, 4, response_mask, torch.zeros(3, dtype=torch.bool))

    def run() -> list[torch.Tensor]:
        policy.zero_grad()
        out = forward(policy, samples, 0.7, reference_at(ref_lm, samples, 0.7))
        (out.logprobs.sum() + out.kl.sum() + out.values.sum()).backward()
        return [out.logprobs, out.kl, out.ref_logprobs, out.values] + [p.grad.clone() for p in policy.parameters()]

    whole = run()
    monkeypatch.setattr(lp, "CHUNK_ELEMENTS", 3 * vocab)
    for ours, truth in zip(run(), whole, strict=True):
        assert_close(ours, truth)
