"""Each preference formula against a slow reference written straight from its paper, in Python floats: DPO, cDPO's
label smoothing and IPO with their gradients, RPO's NLL term, padding-safe sequence log-probs, implicit rewards,
best-of-N's KL and selection, and the ranking of scored completions into pairs."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from rlhf.rl import preference as pref

B, T = 6, 5


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def padded_logprobs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) float64 log-probs and a ragged right- or left-padded mask; padding holds -inf and NaN."""
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T) < lengths[:, None]
    if seed % 2:
        mask = mask.flip(-1)
    logprobs = logprobs.masked_fill(~mask, float("-inf"))
    logprobs[0, ~mask[0]] = float("nan")
    return logprobs, mask


def row_sums(logprobs: torch.Tensor, mask: torch.Tensor) -> list[float]:
    return [sum(logprobs[i, t].item() for t in range(T) if mask[i, t]) for i in range(len(logprobs))]


def four_sequences(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token log-probs and masks for the policy's chosen, rejected and the reference's chosen, rejected."""
    return [padded_logprobs(4 * seed + n) for n in range(4)]


def reference_dpo(c: float, r: float, rc: float, rr: float, beta: float, eps: float) -> float:
    """Rafailov et al. eq. 7 with the label flipped with probability eps (Mitchell's cDPO)."""
    h = (c - rc) - (r - rr)
    return -(1 - eps) * math.log(sigmoid(beta * h)) - eps * math.log(sigmoid(-beta * h))


def reference_dpo_dh(h: float, beta: float, eps: float) -> float:
    """d/dh of ``reference_dpo``: d(-log sigma(x))/dx = -sigma(-x)."""
    return -(1 - eps) * beta * sigmoid(-beta * h) + eps * beta * sigmoid(beta * h)


def reference_ipo(c: float, r: float, rc: float, rr: float, tau: float) -> float:
    """Azar et al. eq. 17 on whole-sequence log-probs."""
    return ((c - rc) - (r - rr) - 1 / (2 * tau)) ** 2


def test_sequence_logprobs_sum_real_tokens_whatever_the_padding_holds() -> None:
    for seed in range(4):
        logprobs, mask = padded_logprobs(seed)
        logprobs.requires_grad_(True)
        total = pref.sequence_logprobs(logprobs, mask)
        assert total.tolist() == pytest.approx(row_sums(logprobs.detach(), mask), rel=1e-12)
        total.sum().backward()
        assert torch.equal(logprobs.grad, mask.double()), "padding gets no gradient, real tokens get 1"


@pytest.mark.parametrize(("beta", "eps"), [(0.1, 0.0), (0.5, 0.0), (0.1, 0.2), (2.0, 0.45)])
def test_dpo_loss_from_padded_tokens_matches_the_paper(beta: float, eps: float) -> None:
    for seed in range(3):
        sequences = four_sequences(seed)
        sums = [row_sums(lp, m) for lp, m in sequences]
        losses = pref.dpo_loss(*(pref.sequence_logprobs(lp, m) for lp, m in sequences), beta, eps)
        expected = [reference_dpo(*four, beta, eps) for four in zip(*sums, strict=True)]
        assert losses.tolist() == pytest.approx(expected, rel=1e-12)


def test_ipo_loss_from_padded_tokens_matches_the_paper() -> None:
    for seed, tau in itertools.product(range(3), (0.05, 0.5)):
        sequences = four_sequences(seed)
        sums = [row_sums(lp, m) for lp, m in sequences]
        losses = pref.ipo_loss(*(pref.sequence_logprobs(lp, m) for lp, m in sequences), tau)
        expected = [reference_ipo(*four, tau) for four in zip(*sums, strict=True)]
        assert losses.tolist() == pytest.approx(expected, rel=1e-12)


def test_half_smoothing_makes_the_loss_blind_to_the_label() -> None:
    g = torch.Generator().manual_seed(0)
    c, r, rc, rr = torch.randn(4, B, generator=g, dtype=torch.float64)
    assert torch.allclose(pref.dpo_loss(c, r, rc, rr, 0.3, 0.5), pref.dpo_loss(r, c, rr, rc, 0.3, 0.5))
    assert not torch.allclose(pref.dpo_loss(c, r, rc, rr, 0.3, 0.1), pref.dpo_loss(r, c, rr, rc, 0.3, 0.1))


def sequence_inputs(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [x.requires_grad_(True) for x in torch.randn(4, B, generator=g, dtype=torch.float64) * 3]


@pytest.mark.parametrize(("beta", "eps"), [(0.1, 0.0), (1.0, 0.25)])
def test_dpo_gradient_is_the_analytic_one(beta: float, eps: float) -> None:
    c, r, rc, rr = inputs = sequence_inputs(1)
    pref.dpo_loss(*inputs, beta, eps).sum().backward()
    h = ((c - rc) - (r - rr)).tolist()
    dh = torch.tensor([reference_dpo_dh(x, beta, eps) for x in h], dtype=torch.float64)
    for x, sign in zip(inputs, (1, -1, -1, 1), strict=True):  # dh/d(c, r, rc, rr)
        assert torch.allclose(x.grad, sign * dh, rtol=1e-12, atol=0)
    assert torch.autograd.gradcheck(lambda *xs: pref.dpo_loss(*xs, beta, eps), sequence_inputs(2))


def test_ipo_gradient_is_the_analytic_one() -> None:
    c, r, rc, rr = inputs = sequence_inputs(3)
    pref.ipo_loss(*inputs, 0.2).sum().backward()
    dh = 2 * (((c - rc) - (r - rr)) - 1 / (2 * 0.2)).detach()
    for x, sign in zip(inputs, (1, -1, -1, 1), strict=True):
        assert torch.allclose(x.grad, sign * dh, rtol=1e-12, atol=0)
    assert torch.autograd.gradcheck(lambda *xs: pref.ipo_loss(*xs, 0.2), sequence_inputs(4))


def test_dpo_gradient_through_padded_tokens_by_finite_differences() -> None:
    sequences = four_sequences(5)
    masks = [m for _, m in sequences]
    inputs = [torch.where(m, lp, 0.0).requires_grad_(True) for lp, m in sequences]  # gradcheck perturbs every entry

    def loss(*logprobs: torch.Tensor) -> torch.Tensor:
        return pref.dpo_loss(*(pref.sequence_logprobs(lp, m) for lp, m in zip(logprobs, masks, strict=True)), 0.5,
                             0.1)

    assert torch.autograd.gradcheck(loss, inputs)


def test_chosen_nll_is_the_mean_negative_log_likelihood_of_its_real_tokens() -> None:
    for seed in range(4):
        logprobs, mask = padded_logprobs(seed)
        nll = pref.chosen_nll(pref.sequence_logprobs(logprobs, mask), mask.sum(-1))
        expected = [-total / mask[i].sum().item() for i, total in enumerate(row_sums(logprobs, mask))]
        assert nll.tolist() == pytest.approx(expected, rel=1e-12)


def test_implicit_rewards_accuracy_and_margin() -> None:
    logprobs = [-3.0, -1.0, -2.0, -5.0]
    ref_logprobs = [-2.0, -1.5, -2.0, -4.0]
    rewards = pref.implicit_rewards(torch.tensor(logprobs), torch.tensor(ref_logprobs), 0.1)
    assert rewards.tolist() == pytest.approx([0.1 * (a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)])
    chosen, rejected = [0.3, 0.0, -0.2, 1.0], [0.1, 0.0, 0.5, -1.0]  # one win, a tie, a loss, a win
    chosen_t, rejected_t = torch.tensor(chosen), torch.tensor(rejected)
    assert pref.reward_accuracy(chosen_t, rejected_t).item() == pytest.approx(2 / 4)
    margin = sum(c - r for c, r in zip(chosen, rejected, strict=True)) / 4
    assert pref.reward_margin(chosen_t, rejected_t).item() == pytest.approx(margin)


def best_of_n_exact_kl(probs: list[float], n: int) -> float:
    """KL(best-of-n || reference) of a reference over responses with distinct rewards, ``probs`` in reward order:
    the best of n draws is response i with probability F(i)^n - F(i-1)^n, F the reference's CDF."""
    kl, below = 0.0, 0.0
    for p in probs:
        q = (below + p) ** n - below**n
        kl += q * math.log(q / p) if q > 0 else 0.0
        below += p
    return kl


@pytest.mark.parametrize("n", [1, 2, 4, 16, 64])
def test_best_of_n_kl_bounds_the_exact_kl_and_is_reached_by_many_equally_likely_responses(n: int) -> None:
    bound = pref.best_of_n_kl(n)
    assert best_of_n_exact_kl([1e-4] * 10_000, n) == pytest.approx(bound, abs=2e-3)
    g = torch.Generator().manual_seed(n)
    for _ in range(3):
        probs = torch.rand(20, generator=g, dtype=torch.float64)
        assert best_of_n_exact_kl((probs / probs.sum()).tolist(), n) <= bound + 1e-12
    assert pref.best_of_n_kl(1) == 0.0
    with pytest.raises(ValueError, match="n must be >= 1"):
        pref.best_of_n_kl(0)


def test_best_of_n_picks_the_first_of_the_best() -> None:
    scores = torch.randint(0, 3, (50, 5), generator=torch.Generator().manual_seed(0)).float()  # many ties
    expected = []
    for row in scores.tolist():
        best = 0
        for i, s in enumerate(row):
            if s > row[best]:
                best = i
        expected.append(best)
    assert pref.best_of_n(scores).tolist() == expected
    with pytest.raises(ValueError, match="NaN"):
        pref.best_of_n(torch.tensor([[0.0, float("nan")]]))


def reference_pairs(scores: list[list[float]]) -> list[tuple[int, int, int]]:
    pairs = []
    for p, row in enumerate(scores):
        for i in range(len(row)):
            for j in range(i + 1, len(row)):
                if row[i] != row[j]:
                    pairs.append((p, i, j) if row[i] > row[j] else (p, j, i))
    return pairs


def test_preference_pairs_rank_every_distinct_pair() -> None:
    distinct = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    prompt, chosen, rejected = pref.preference_pairs(distinct)
    assert len(prompt) == 3 * 6, "k = 4 distinct scores give 6 pairs per prompt"
    assert (distinct[prompt, chosen] > distinct[prompt, rejected]).all()
    tied = torch.randint(0, 3, (20, 5), generator=torch.Generator().manual_seed(1)).float()
    got = list(zip(*(x.tolist() for x in pref.preference_pairs(tied)), strict=True))
    assert got == reference_pairs(tied.tolist())
    assert all(len(x) == 0 for x in pref.preference_pairs(torch.ones(2, 3)))
