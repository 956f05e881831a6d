"""Each PPO formula against a slow reference written straight from its definition, on ragged padded batches."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlhf.rl import advantages as estimators
from rlhf.rl import logprobs as lp
from rlhf.rl import ppo

B, T, V = 5, 7, 11


def ragged_mask(seed: int, side: str) -> torch.Tensor:
    """(B, T) float mask with rows of random lengths 1..T (one row always full), padded on ``side``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g).tolist()
    lengths[seed % B] = T
    mask = torch.zeros(B, T)
    for i, n in enumerate(lengths):
        if side == "right":
            mask[i, :n] = 1
        else:
            mask[i, T - n:] = 1
    return mask


def rows(x: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    """The unmasked values of each row, in order."""
    return [[x[i, t].item() for t in range(x.shape[1]) if mask[i, t]] for i in range(x.shape[0])]


def flat(x: torch.Tensor, mask: torch.Tensor) -> list[float]:
    return [v for row in rows(x, mask) for v in row]


CASES = [(seed, side) for seed in range(3) for side in ("left", "right")]


@pytest.fixture(params=CASES, ids=[f"seed{s}-{side}" for s, side in CASES])
def case(request: pytest.FixtureRequest) -> tuple[torch.Generator, torch.Tensor]:
    seed, side = request.param
    return torch.Generator().manual_seed(100 + seed), ragged_mask(seed, side)


@pytest.fixture(params=[None, 1, 2 * T * V], ids=["one-chunk", "row-chunks", "two-row-chunks"])
def chunk_elements(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the vocabulary reductions in one chunk, one row per chunk, and two rows per chunk (ragged last chunk)."""
    if request.param is not None:
        monkeypatch.setattr(lp, "CHUNK_ELEMENTS", request.param)


# --- masked statistics -----------------------------------------------------------------------------------------------


def test_masked_mean_var_whiten(case) -> None:
    g, mask = case
    x = torch.randn(B, T, generator=g, dtype=torch.float64)
    values = flat(x, mask)
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    for m in (mask, mask.bool()):
        assert ppo.masked_mean(x, m).item() == pytest.approx(mean)
        assert ppo.masked_var(x, m).item() == pytest.approx(var)
    assert ppo.masked_var(x, mask, unbiased=False).item() == pytest.approx(var * (len(values) - 1) / len(values))
    expected = [(v - mean) / math.sqrt(var + 1e-8) for v in values]
    assert flat(ppo.masked_whiten(x, mask), mask) == pytest.approx(expected)
    assert flat(ppo.masked_whiten(x, mask, shift_mean=False), mask) == pytest.approx([e + mean for e in expected])
    assert ppo.masked_mean(x, mask, dim=1).tolist() == pytest.approx([sum(r) / len(r) for r in rows(x, mask)])


def test_masked_whiten_equals_whitening_the_unmasked_values(case) -> None:
    g, mask = case
    x = torch.randn(B, T, generator=g, dtype=torch.float64) * 4 + 2
    x[mask == 0] = 1e6  # padding garbage must not enter the statistics
    unmasked = torch.tensor(flat(x, mask), dtype=torch.float64)
    expected = (unmasked - unmasked.mean()) / torch.sqrt(unmasked.var() + 1e-8)
    assert flat(ppo.masked_whiten(x, mask), mask) == pytest.approx(expected.tolist())


@pytest.mark.parametrize("n", [0, 1])
def test_masked_var_needs_two_values(n: int) -> None:
    mask = torch.tensor([[0.0, 1.0, 0.0]]) if n else torch.zeros(1, 3)
    with pytest.raises(ValueError, match=f"unbiased variance needs at least two unmasked values, got {n}"):
        ppo.masked_var(torch.ones(1, 3), mask)


def test_last_true_indices(case) -> None:
    _, mask = case
    mask = torch.cat([mask, torch.zeros(1, T)])  # and a row with none
    last = [max((t for t in range(T) if mask[i, t]), default=-1) for i in range(B + 1)]
    for m in (mask, mask.bool()):
        assert ppo.last_true_indices(m).tolist() == last


# --- log-probabilities and KL ----------------------------------------------------------------------------------------


def logsumexp_loop(z: list[float]) -> float:
    top = max(z)
    return top + math.log(sum(math.exp(v - top) for v in z))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_logprobs_from_logits(dtype: torch.dtype, chunk_elements) -> None:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(B, T, V, generator=g) * 3).to(dtype)
    labels = torch.randint(0, V, (B, T), generator=g)
    got = lp.logprobs_from_logits(logits, labels)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    for i in range(B):
        for t in range(T):
            z = [logits[i, t, v].double().item() for v in range(V)]
            # 1e-5 is far below bf16's resolution: the formula must run in float32 on the upcast logits
            assert got[i, t].item() == pytest.approx(z[labels[i, t]] - logsumexp_loop(z), abs=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_logprobs_gradient_matches_log_softmax_gather(dtype: torch.dtype, chunk_elements) -> None:
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(B, T, V, generator=g, dtype=torch.float64) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, T), generator=g)
    weights = torch.randn(B, T, generator=g, dtype=torch.float64)
    logprobs, entropy = lp.logprobs_and_entropy(logits, labels)
    assert not entropy.requires_grad  # a diagnostic: no gradient flows through it
    (logprobs * weights).sum().backward()
    ours, logits.grad = logits.grad, None
    assert ours.dtype == dtype
    naive = torch.log_softmax(logits.double(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    (naive * weights).sum().backward()
    tolerance = {} if dtype == torch.float64 else {"rtol": 1e-2, "atol": 1e-5}  # bf16 rounds the gradient itself
    torch.testing.assert_close(ours.double(), logits.grad.double(), **tolerance)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_cross_entropy_is_the_mean_negative_log_softmax_of_the_labels(dtype: torch.dtype, chunk_elements) -> None:
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(B * T, V, generator=g, dtype=torch.float64) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B * T,), generator=g)
    loss = lp.cross_entropy(logits, labels)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    rows_z = [[logits[n, v].double().item() for v in range(V)] for n in range(B * T)]
    expected = sum(logsumexp_loop(z) - z[y] for z, y in zip(rows_z, labels.tolist(), strict=True)) / (B * T)
    assert loss.item() == pytest.approx(expected, abs=1e-6)  # in float32 on the upcast logits, even for bf16
    (3 * loss).backward()
    # d/dz_v of the mean: (softmax(z)_v - [v == y]) / N for each row
    softmax = torch.softmax(logits.detach().double(), -1)
    naive = 3 * (softmax - torch.nn.functional.one_hot(labels, V).double()) / (B * T)
    assert logits.grad.dtype == dtype
    tolerance = {} if dtype == torch.float64 else {"rtol": 1e-2, "atol": 1e-5}  # bf16 rounds the gradient itself
    torch.testing.assert_close(logits.grad.double(), naive, **tolerance)


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_entropy(dtype: torch.dtype, grad: bool, chunk_elements) -> None:
    logits = (torch.randn(B, T, V, generator=torch.Generator().manual_seed(1)) * 2).to(dtype).requires_grad_(grad)
    labels = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))
    logprobs, got = lp.logprobs_and_entropy(logits, labels)
    for i in range(B):
        for t in range(T):
            z = logits[i, t].double().tolist()
            p = [math.exp(v - logsumexp_loop(z)) for v in z]
            assert got[i, t].item() == pytest.approx(-sum(pv * math.log(pv) for pv in p), rel=1e-5)
            assert logprobs[i, t].item() == pytest.approx(z[labels[i, t]] - logsumexp_loop(z), abs=1e-5)


def random_policies(seed: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    """logits, ref_logits (B, T, V), labels (B, T) and their logprobs, ref_logprobs."""
    g = torch.Generator().manual_seed(seed)
    logits, ref_logits = (torch.randn(B, T, V, generator=g).to(dtype) for _ in range(2))
    labels = torch.randint(0, V, (B, T), generator=g)
    return logits, ref_logits, labels, lp.logprobs_from_logits(logits, labels), lp.logprobs_from_logits(ref_logits,
                                                                                                     labels)


def full_kl_loop(logits: torch.Tensor, ref_logits: torch.Tensor, i: int, t: int) -> float:
    z, zr = logits[i, t].double().tolist(), ref_logits[i, t].double().tolist()
    logp = [v - logsumexp_loop(z) for v in z]
    ref_logp = [v - logsumexp_loop(zr) for v in zr]
    return sum(math.exp(lp) * (lp - rlp) for lp, rlp in zip(logp, ref_logp, strict=True))


@pytest.mark.parametrize("mode", ["kl", "abs", "mse", "k3", "full"])
def test_kl_penalty(mode: str, chunk_elements) -> None:
    logits, ref_logits, _, logprobs, ref_logprobs = random_policies(2)
    got = ppo.kl_penalty(logprobs, ref_logprobs, mode, lp.full_kl(logits, ref_logits))
    for i in range(B):
        for t in range(T):
            x, rx = logprobs[i, t].item(), ref_logprobs[i, t].item()
            r = rx - x
            expected = {"kl": x - rx, "abs": abs(x - rx), "mse": 0.5 * (x - rx) ** 2,
                        "k3": (math.exp(r) - 1) - r}.get(mode) if mode != "full" else full_kl_loop(logits, ref_logits,
                                                                                                   i, t)
            assert got[i, t].item() == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_full_kl_in_float32_for_bfloat16_logits(chunk_elements) -> None:
    logits, ref_logits, _, logprobs, ref_logprobs = random_policies(6, torch.bfloat16)
    got = ppo.kl_penalty(logprobs, ref_logprobs, "full", lp.full_kl(logits, ref_logits))
    assert got.dtype == torch.float32
    for i in range(B):
        for t in range(T):
            assert got[i, t].item() == pytest.approx(full_kl_loop(logits, ref_logits, i, t), abs=1e-6)


def test_kl_penalty_bad_arguments() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="kl_penalty: mode 'full' needs full_kl"):
        ppo.kl_penalty(x, x, "full")
    with pytest.raises(ValueError, match="kl_penalty: unknown mode 'k2'"):
        ppo.kl_penalty(x, x, "k2")


def test_k3_and_full_are_non_negative_and_k1_k3_are_unbiased_on_average() -> None:
    g = torch.Generator().manual_seed(3)
    logits, ref_logits = torch.randn(1, 1, V, generator=g, dtype=torch.float64), torch.randn(1, 1, V, generator=g,
                                                                                              dtype=torch.float64)
    p = torch.softmax(logits[0, 0], -1)
    samples = torch.multinomial(p, 200_000, replacement=True, generator=g).view(1, -1)
    lp = torch.log(p)[samples]
    rlp = torch.log_softmax(ref_logits[0, 0], -1)[samples]
    exact = full_kl_loop(logits, ref_logits, 0, 0)
    assert exact > 0
    assert ppo.kl_penalty(lp, rlp, "kl").mean().item() == pytest.approx(exact, rel=0.03)
    k3 = ppo.kl_penalty(lp, rlp, "k3")
    assert (k3 >= 0).all() and k3.mean().item() == pytest.approx(exact, rel=0.03)


@pytest.mark.parametrize("kl_mode", ["kl", "k3"])
def test_compute_rewards(case, kl_mode: str) -> None:
    g, mask = case
    logprobs, ref_logprobs = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    scores = torch.randn(B, generator=g)
    kl = ppo.kl_penalty(logprobs, ref_logprobs, kl_mode) * mask
    rewards, non_score = ppo.compute_rewards(scores, kl, mask, kl_coef=0.3)
    for i in range(B):
        last = max(t for t in range(T) if mask[i, t])
        for t in range(T):
            lp, rlp = logprobs[i, t].item(), ref_logprobs[i, t].item()
            k = (lp - rlp if kl_mode == "kl" else math.exp(rlp - lp) - 1 - (rlp - lp)) if mask[i, t] else 0.0
            assert non_score[i, t].item() == pytest.approx(-0.3 * k, abs=1e-5)
            assert rewards[i, t].item() == pytest.approx(-0.3 * k + (scores[i].item() if t == last else 0.0), abs=1e-5)


def test_next_position_gives_each_real_token_the_kl_after_it() -> None:
    kl = torch.tensor([[1.0, 2.0, 3.0, 9.0], [9.0, 1.0, 2.0, 3.0]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])  # right and left padded
    assert ppo.next_position(kl, mask).tolist() == [[2.0, 3.0, 0.0, 0.0], [0.0, 2.0, 3.0, 0.0]]


def test_the_exact_estimator_s_expected_gradient_is_the_sequence_kl_s() -> None:
    """On every sequence of two tokens from three, weighed by its probability: the exact KL at each position as a
    loss (``full_kl``) plus each token's log-prob times the KL after it (``next_position``, summed to the end) has
    the gradient of KL(pi || pi_ref) over whole sequences. The KL after a token as its reward alone (full) misses the
    KL's own gradient at each position, which is what lets full's KL run away."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(4, 3, generator=g, dtype=torch.float64, requires_grad=True)  # logits after (), (0), (1), (2)
    ref_table = torch.randn(4, 3, generator=g, dtype=torch.float64)
    sequences = torch.tensor([[a, b] for a in range(3) for b in range(3)])
    prefixes = torch.stack([torch.zeros(9, dtype=torch.long), sequences[:, 0] + 1], 1)  # (9, 2): the state's row
    logits, ref_logits = table[prefixes], ref_table[prefixes]  # (9, 2, 3)
    logprobs = torch.log_softmax(logits, -1).gather(-1, sequences[..., None]).squeeze(-1)
    ref_logprobs = torch.log_softmax(ref_logits, -1).gather(-1, sequences[..., None]).squeeze(-1)
    weights = logprobs.sum(1).exp()
    kl = (weights * (logprobs - ref_logprobs).sum(1)).sum()
    (truth,) = torch.autograd.grad(kl, table, retain_graph=True)

    mask = torch.ones(9, 2)
    per_position = lp.full_kl(logits, ref_logits)
    to_come = ppo.next_position(per_position.detach(), mask).flip(1).cumsum(1).flip(1)  # the KL after each token
    score_function = (logprobs * to_come).sum(1)
    (exact,) = torch.autograd.grad((weights.detach() * (per_position.sum(1) + score_function)).sum(), table,
                                   retain_graph=True)
    assert torch.allclose(exact, truth, rtol=1e-10, atol=1e-12)
    full_to_come = (per_position.detach() * mask).flip(1).cumsum(1).flip(1)  # full: the KL from the token on
    (full,) = torch.autograd.grad((weights.detach() * (logprobs * full_to_come).sum(1)).sum(), table)
    assert not torch.allclose(full, truth, rtol=0.1)


def test_compute_rewards_needs_a_real_token_per_row() -> None:
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match=r"compute_rewards: rows \[1\] have no real response token"):
        ppo.compute_rewards(torch.ones(2), torch.zeros(2, 2), mask, kl_coef=0.1)


# --- KL controllers --------------------------------------------------------------------------------------------------


def test_adaptive_kl_controller_follows_ziegler_with_clipped_error() -> None:
    ctl = ppo.AdaptiveKLController(0.2, target=6.0, horizon=10_000)
    # current KL -> proportional error, clipped to +-0.2 by hand: 0 and 3 undershoot, 100 overshoots
    expected = 0.2
    for current, error in [(0.0, -0.2), (3.0, -0.2), (6.0, 0.0), (7.0, 1 / 6), (100.0, 0.2)]:
        ctl.update(current, n_steps=128)
        expected *= 1 + error * 128 / 10_000
        assert ctl.value == pytest.approx(expected, rel=1e-12)
    assert ctl.value < 0.2  # two clipped undershoots outweigh 1/6 + one clipped overshoot
    restored = ppo.AdaptiveKLController(1.0, 6.0, 10_000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value


def test_fixed_kl_controller_never_moves() -> None:
    fixed = ppo.FixedKLController(0.3)
    for current in (0.0, 100.0):
        fixed.update(current, 128)
    assert fixed.value == 0.3 and fixed.state_dict() == {"value": 0.3}


# --- advantages ------------------------------------------------------------------------------------------------------


def gae_reference(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """GAE on one unpadded episode: A_t = sum_l (gamma lam)^l delta_{t+l}, V after the end = 0."""
    n = len(rewards)
    deltas = [rewards[t] + gamma * (values[t + 1] if t + 1 < n else 0.0) - values[t] for t in range(n)]
    return [sum((gamma * lam) ** (k - t) * deltas[k] for k in range(t, n)) for t in range(n)]


@pytest.mark.parametrize("whiten_rewards", [False, True])
def test_gae_matches_the_unpadded_episodes(case, whiten_rewards: bool) -> None:
    g, mask = case
    values, rewards = (torch.randn(B, T, generator=g, dtype=torch.float64) for _ in range(2))
    values[mask == 0], rewards[mask == 0] = 50.0, -30.0  # padding garbage must not leak into real tokens
    advantages, returns = estimators.gae_advantages(values, rewards, mask, 0.9, 0.8, whiten_rewards)
    r_rows, v_rows = rows(rewards, mask), rows(values, mask)
    if whiten_rewards:
        r_flat = flat(rewards, mask)
        mean, std = np.mean(r_flat), math.sqrt(np.var(r_flat, ddof=1) + 1e-8)
        r_rows = [[(v - mean) / std + mean for v in row] for row in r_rows]
    raw = [gae_reference(r, v, 0.9, 0.8) for r, v in zip(r_rows, v_rows, strict=True)]
    for got, adv, v in zip(rows(returns, mask), raw, v_rows, strict=True):
        assert got == pytest.approx([a + vv for a, vv in zip(adv, v, strict=True)])
    raw_flat = [a for row in raw for a in row]
    mean, std = np.mean(raw_flat), math.sqrt(np.var(raw_flat, ddof=1) + 1e-8)
    assert flat(advantages, mask) == pytest.approx([(a - mean) / std for a in raw_flat])
    assert (advantages[mask == 0] == 0).all() and (returns[mask == 0] == 0).all()


@pytest.mark.parametrize("seed", range(3))
def test_gae_is_the_same_left_padded_right_padded_and_unpadded(seed: int) -> None:
    left, right = ragged_mask(seed, "left"), ragged_mask(seed, "right")
    g = torch.Generator().manual_seed(seed)
    values_left, rewards_left = (torch.randn(B, T, generator=g, dtype=torch.float64) for _ in range(2))
    values_right, rewards_right = torch.zeros(B, T, dtype=torch.float64), torch.zeros(B, T, dtype=torch.float64)
    values_right[right == 1], rewards_right[right == 1] = values_left[left == 1], rewards_left[left == 1]
    adv_left, ret_left = estimators.gae_advantages(values_left, rewards_left, left, 1.0, 0.95)
    adv_right, ret_right = estimators.gae_advantages(values_right, rewards_right, right, 1.0, 0.95)
    assert torch.equal(ret_left[left == 1], ret_right[right == 1])  # the same arithmetic on the same numbers
    torch.testing.assert_close(adv_left[left == 1], adv_right[right == 1])  # batch whitening sums in another order
    for i in range(B):
        real = left[i] == 1
        if real.sum() < 2:
            continue  # whitening a single value is undefined
        _, ret_alone = estimators.gae_advantages(values_left[i:i + 1, real], rewards_left[i:i + 1, real],
                                              torch.ones(1, int(real.sum())), 1.0, 0.95)
        assert torch.equal(ret_alone[0], ret_left[i, real])


def test_reward_scale_turns_reward_units_into_the_advantages_units(case) -> None:
    """GAE's whitened advantages are its raw advantages (rewards' units) less their mean, times the scale; RLOO keeps
    the rewards' units; GRPO has a scale per group, so none."""
    g, mask = case
    values, rewards = torch.randn(B, T, generator=g, dtype=torch.float64), torch.randn(B, T, generator=g,
                                                                                      dtype=torch.float64)
    advantages, returns = estimators.gae_advantages(values, rewards, mask, 1.0, 0.95)
    raw = returns - values * mask
    scale = estimators.reward_scale("gae", rewards, mask, values, returns, False)
    assert torch.allclose(advantages, (raw - ppo.masked_mean(raw, mask)) * scale * mask, atol=1e-6)
    whitened = ppo.masked_whiten(rewards, mask, shift_mean=False) * mask
    _, returns_w = estimators.gae_advantages(values, whitened, mask, 1.0, 0.95)
    assert estimators.reward_scale("gae", rewards, mask, values, returns_w, True).item() == pytest.approx(
        (estimators.reward_scale("gae", whitened, mask, values, returns_w, False)
         * torch.rsqrt(ppo.masked_var(rewards, mask) + 1e-8)).item())
    assert estimators.reward_scale("rloo", rewards, mask, None, None, False).item() == 1.0
    with pytest.raises(ValueError, match="grpo's advantages scale each group"):
        estimators.reward_scale("grpo", rewards, mask, None, None, False)


# --- losses ----------------------------------------------------------------------------------------------------------


def test_policy_and_value_loss_from_definition(case) -> None:
    g, mask = case
    logprobs, old_logprobs = torch.randn(B, T, generator=g) * 0.3, torch.randn(B, T, generator=g) * 0.3
    advantages, values, old_values, returns = (torch.randn(B, T, generator=g) for _ in range(4))
    old = ppo.Experience(old_logprobs, old_logprobs, old_values, advantages, returns, mask)
    cfg = SimpleNamespace(cliprange=0.2, cliprange_value=0.1, vf_coef=0.5, ratio_threshold=10.0, kl_loss_coef=0.0)
    loss, stats = ppo.ppo_loss(logprobs, values, old, cfg)
    pg, vf, clipped, vclipped, approxkl, policykl, ratios = 0.0, 0.0, 0, 0, 0.0, 0.0, []
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            r = math.exp(logprobs[i, t].item() - old_logprobs[i, t].item())
            a = advantages[i, t].item()
            unclipped, clip = -a * r, -a * min(max(r, 0.8), 1.2)
            pg += max(unclipped, clip)
            clipped += clip > unclipped
            ratios.append(r)
            approxkl += 0.5 * math.log(r) ** 2
            policykl += -math.log(r)
            v, vo, ret = values[i, t].item(), old_values[i, t].item(), returns[i, t].item()
            vc = min(max(v, vo - 0.1), vo + 0.1)
            vf += max((v - ret) ** 2, (vc - ret) ** 2)
            vclipped += (vc - ret) ** 2 > (v - ret) ** 2
    n = len(ratios)
    assert stats["loss/policy"].item() == pytest.approx(pg / n, rel=1e-5)
    assert stats["loss/value"].item() == pytest.approx(0.5 * vf / n, rel=1e-5)
    assert loss.item() == pytest.approx(pg / n + 0.5 * 0.5 * vf / n, rel=1e-5)
    assert stats["policy/clipfrac"].item() == pytest.approx(clipped / n)
    assert stats["val/clipfrac"].item() == pytest.approx(vclipped / n)
    assert stats["policy/approxkl"].item() == pytest.approx(approxkl / n, rel=1e-5)
    assert stats["policy/policykl"].item() == pytest.approx(policykl / n, rel=1e-4, abs=1e-6)
    assert stats["val/ratio"].item() == pytest.approx(sum(ratios) / n, rel=1e-5)
    assert stats["val/ratio_max"].item() == pytest.approx(max(ratios), rel=1e-5)
    assert stats["policy/skipped"].item() == 0.0


def test_policy_clipfrac_on_known_cases() -> None:
    # clipping binds only where it makes the loss larger (the pessimistic bound): ratio above 1+c with A > 0 or
    # below 1-c with A < 0. Ratio outside the range on the other side of A keeps the unclipped, larger loss.
    ratios = torch.tensor([[1.0, 1.1, 1.5, 0.5, 1.5, 0.5]])
    advantages = torch.tensor([[1.0, -1.0, 1.0, -1.0, -1.0, 1.0]])
    binds = [False, False, True, True, False, False]
    mask = torch.ones(1, 6)
    loss, stats = ppo.policy_loss(torch.log(ratios), torch.zeros(1, 6), advantages, mask, cliprange=0.2)
    assert stats["policy/clipfrac"].item() == pytest.approx(sum(binds) / 6)
    # per-token losses from the definition: -A * (clipped ratio where clipping binds, else ratio)
    used = [1.0, 1.1, 1.2, 0.8, 1.5, 0.5]
    assert loss.item() == pytest.approx(sum(-a * r for a, r in zip(advantages[0].tolist(), used, strict=True)) / 6)
    mask[0, 2] = 0  # masked tokens count for neither numerator nor denominator
    _, stats = ppo.policy_loss(torch.log(ratios), torch.zeros(1, 6), advantages, mask, cliprange=0.2)
    assert stats["policy/clipfrac"].item() == pytest.approx(1 / 5)
    assert stats["val/ratio_max"].item() == pytest.approx(1.5)  # the unmasked 1.5 at index 4


def test_value_clipfrac_on_known_cases() -> None:
    old_values = torch.zeros(1, 4)
    vpreds = torch.tensor([[0.05, 0.5, 0.5, -0.5]])  # inside the 0.1 range, then outside on both sides
    returns = torch.tensor([[1.0, 1.0, 0.0, -1.0]])
    # clipped preds 0.05, 0.1, 0.1, -0.1: binds where the clipped pred is further from the return (index 1, 3)
    loss, stats = ppo.value_loss(vpreds, old_values, returns, torch.ones(1, 4), cliprange_value=0.1)
    assert stats["val/clipfrac"].item() == pytest.approx(0.5)
    assert loss.item() == pytest.approx(0.5 * (0.95**2 + 0.9**2 + 0.5**2 + 0.9**2) / 4)


def test_ratio_threshold_skips_the_minibatch() -> None:
    mask = torch.ones(2, 3)
    zeros = torch.zeros(2, 3)

    def loss_at(ratio: float) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        new = torch.full((2, 3), math.log(ratio), requires_grad=True)
        old = ppo.Experience(zeros, zeros, zeros, torch.ones(2, 3), torch.ones(2, 3), mask)
        cfg = SimpleNamespace(cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, ratio_threshold=10.0, kl_loss_coef=0.0)
        loss, stats = ppo.ppo_loss(new, zeros, old, cfg)
        loss.backward()
        return loss, stats, new.grad

    loss, stats, grad = loss_at(20.0)
    assert stats["policy/skipped"].item() == 1.0 and loss.item() == 0.0 and (grad == 0).all()
    assert stats["loss/policy"].item() == pytest.approx(-1.2)  # still reported
    loss, stats, grad = loss_at(0.5)  # below the threshold: a normal step
    assert stats["policy/skipped"].item() == 0.0 and loss.item() != 0.0 and (grad != 0).any()
    assert not any(s.requires_grad for s in stats.values())


# --- score shaping ---------------------------------------------------------------------------------------------------


def test_running_moments_match_numpy_over_the_concatenated_batches() -> None:
    g = torch.Generator().manual_seed(4)
    batches = [torch.randn(n, generator=g, dtype=torch.float64) * 3 + 1 for n in (5, 9, 1, 4)]
    moments = ppo.RunningMoments()
    for k, batch in enumerate(batches, 1):
        moments.update(batch)
        seen = torch.cat(batches[:k]).numpy()
        assert moments.mean == pytest.approx(seen.mean())
        assert moments.std == pytest.approx(seen.std(ddof=1))
    restored = ppo.RunningMoments()
    restored.load_state_dict(moments.state_dict())
    assert (restored.mean, restored.std) == (moments.mean, moments.std)


@pytest.mark.parametrize("use_score_norm", [False, True])
def test_score_scaling_uses_the_running_moments_of_every_batch_so_far(use_score_norm: bool) -> None:
    g = torch.Generator().manual_seed(7)
    batches = [torch.randn(6, generator=g) * 2 + 3 for _ in range(3)]
    moments = ppo.RunningMoments()
    for k, scores in enumerate(batches, 1):
        scaled = ppo.scale_scores(scores, moments, True, use_score_norm, None)
        seen = torch.cat(batches[:k]).double().numpy()
        centre = seen.mean() if use_score_norm else 0.0
        assert scaled.tolist() == pytest.approx(((scores.numpy() - centre) / seen.std(ddof=1)).tolist(), rel=1e-5)


def test_score_clip_and_no_scaling() -> None:
    scores = torch.tensor([-4.0, 0.5, 4.0])
    moments = ppo.RunningMoments()
    assert ppo.scale_scores(scores, moments, False, False, 1.0).tolist() == [-1.0, 0.5, 1.0]
    assert ppo.scale_scores(scores, moments, False, False, None).tolist() == [-4.0, 0.5, 4.0]
    assert moments.state_dict() == ppo.RunningMoments().state_dict()  # scaling off: the moments are not updated
    # scaling first, then the clip: scores / std = [-1.0, 0.12, 1.0] -> clipped at 0.5
    clipped = ppo.scale_scores(scores, ppo.RunningMoments(), True, False, 0.5)
    std = float(np.std([-4.0, 0.5, 4.0], ddof=1))
    assert clipped.tolist() == pytest.approx([-0.5, 0.5 / std, 0.5])


def test_missing_eos_penalty() -> None:
    scores = torch.tensor([1.0, 2.0, 3.0])
    has_eos = torch.tensor([True, False, True])
    assert ppo.apply_missing_eos_penalty(scores, has_eos, 1.5).tolist() == [1.0, 0.5, 3.0]
    assert ppo.apply_missing_eos_penalty(scores, has_eos, None).tolist() == [1.0, 2.0, 3.0]
