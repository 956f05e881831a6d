"""Each PPO formula against a slow reference written straight from its definition, on ragged padded batches."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stages.core import ppo

B, T, V = 5, 7, 11


def ragged_mask(seed: int, side: str) -> torch.Tensor:
    """(B, T) mask with rows of random lengths 2..T, padded on ``side``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = torch.zeros(B, T)
    for i, n in enumerate(lengths.tolist()):
        if side == "right":
            mask[i, :n] = 1
        else:
            mask[i, T - n:] = 1
    return mask


def rows(x: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    """The unmasked values of each row, in order."""
    return [[x[i, t].item() for t in range(x.shape[1]) if mask[i, t]] for i in range(x.shape[0])]


CASES = [(seed, side) for seed in range(3) for side in ("left", "right")]


@pytest.fixture(params=CASES, ids=[f"seed{s}-{side}" for s, side in CASES])
def case(request: pytest.FixtureRequest) -> tuple[torch.Generator, torch.Tensor]:
    seed, side = request.param
    return torch.Generator().manual_seed(100 + seed), ragged_mask(seed, side)


def test_masked_mean_var_whiten(case) -> None:
    g, mask = case
    x = torch.randn(B, T, generator=g, dtype=torch.float64)
    flat = [v for row in rows(x, mask) for v in row]
    mean = sum(flat) / len(flat)
    var = sum((v - mean) ** 2 for v in flat) / (len(flat) - 1)
    assert ppo.masked_mean(x, mask).item() == pytest.approx(mean)
    assert ppo.masked_var(x, mask).item() == pytest.approx(var)
    whitened = ppo.masked_whiten(x, mask)
    expected = [(v - mean) / math.sqrt(var + 1e-8) for v in flat]
    assert [v for row in rows(whitened, mask) for v in row] == pytest.approx(expected)
    scaled = ppo.masked_whiten(x, mask, shift_mean=False)
    assert [v for row in rows(scaled, mask) for v in row] == pytest.approx([e + mean for e in expected])
    per_row = ppo.masked_mean(x, mask, dim=1)
    assert per_row.tolist() == pytest.approx([sum(r) / len(r) for r in rows(x, mask)])


def test_masked_var_needs_two_values() -> None:
    with pytest.raises(ValueError, match="at least two"):
        ppo.masked_var(torch.ones(1, 3), torch.tensor([[0.0, 1.0, 0.0]]))


def test_first_and_last_true_indices() -> None:
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert ppo.first_true_indices(mask).tolist() == [1, 4, 0]
    assert ppo.last_true_indices(mask).tolist() == [2, -1, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_logprobs_from_logits(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(B, T, V, generator=g) * 3).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    got = ppo.logprobs_from_logits(logits, labels)
    for i in range(B):
        for t in range(T):
            z = [logits[i, t, v].double().item() for v in range(V)]
            expected = z[labels[i, t]] - math.log(sum(math.exp(zv) for zv in z))
            assert got[i, t].item() == pytest.approx(expected, abs=1e-5)
    assert got.dtype == (torch.float32 if dtype == torch.bfloat16 else dtype)


def test_entropy_from_logits() -> None:
    logits = torch.randn(2, 3, V, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = ppo.entropy_from_logits(logits)
    for i in range(2):
        for t in range(3):
            z = logits[i, t].tolist()
            total = sum(math.exp(v) for v in z)
            expected = -sum(math.exp(v) / total * math.log(math.exp(v) / total) for v in z)
            assert got[i, t].item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("mode", ["kl", "abs", "mse", "k3", "full"])
def test_kl_penalty(mode: str) -> None:
    g = torch.Generator().manual_seed(2)
    logits, ref_logits = torch.randn(B, T, V, generator=g, dtype=torch.float64), torch.randn(B, T, V, generator=g,
                                                                                              dtype=torch.float64)
    labels = torch.randint(0, V, (B, T), generator=g)
    logprobs = ppo.logprobs_from_logits(logits, labels)
    ref_logprobs = ppo.logprobs_from_logits(ref_logits, labels)
    got = ppo.kl_penalty(logprobs, ref_logprobs, mode, logits, ref_logits)
    for i in range(B):
        for t in range(T):
            lp, rlp = logprobs[i, t].item(), ref_logprobs[i, t].item()
            if mode == "full":
                p = torch.softmax(logits[i, t], -1).tolist()
                q = torch.softmax(ref_logits[i, t], -1).tolist()
                expected = sum(pv * math.log(pv / qv) for pv, qv in zip(p, q, strict=True))
            else:
                expected = {"kl": lp - rlp, "abs": abs(lp - rlp), "mse": 0.5 * (lp - rlp) ** 2,
                            "k3": math.exp(rlp - lp) - 1 - (rlp - lp)}[mode]
            assert got[i, t].item() == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_k3_and_full_are_non_negative_and_k1_is_unbiased_on_average() -> None:
    g = torch.Generator().manual_seed(3)
    logits, ref_logits = torch.randn(1, 1, V, generator=g, dtype=torch.float64), torch.randn(1, 1, V, generator=g,
                                                                                              dtype=torch.float64)
    p = torch.softmax(logits[0, 0], -1)
    samples = torch.multinomial(p, 200_000, replacement=True, generator=g).view(1, -1)
    lp = torch.log(p)[samples]
    rlp = torch.log_softmax(ref_logits[0, 0], -1)[samples]
    exact = ppo.kl_penalty(lp[:, :1], rlp[:, :1], "full", logits, ref_logits).item()
    assert ppo.kl_penalty(lp, rlp, "kl").mean().item() == pytest.approx(exact, rel=0.03)
    k3 = ppo.kl_penalty(lp, rlp, "k3")
    assert (k3 >= 0).all() and k3.mean().item() == pytest.approx(exact, rel=0.03)


def test_compute_rewards(case) -> None:
    g, mask = case
    logprobs, ref_logprobs = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    scores = torch.randn(B, generator=g)
    rewards, non_score, kl = ppo.compute_rewards(scores, logprobs, ref_logprobs, mask, kl_coef=0.3)
    for i in range(B):
        last = max(t for t in range(T) if mask[i, t])
        for t in range(T):
            k = (logprobs[i, t] - ref_logprobs[i, t]).item() if mask[i, t] else 0.0
            expected = -0.3 * k + (scores[i].item() if t == last else 0.0)
            assert rewards[i, t].item() == pytest.approx(expected, abs=1e-6)
            assert non_score[i, t].item() == pytest.approx(-0.3 * k, abs=1e-6)
            assert kl[i, t].item() == pytest.approx(k, abs=1e-6)


def test_adaptive_kl_controller() -> None:
    ctl = ppo.AdaptiveKLController(0.2, target=6.0, horizon=10_000)
    expected = 0.2
    for current in [0.0, 3.0, 6.0, 7.0, 100.0]:
        ctl.update(current, n_steps=128)
        error = min(max(current / 6.0 - 1, -0.2), 0.2)
        expected *= 1 + error * 128 / 10_000
        assert ctl.value == pytest.approx(expected)
    restored = ppo.AdaptiveKLController(1.0, 6.0, 10_000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    fixed = ppo.FixedKLController(0.3)
    fixed.update(100.0, 128)
    assert fixed.value == 0.3


def gae_reference(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """GAE on one unpadded episode: A_t = sum_l (gamma lam)^l delta_{t+l}, V after the end = 0."""
    n = len(rewards)
    deltas = [rewards[t] + gamma * (values[t + 1] if t + 1 < n else 0.0) - values[t] for t in range(n)]
    return [sum((gamma * lam) ** (k - t) * deltas[k] for k in range(t, n)) for t in range(n)]


@pytest.mark.parametrize("whiten_rewards", [False, True])
def test_gae_matches_the_unpadded_episodes(case, whiten_rewards: bool) -> None:
    g, mask = case
    values, rewards = torch.randn(B, T, generator=g, dtype=torch.float64), torch.randn(B, T, generator=g,
                                                                                        dtype=torch.float64)
    advantages, returns = ppo.compute_advantages(values, rewards, mask, 0.9, 0.8, whiten_rewards)
    r_rows, v_rows = rows(rewards, mask), rows(values, mask)
    if whiten_rewards:
        flat = [v for row in r_rows for v in row]
        std = math.sqrt(np.var(flat, ddof=1) + 1e-8)
        mean = sum(flat) / len(flat)
        r_rows = [[(v - mean) / std + mean for v in row] for row in r_rows]
    raw = [gae_reference(r, v, 0.9, 0.8) for r, v in zip(r_rows, v_rows, strict=True)]
    for got, adv, v in zip(rows(returns, mask), raw, v_rows, strict=True):
        assert got == pytest.approx([a + vv for a, vv in zip(adv, v, strict=True)])
    flat = [a for row in raw for a in row]
    mean, std = sum(flat) / len(flat), math.sqrt(np.var(flat, ddof=1) + 1e-8)
    assert [a for row in rows(advantages, mask) for a in row] == pytest.approx([(a - mean) / std for a in flat])
    assert (advantages[mask == 0] == 0).all()


def test_policy_and_value_loss_from_definition(case) -> None:
    g, mask = case
    logprobs, old_logprobs = torch.randn(B, T, generator=g) * 0.3, torch.randn(B, T, generator=g) * 0.3
    advantages, values, old_values, returns = (torch.randn(B, T, generator=g) for _ in range(4))
    loss, stats = ppo.ppo_loss(logprobs, values, old_logprobs, old_values, advantages, returns, mask, 0.2, 0.1,
                               0.5, ratio_threshold=10.0)
    pg, vf, clipped, vclipped, n = 0.0, 0.0, 0, 0, 0
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            n += 1
            r = math.exp(logprobs[i, t].item() - old_logprobs[i, t].item())
            a = advantages[i, t].item()
            unclipped, clip = -a * r, -a * min(max(r, 0.8), 1.2)
            pg += max(unclipped, clip)
            clipped += clip > unclipped
            v, vo, ret = values[i, t].item(), old_values[i, t].item(), returns[i, t].item()
            vc = min(max(v, vo - 0.1), vo + 0.1)
            vf += max((v - ret) ** 2, (vc - ret) ** 2)
            vclipped += (vc - ret) ** 2 > (v - ret) ** 2
    assert stats["loss/policy"].item() == pytest.approx(pg / n, rel=1e-5)
    assert stats["loss/value"].item() == pytest.approx(0.5 * vf / n, rel=1e-5)
    assert loss.item() == pytest.approx(pg / n + 0.5 * 0.5 * vf / n, rel=1e-5)
    assert stats["policy/clipfrac"].item() == pytest.approx(clipped / n)
    assert stats["val/clipfrac"].item() == pytest.approx(vclipped / n)
    assert stats["policy/skipped"].item() == 0.0


def test_clipfrac_and_ratio_on_known_cases() -> None:
    mask = torch.ones(1, 4)
    old = torch.zeros(1, 4)
    new = torch.log(torch.tensor([[1.0, 1.1, 1.5, 0.5]]))  # ratios: inside, inside, above, below the 0.2 clip
    advantages = torch.tensor([[1.0, 1.0, 1.0, -1.0]])
    _, stats = ppo.policy_loss(new, old, advantages, mask, cliprange=0.2)
    assert stats["policy/clipfrac"].item() == pytest.approx(0.5)
    assert stats["val/ratio"].item() == pytest.approx((1.0 + 1.1 + 1.5 + 0.5) / 4)
    assert stats["val/ratio_max"].item() == pytest.approx(1.5)
    assert stats["policy/approxkl"].item() == pytest.approx(0.5 * np.mean(np.log([1, 1.1, 1.5, 0.5]) ** 2))


def test_ratio_threshold_skips_the_minibatch() -> None:
    mask = torch.ones(2, 3)
    old = torch.zeros(2, 3)
    new = torch.full((2, 3), math.log(20.0), requires_grad=True)
    loss, stats = ppo.ppo_loss(new, torch.zeros(2, 3), old, torch.zeros(2, 3), torch.ones(2, 3), torch.ones(2, 3),
                               mask, 0.2, 0.2, 0.1, ratio_threshold=10.0)
    loss.backward()
    assert stats["policy/skipped"].item() == 1.0 and loss.item() == 0.0
    assert (new.grad == 0).all()


def test_running_moments_and_score_scaling() -> None:
    g = torch.Generator().manual_seed(4)
    batches = [torch.randn(n, generator=g, dtype=torch.float64) * 3 + 1 for n in (5, 9, 4)]
    moments = ppo.RunningMoments()
    for batch in batches:
        moments.update(batch)
    everything = torch.cat(batches).numpy()
    assert moments.mean == pytest.approx(everything.mean())
    assert moments.std == pytest.approx(everything.std(ddof=1))

    scores = torch.tensor([-4.0, 0.5, 4.0])
    fresh = ppo.RunningMoments()
    scaled = ppo.scale_scores(scores, fresh, True, False, None)
    assert scaled.tolist() == pytest.approx((scores / scores.std()).tolist(), rel=1e-6)
    normed = ppo.scale_scores(scores, ppo.RunningMoments(), True, True, None)
    assert normed.tolist() == pytest.approx(((scores - scores.mean()) / scores.std()).tolist(), rel=1e-6)
    assert ppo.scale_scores(scores, ppo.RunningMoments(), False, False, 1.0).tolist() == [-1.0, 0.5, 1.0]


def test_missing_eos_penalty() -> None:
    scores = torch.tensor([1.0, 2.0, 3.0])
    has_eos = torch.tensor([True, False, True])
    assert ppo.apply_missing_eos_penalty(scores, has_eos, 1.5).tolist() == [1.0, 0.5, 3.0]
    assert ppo.apply_missing_eos_penalty(scores, has_eos, None).tolist() == [1.0, 2.0, 3.0]
