"""The critic-free estimators (RLOO, GRPO, Dr. GRPO, conditional DPG, REINFORCE++) and GRPO's KL loss against slow
references written straight from their papers' formulas, on ragged batches of k samples per prompt."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rlhf.rl import advantages as adv
from rlhf.rl import ppo
from rlhf.rl.estimators import ESTIMATORS

N_PROMPTS, T = 3, 6
GARBAGE = 1e6  # what padded positions hold: it must never reach a real token


def ragged_mask(k: int, side: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """(N_PROMPTS * k, T) mask, rows of random lengths 1..T (one of length 1, one full), padded on ``side``
    (``mixed``: even rows on the left, odd rows on the right)."""
    B = N_PROMPTS * k
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g).tolist()
    lengths[seed % B], lengths[(seed + 1) % B] = 1, T
    mask = torch.zeros(B, T, dtype=dtype)
    for i, n in enumerate(lengths):
        if side == "left" or (side == "mixed" and i % 2 == 0):
            mask[i, T - n:] = 1
        else:
            mask[i, :n] = 1
    return mask


def real_positions(mask: torch.Tensor, i: int) -> list[int]:
    return [t for t in range(mask.shape[1]) if mask[i, t]]


CASES = [(k, side, dtype) for k in (2, 3, 4) for side in ("left", "right", "mixed") for dtype in (torch.bool,
                                                                                                   torch.float32)]


@pytest.fixture(params=CASES, ids=[f"k{k}-{side}-{str(dtype)[6:]}" for k, side, dtype in CASES])
def batch(request: pytest.FixtureRequest) -> tuple[int, torch.Tensor, torch.Generator]:
    k, side, dtype = request.param
    seed = 10 * k + len(side)
    return k, ragged_mask(k, side, dtype, seed), torch.Generator().manual_seed(seed)


def assert_per_sample_on_real_tokens(got: torch.Tensor, mask: torch.Tensor, expected: list[float]) -> None:
    """Sample i's expected advantage on each of its real tokens, exactly 0 on padding."""
    for i in range(got.shape[0]):
        real = real_positions(mask, i)
        for t in range(got.shape[1]):
            if t in real:
                assert got[i, t].item() == pytest.approx(expected[i], rel=1e-12, abs=1e-12)
            else:
                assert got[i, t].item() == 0.0


# --- RLOO ------------------------------------------------------------------------------------------------------------


def rloo_reference(R: list[float], k: int) -> list[float]:
    """Ahmadian et al. 2024: A_i = R_i - 1/(k-1) sum_{j != i} R_j, j over the samples of i's prompt."""
    advantages = []
    for prompt in range(len(R) // k):
        group = R[prompt * k: (prompt + 1) * k]
        for j in range(k):
            others = [group[jj] for jj in range(k) if jj != j]
            advantages.append(group[j] - sum(others) / (k - 1))
    return advantages


def test_rloo_matches_the_paper(batch) -> None:
    k, mask, g = batch
    R = torch.randn(len(mask), generator=g, dtype=torch.float64) * 3
    got = adv.rloo_advantages(R, mask, k)
    assert got.dtype == torch.float64 and got.shape == mask.shape
    assert_per_sample_on_real_tokens(got, mask, rloo_reference(R.tolist(), k))


def test_rloo_advantages_of_a_group_sum_to_zero_and_ignore_a_shift_of_the_group(batch) -> None:
    k, mask, g = batch
    R = torch.randn(len(mask), generator=g, dtype=torch.float64)
    per_sample = adv.group_view(adv.rloo_advantages(R, mask, k).sum(1) / mask.sum(1), k)
    torch.testing.assert_close(per_sample.sum(1), torch.zeros(N_PROMPTS, dtype=torch.float64))
    # the equivalent form k/(k-1) (R_i - mean of the group)
    groups = adv.group_view(R, k)
    torch.testing.assert_close(per_sample, k / (k - 1) * (groups - groups.mean(1, keepdim=True)))
    shifted = R + torch.arange(N_PROMPTS, dtype=torch.float64).repeat_interleave(k) * 100
    torch.testing.assert_close(adv.rloo_advantages(shifted, mask, k), adv.rloo_advantages(R, mask, k))


# --- GRPO ------------------------------------------------------------------------------------------------------------


def grpo_reference(r: list[float], k: int, eps: float) -> list[float]:
    """Shao et al. 2024: A_i = (r_i - mean(r)) / (std(r) + eps) over i's group; std with Bessel's correction."""
    advantages = []
    for prompt in range(len(r) // k):
        group = r[prompt * k: (prompt + 1) * k]
        mean = sum(group) / k
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (k - 1))
        advantages += [(x - mean) / (std + eps) for x in group]
    return advantages


@pytest.mark.parametrize("eps", [1e-4, 0.5])
def test_grpo_matches_the_paper(batch, eps: float) -> None:
    k, mask, g = batch
    r = torch.randn(len(mask), generator=g, dtype=torch.float64) * 3
    got = adv.grpo_advantages(r, mask, k, eps)
    assert got.dtype == torch.float64 and got.shape == mask.shape
    assert_per_sample_on_real_tokens(got, mask, grpo_reference(r.tolist(), k, eps))


def test_grpo_defaults_to_trl_eps() -> None:
    r, mask = torch.tensor([0.0, 1.0, 3.0, 5.0], dtype=torch.float64), torch.ones(4, 1)
    torch.testing.assert_close(adv.grpo_advantages(r, mask, 2), adv.grpo_advantages(r, mask, 2, eps=1e-4))


def test_grpo_groups_have_mean_zero_unit_std_and_ignore_shift_and_scale(batch) -> None:
    k, mask, g = batch
    r = torch.randn(len(mask), generator=g, dtype=torch.float64) * 5
    per_sample = adv.group_view(adv.grpo_advantages(r, mask, k).sum(1) / mask.sum(1), k)
    torch.testing.assert_close(per_sample.mean(1), torch.zeros(N_PROMPTS, dtype=torch.float64))
    assert per_sample.std(1).tolist() == pytest.approx([1.0] * N_PROMPTS, abs=1e-3)  # eps keeps it a hair below 1
    transformed = r * 7 + torch.arange(N_PROMPTS, dtype=torch.float64).repeat_interleave(k) * 100
    torch.testing.assert_close(adv.grpo_advantages(transformed, mask, k, eps=0.0),
                               adv.grpo_advantages(r, mask, k, eps=0.0))


def test_grpo_group_of_equal_rewards_gets_zero_advantages() -> None:
    r = torch.tensor([2.0, 2.0, 2.0, 1.0, 0.0, 5.0])
    got = adv.grpo_advantages(r, torch.ones(6, 2), 3)
    assert (got[:3] == 0).all() and (got[3:] != 0).all() and torch.isfinite(got).all()


# --- Dr. GRPO --------------------------------------------------------------------------------------------------------


def dr_grpo_reference(r: list[float], k: int) -> list[float]:
    """Liu et al. 2025, section 3.1: A_i = R(q, o_i) - mean({R(q, o_1), ..., R(q, o_G)}), no std."""
    advantages = []
    for prompt in range(len(r) // k):
        group = r[prompt * k: (prompt + 1) * k]
        advantages += [x - sum(group) / k for x in group]
    return advantages


def test_dr_grpo_matches_the_paper_and_is_grpo_times_the_group_std(batch) -> None:
    k, mask, g = batch
    r = torch.randn(len(mask), generator=g, dtype=torch.float64) * 3
    got = adv.dr_grpo_advantages(r, mask, k)
    assert got.dtype == torch.float64 and got.shape == mask.shape
    assert_per_sample_on_real_tokens(got, mask, dr_grpo_reference(r.tolist(), k))
    std = adv.group_view(r, k).std(1).repeat_interleave(k).unsqueeze(1)
    torch.testing.assert_close(got, adv.grpo_advantages(r, mask, k, eps=0.0) * std)
    scaled = adv.dr_grpo_advantages(r * 7, mask, k)  # no std: the advantages keep the rewards' scale
    torch.testing.assert_close(scaled, 7 * got)


# --- conditional DPG -------------------------------------------------------------------------------------------------


def dpg_reference(scores: list[float], logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, k: int,
                  beta: float) -> list[float]:
    """Korbak et al. 2022 (CDPG): the target P(y|x) = pi_ref(y|x) exp(r(x, y) / beta), the proposal the policy pi
    itself; weights P(y_i|x) / pi(y_i|x) normalised over the prompt's k samples (Z(x) by importance sampling), minus
    their mean 1/k as the baseline, times k: A_i = k w_i - 1. Written from sequence log-probabilities and exp."""
    advantages = []
    for prompt in range(len(scores) // k):
        log_weights = []
        for i in range(prompt * k, (prompt + 1) * k):
            real = real_positions(mask, i)
            log_pi = sum(logprobs[i, t].item() for t in real)
            log_ref = sum(ref_logprobs[i, t].item() for t in real)
            log_weights.append(log_ref + scores[i] / beta - log_pi)  # log P(y_i|x) - log pi(y_i|x)
        top = max(log_weights)
        weights = [math.exp(x - top) for x in log_weights]
        advantages += [k * w / sum(weights) - 1 for w in weights]
    return advantages


def test_dpg_advantages_sum_to_zero_lie_in_range_and_vanish_at_the_optimum(batch) -> None:
    k, mask, g = batch
    R = torch.randn(len(mask), generator=g, dtype=torch.float64) * 3
    got = adv.dpg_advantages(R, mask, k, 0.5)
    per_sample = adv.group_view(got.sum(1) / mask.sum(1), k)
    torch.testing.assert_close(per_sample.sum(1), torch.zeros(N_PROMPTS, dtype=torch.float64))
    assert (per_sample >= -1).all() and (per_sample <= k - 1).all()
    shifted = R + torch.arange(N_PROMPTS, dtype=torch.float64).repeat_interleave(k) * 100  # Z(x) cancels
    torch.testing.assert_close(adv.dpg_advantages(shifted, mask, k, 0.5), got)
    # at pi = pi_beta, R = r - beta log(pi / pi_ref) = beta log Z(x) for every sample of a prompt
    at_optimum = torch.arange(N_PROMPTS, dtype=torch.float64).repeat_interleave(k)
    assert (adv.dpg_advantages(at_optimum, mask, k, 0.5) == 0).all()
    # a large coefficient flattens the weights: A_i -> (R_i - mean R) / beta, RLOO's (k - 1) / k
    big = 1e4
    torch.testing.assert_close(adv.dpg_advantages(R, mask, k, big) * big,
                               adv.rloo_advantages(R, mask, k) * (k - 1) / k, rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="dpg_advantages: kl_coef = 0.0; .* need kl_coef > 0"):
        adv.dpg_advantages(R, mask, k, 0.0)
    with pytest.raises(ValueError, match="dpg_advantages: k = 1 samples per prompt; .* needs k >= 2"):
        adv.dpg_advantages(R, mask, 1, 0.5)


@pytest.mark.parametrize("beta", [0.05, 1.0, 20.0])
def test_dpg_advantages_match_the_paper_at_any_kl_coef(batch, beta: float) -> None:
    """The pure function on R = score - beta * sum_t (log pi - log pi_ref), against the weights written from
    sequence log-probabilities; beta from nearly one-hot weights (0.05) to nearly uniform ones (20)."""
    k, mask, g = batch
    logprobs, ref_logprobs = (torch.randn(mask.shape, generator=g, dtype=torch.float64) for _ in range(2))
    scores = torch.randn(len(mask), generator=g, dtype=torch.float64)
    R = scores - beta * ((logprobs - ref_logprobs) * mask).sum(1)
    got = adv.dpg_advantages(R, mask, k, beta)
    assert got.dtype == torch.float64 and got.shape == mask.shape
    expected = dpg_reference(scores.tolist(), logprobs, ref_logprobs, mask, k, beta)
    for i in range(len(mask)):  # rel 1e-9: beta * sum(log ratio) and back lose a few of float64's digits
        real = real_positions(mask, i)
        assert got[i, real].tolist() == pytest.approx([expected[i]] * len(real), rel=1e-9, abs=1e-9)
        assert (got[i, [t for t in range(T) if t not in real]] == 0).all()


def test_dpg_equal_rewards_give_uniform_weights_and_a_dominant_sample_takes_all() -> None:
    mask = torch.ones(8, 3)
    R = torch.tensor([0.7, 0.7, 0.7, 0.7,  # equal: w = 1/k each, no sample pushed up or down
                      0.0, 1e4, -3.0, 2.0])  # one R far above: w -> (0, 1, 0, 0), A -> (-1, k - 1, -1, -1)
    got = adv.dpg_advantages(R, mask, 4, 0.1)
    assert torch.isfinite(got).all()  # exp(1e5) overflows: the softmax must not
    assert (got[:4] == 0).all()
    assert got[4:, 0].tolist() == [-1.0, 3.0, -1.0, -1.0]
    # a sample twice as likely under pi_beta / pi as each of the others: w = (2/5, 1/5, 1/5, 1/5), A = k w - 1
    R = torch.tensor([math.log(2.0), 0.0, 0.0, 0.0], dtype=torch.float64)
    assert adv.dpg_advantages(R, torch.ones(4, 1), 4, 1.0)[:, 0].tolist() == pytest.approx([0.6, -0.2, -0.2, -0.2])


# --- REINFORCE++ -----------------------------------------------------------------------------------------------------


def reinforce_pp_reference(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> tuple[list, list]:
    """Hu 2025: G_t = sum_{s >= t} gamma^(s-t) r_s over a row's real tokens; advantages = G whitened over all real
    tokens of the batch, as masked_whiten does (unbiased variance, + 1e-8). Per row: (returns, advantages)."""
    returns = []
    for i in range(rewards.shape[0]):
        r = [rewards[i, t].item() for t in real_positions(mask, i)]
        returns.append([sum(gamma ** (s - t) * r[s] for s in range(t, len(r))) for t in range(len(r))])
    flat = [x for row in returns for x in row]
    mean = sum(flat) / len(flat)
    var = sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)
    return returns, [[(x - mean) / math.sqrt(var + 1e-8) for x in row] for row in returns]


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_the_paper(batch, gamma: float) -> None:
    k, mask, g = batch
    rewards = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    rewards[~mask.bool()] = GARBAGE
    advantages, returns = adv.reinforce_pp_advantages(rewards, mask, gamma)
    expected_returns, expected_advantages = reinforce_pp_reference(rewards, mask, gamma)
    for i in range(len(mask)):
        real = real_positions(mask, i)
        assert returns[i, real].tolist() == pytest.approx(expected_returns[i], rel=1e-12, abs=1e-12)
        assert advantages[i, real].tolist() == pytest.approx(expected_advantages[i], rel=1e-10, abs=1e-10)
    padding = ~mask.bool()
    assert (advantages[padding] == 0).all() and (returns[padding] == 0).all()


def test_reinforce_pp_advantages_have_batch_mean_zero_and_unit_std(batch) -> None:
    k, mask, g = batch
    rewards = torch.randn(mask.shape, generator=g, dtype=torch.float64) * 4 + 2
    advantages, _ = adv.reinforce_pp_advantages(rewards, mask, 1.0)
    real = advantages[mask.bool()]
    assert real.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert real.std().item() == pytest.approx(1.0, abs=1e-6)


def test_reinforce_pp_return_of_the_first_token_is_score_plus_kl_penalty() -> None:
    """With gamma = 1 and compute_rewards' rewards, G at a row's first real token is its whole sequence reward."""
    g = torch.Generator().manual_seed(5)
    mask = ragged_mask(2, "mixed", torch.float32, 3)
    logprobs, ref_logprobs = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)
    scores = torch.randn(len(mask), generator=g)
    rewards, non_score_reward = ppo.compute_rewards(scores, ppo.kl_penalty(logprobs, ref_logprobs) * mask, mask,
                                                    kl_coef=0.2)
    _, returns = adv.reinforce_pp_advantages(rewards, mask, 1.0)
    first = mask.float().argmax(1)  # each row's first real token
    torch.testing.assert_close(returns[torch.arange(len(mask)), first], scores + non_score_reward.sum(1))


# --- errors ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", [adv.rloo_advantages, adv.grpo_advantages, adv.dr_grpo_advantages])
@pytest.mark.parametrize("k", [1, 0])
def test_group_estimators_need_two_samples_per_prompt(estimator, k: int) -> None:
    with pytest.raises(ValueError, match=rf"{estimator.__name__}: k = {k} samples per prompt; .* needs k >= 2"):
        estimator(torch.zeros(4), torch.ones(4, 3), k)


@pytest.mark.parametrize("estimator", [adv.rloo_advantages, adv.grpo_advantages, adv.dr_grpo_advantages])
def test_group_estimators_need_whole_groups(estimator) -> None:
    with pytest.raises(ValueError, match="group_view: a batch of 5 samples is not a multiple of k = 2 samples"):
        estimator(torch.zeros(5), torch.ones(5, 3), 2)


def test_group_view_layout_and_errors() -> None:
    x = torch.arange(6)
    assert adv.group_view(x, 3).tolist() == [[0, 1, 2], [3, 4, 5]]  # sample index = prompt * k + j
    assert adv.group_view(x, 1).tolist() == [[v] for v in range(6)]
    with pytest.raises(ValueError, match="group_view: k = 0 samples per prompt; it must be >= 1"):
        adv.group_view(x, 0)
    with pytest.raises(ValueError, match="group_view: a batch of 6 samples is not a multiple of k = 4"):
        adv.group_view(x, 4)


@pytest.mark.parametrize("name", ["rloo_advantages", "grpo_advantages", "reinforce_pp_advantages"])
def test_estimators_need_a_real_token_per_row(name: str) -> None:
    mask = torch.tensor([[1, 1], [0, 0], [0, 1], [0, 0]], dtype=torch.bool)
    call = {"rloo_advantages": lambda: adv.rloo_advantages(torch.zeros(4), mask, 2),
            "grpo_advantages": lambda: adv.grpo_advantages(torch.zeros(4), mask, 2),
            "reinforce_pp_advantages": lambda: adv.reinforce_pp_advantages(torch.zeros(4, 2), mask, 1.0)}[name]
    with pytest.raises(ValueError, match=rf"{name}: rows \[1, 3\] have no real response token"):
        call()


# --- GRPO's KL loss --------------------------------------------------------------------------------------------------


def test_kl_loss_is_the_k3_estimator_masked_mean_with_its_gradient(batch) -> None:
    k, mask, g = batch
    logprobs = (torch.randn(mask.shape, generator=g, dtype=torch.float64) - 1).requires_grad_()
    ref_logprobs = torch.randn(mask.shape, generator=g, dtype=torch.float64) - 1
    with torch.no_grad():
        logprobs[~mask.bool()] = -40.0  # k3 there is ~e^40: masked, it must count for nothing
    loss = ppo.kl_loss(logprobs, ref_logprobs, mask)
    loss.backward()
    total, n, grads = 0.0, 0, {}
    for i in range(len(mask)):
        for t in real_positions(mask, i):
            log_r = ref_logprobs[i, t].item() - logprobs[i, t].item()  # log(pi_ref / pi)
            total += math.exp(log_r) - log_r - 1  # Shao et al. 2024, eq. 4
            n += 1
            grads[i, t] = 1 - math.exp(log_r)  # d/d log pi of the term above
    assert loss.item() == pytest.approx(total / n, rel=1e-12)
    for i in range(len(mask)):
        for t in range(T):
            expected = grads[i, t] / n if (i, t) in grads else 0.0
            assert logprobs.grad[i, t].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_kl_loss_is_zero_at_the_reference_and_positive_elsewhere() -> None:
    g = torch.Generator().manual_seed(1)
    logprobs, mask = torch.randn(4, 5, generator=g), torch.ones(4, 5)
    assert ppo.kl_loss(logprobs, logprobs, mask).item() == 0.0
    assert ppo.kl_loss(logprobs, logprobs + 0.3 * torch.randn(4, 5, generator=g), mask).item() > 0


# --- the trainer's entry points: the records' functions and ppo_loss without a critic --------------------------------


def settings(k: int, gamma: float = 1.0, lam: float = 0.95, whiten_rewards: bool = False) -> SimpleNamespace:
    """The ppo params an estimator reads."""
    return SimpleNamespace(samples_per_prompt=k, gamma=gamma, lam=lam, whiten_rewards=whiten_rewards)


def loss_settings(kl_loss_coef: float = 0.0) -> SimpleNamespace:
    """The ppo params the loss reads."""
    return SimpleNamespace(cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, ratio_threshold=10.0,
                           kl_loss_coef=kl_loss_coef)


def test_each_record_follows_its_paper_from_compute_rewards_output(batch) -> None:
    """From per-token rewards (score on the last real token, -kl_coef * KL on each), each estimator's advantages
    match its paper's reference, with R = the whole sequence's reward."""
    k, mask, g = batch
    logprobs, ref_logprobs = (torch.randn(mask.shape, generator=g, dtype=torch.float64) for _ in range(2))
    scores = torch.randn(len(mask), generator=g, dtype=torch.float64)
    rewards, _ = ppo.compute_rewards(scores, ppo.kl_penalty(logprobs, ref_logprobs) * mask, mask, kl_coef=0.1)
    R = [sum(rewards[i, t].item() for t in real_positions(mask, i)) for i in range(len(mask))]

    advantages, returns = ESTIMATORS["rloo"].advantages(rewards, mask, None, settings(k, 1.0), 0.1)
    assert returns is None
    assert_per_sample_on_real_tokens(advantages, mask, rloo_reference(R, k))
    advantages, returns = ESTIMATORS["grpo"].advantages(rewards, mask, None, settings(k, 1.0), 0.1)
    assert returns is None
    assert_per_sample_on_real_tokens(advantages, mask, grpo_reference(R, k, 1e-4))
    advantages, returns = ESTIMATORS["dr_grpo"].advantages(rewards, mask, None, settings(k, 1.0), 0.1)
    assert returns is None
    assert_per_sample_on_real_tokens(advantages, mask, dr_grpo_reference(R, k))
    advantages, returns = ESTIMATORS["dpg"].advantages(rewards, mask, None, settings(k, 1.0), 0.1)
    assert returns is None
    assert_per_sample_on_real_tokens(advantages, mask, dpg_reference(scores.tolist(), logprobs, ref_logprobs, mask, k,
                                                                     0.1))
    advantages, returns = ESTIMATORS["reinforce_pp"].advantages(rewards, mask, None, settings(k, 0.9), 0.1)
    expected_returns, expected_advantages = reinforce_pp_reference(rewards, mask, 0.9)
    for i in range(len(mask)):
        real = real_positions(mask, i)
        assert returns[i, real].tolist() == pytest.approx(expected_returns[i], rel=1e-12, abs=1e-12)
        assert advantages[i, real].tolist() == pytest.approx(expected_advantages[i], rel=1e-10, abs=1e-10)


def test_the_gae_record_is_gae_advantages() -> None:
    g = torch.Generator().manual_seed(2)
    mask = ragged_mask(2, "mixed", torch.float32, 4)
    values, rewards = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g)
    got = ESTIMATORS["gae"].advantages(rewards, mask, values, settings(2, 0.9, 0.8, whiten_rewards=True), 0.1)
    expected = adv.gae_advantages(values, rewards, mask, 0.9, 0.8, whiten_rewards=True)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("kl_loss_coef", [0.0, 0.04])
def test_ppo_loss_without_a_critic_is_the_policy_loss_plus_the_kl_term(kl_loss_coef: float) -> None:
    g = torch.Generator().manual_seed(3)
    mask = ragged_mask(2, "right", torch.bool, 5)
    logprobs, old_logprobs, ref_logprobs, advantages = (torch.randn(mask.shape, generator=g) * 0.3
                                                        for _ in range(4))
    old = ppo.Experience(old_logprobs, ref_logprobs, None, advantages, None, mask)
    loss, stats = ppo.ppo_loss(logprobs, None, old, loss_settings(kl_loss_coef))
    pg_loss, _ = ppo.policy_loss(logprobs, old_logprobs, advantages, mask, 0.2)
    kl = ppo.kl_loss(logprobs, ref_logprobs, mask)
    assert loss.item() == pytest.approx(pg_loss.item() + kl_loss_coef * kl.item(), rel=1e-6)
    assert not any(key.startswith(("loss/value", "val/clipfrac")) for key in stats)
    assert ("loss/kl" in stats) == (kl_loss_coef > 0)
    if kl_loss_coef:
        assert stats["loss/kl"].item() == pytest.approx(kl.item(), rel=1e-6)  # unweighted, as loss/value is


def test_a_skipped_minibatch_skips_the_kl_term_too() -> None:
    mask = torch.ones(2, 3)
    logprobs = torch.full((2, 3), math.log(20.0), requires_grad=True)  # ratio 20 > ratio_threshold
    old = ppo.Experience(torch.zeros(2, 3), torch.zeros(2, 3), None, torch.ones(2, 3), None, mask)
    loss, stats = ppo.ppo_loss(logprobs, None, old, loss_settings(kl_loss_coef=1.0))
    loss.backward()
    assert stats["policy/skipped"].item() == 1.0 and loss.item() == 0.0 and (logprobs.grad == 0).all()
    assert stats["loss/kl"].item() > 0  # still reported


def test_every_estimator_has_one_record_and_one_function() -> None:
    assert list(adv.ADVANTAGES) == list(ESTIMATORS)


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_every_estimator_record_dispatches_to_its_function(name: str) -> None:
    """Each record's estimator runs through the dispatch; one that trains a critic uses its values, the others do not
    (their advantages are the same whatever the values)."""
    g = torch.Generator().manual_seed(4)
    mask = ragged_mask(4, "right", torch.float32, 5)
    rewards = torch.randn(mask.shape, generator=g)
    runs = [ESTIMATORS[name].advantages(rewards, mask, torch.randn(mask.shape, generator=g), settings(2), 0.1)[0]
            for _ in range(2)]
    assert torch.equal(runs[0], runs[1]) != ESTIMATORS[name].trains_critic
