"""Advantage estimators as pure tensor functions, one ``<name>_advantages`` per ``ppo.advantage_estimator``: GAE over
a critic's values, and the critic-free RLOO, GRPO, Dr. GRPO, conditional DPG and REINFORCE++; and ``ADVANTAGES``, each
estimator's call from the trainer's tensors (``ESTIMATORS[name].advantages``; the records, which the params read
without loading torch: rlhf/rl/estimators.py).
Adding an estimator: its function and its ``ADVANTAGES`` entry here, its record in estimators.py, its test.

Tensors are (B, T) over response positions with a positive ``mask`` (1 = real token); no I/O, only torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from rlhf.rl.ppo import masked_var, masked_whiten, require_real_tokens

# ---------------------------------------------------------------------------------------------------------------------
# advantages


def gae_advantages(values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float,
                       whiten_rewards: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the response positions -> (advantages whitened over the mask, returns = advantages + values).

    (B, T) in, (B, T) out, zero off the mask. A masked position ends the episode: both the next value and the
    running GAE sum are 0 there, so padding (whatever it holds, on either side) never reaches a real token and
    each row gets exactly the advantages of its unpadded episode (before the batch whitening).
    """
    mask = mask.to(values.dtype)
    values, rewards = values * mask, rewards * mask
    if whiten_rewards:
        # re-masked, unlike TRL 0.11: whitening without the shift leaves the mean on padding, which it then feeds
        # into the last real token of every right-padded row
        rewards = masked_whiten(rewards, mask, shift_mean=False) * mask
    T = rewards.shape[-1]
    lastgaelam = torch.zeros_like(rewards[:, 0])
    advantages_reversed = []
    for t in reversed(range(T)):
        nextvalues = values[:, t + 1] if t < T - 1 else torch.zeros_like(lastgaelam)
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = (delta + gamma * lam * lastgaelam) * mask[:, t]
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    return masked_whiten(advantages, mask) * mask, returns


# ---------------------------------------------------------------------------------------------------------------------
# critic-free advantages
#
# RLOO and GRPO compare the k responses sampled for the same prompt. A batch of B = n_prompts * k samples holds each
# prompt's k samples contiguously (sample index = prompt * k + j), so a (B,) tensor's groups are ``x.view(-1, k)``.
# They score the whole response as one action: the advantage of sample i is one number, put on each of its real
# tokens. Neither paper whitens these advantages over the batch, and neither do we.


def group_view(x: torch.Tensor, k: int) -> torch.Tensor:
    """(B,) per-sample values -> (B // k, k): one row per prompt, holding its k samples in order."""
    if k < 1:
        raise ValueError(f"group_view: k = {k} samples per prompt; it must be >= 1")
    if x.shape[0] % k:
        raise ValueError(f"group_view: a batch of {x.shape[0]} samples is not a multiple of k = {k} samples per "
                         "prompt")
    return x.view(-1, k)


def _groups(sequence_rewards: torch.Tensor, mask: torch.Tensor, k: int, caller: str) -> torch.Tensor:
    """The checks RLOO and GRPO share -> their rewards as (n_prompts, k) groups."""
    if k < 2:
        raise ValueError(f"{caller}: k = {k} samples per prompt; a baseline from the other samples of a prompt "
                         "needs k >= 2")
    require_real_tokens(mask, caller)
    return group_view(sequence_rewards, k)


def _on_real_tokens(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(n_prompts, k) -> (B, T): each sample's value on each of its real tokens, 0 on padding."""
    return per_sample.reshape(-1, 1) * mask.to(per_sample.dtype)


def rloo_advantages(sequence_rewards: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740): the baseline of sample i
    is the mean reward of the other k - 1 samples of its prompt,

        A_i = R_i - 1/(k-1) sum_{j != i} R_j    (= k/(k-1) (R_i - mean_j R_j)),

    on every real token of sample i, 0 on padding; (B,) ``sequence_rewards``, (B, T) ``mask`` -> (B, T) advantages.
    R_i is the whole sequence's reward; here the score plus the summed per-token KL penalty (``rewards.sum(1)`` of
    compute_rewards), so the KL penalty stays in the reward, as the paper's R(x, y) - beta log(pi / pi_ref) does
    (and TRL's RLOOTrainer; OpenRLHF instead subtracts the baseline from the score alone and keeps the KL penalty per
    token). Samples grouped as in group_view; k >= 2.
    """
    R = _groups(sequence_rewards, mask, k, "rloo_advantages")
    baseline = (R.sum(1, keepdim=True) - R) / (k - 1)
    return _on_real_tokens(R - baseline, mask)


def grpo_advantages(sequence_rewards: torch.Tensor, mask: torch.Tensor, k: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO with outcome supervision (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300, section 4.1.2): each reward
    normalised within its prompt's group of k samples,

        A_i = (r_i - mean_group(r)) / (std_group(r) + eps),

    on every real token of sample i, 0 on padding; (B,) ``sequence_rewards``, (B, T) ``mask`` -> (B, T) advantages.
    The paper names neither the std nor an eps; like TRL's GRPOTrainer, std is the unbiased (Bessel-corrected) one
    and eps = 1e-4 is added to it, so a group whose k rewards are all equal gets advantages 0, not 0/0. Samples
    grouped as in group_view; k >= 2. The paper's KL regulariser is a loss term, not part of r: see ``kl_loss``.
    """
    r = _groups(sequence_rewards, mask, k, "grpo_advantages")
    return _on_real_tokens((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps), mask)


def dr_grpo_advantages(sequence_rewards: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """Dr. GRPO ("GRPO done right", Liu et al. 2025, arXiv:2503.20783, section 3.1): GRPO's advantage without the
    division by the group's std, which weights prompts whose k rewards barely differ (too easy or too hard) the most,

        A_i = r_i - mean_group(r),

    on every real token of sample i, 0 on padding; (B,) ``sequence_rewards``, (B, T) ``mask`` -> (B, T) advantages.
    The paper's other change, no 1/|o_i| per response in the loss, is already how every estimator's loss is taken here
    (policy_loss: one token mean over the whole mini-batch). Samples grouped as in group_view; k >= 2.
    """
    r = _groups(sequence_rewards, mask, k, "dr_grpo_advantages")
    return _on_real_tokens(r - r.mean(1, keepdim=True), mask)


def dpg_advantages(sequence_rewards: torch.Tensor, mask: torch.Tensor, k: int, kl_coef: float) -> torch.Tensor:
    """Conditional distributional policy gradient toward the KL-regularised optimum pi_beta(y|x) ∝ pi_ref(y|x)
    exp(r(x, y) / beta) (Korbak et al. 2022, "Controlling conditional language models without catastrophic
    forgetting", ICML, arXiv:2112.00791; Go et al. 2023, f-DPG with the forward KL): the gradient of
    -KL(pi_beta || pi), E_pi[pi_beta(y) / pi(y) grad log pi(y)], with the importance weights self-normalised over the
    k samples of each prompt (which estimates its partition function Z(x)) and the mean subtracted as a baseline,

        w_i = softmax_i(R_i / beta) over i's group,   A_i = k w_i - 1,

    on every real token of sample i, 0 on padding; (B,) ``sequence_rewards``, (B, T) ``mask`` -> (B, T) advantages.
    With R_i = r_i - beta sum_t log pi / pi_ref (the score plus the summed k1 KL penalty at ``kl_coef`` = beta, as
    compute_rewards gives it under ppo.kl_penalty kl; the other KL estimates would bias the weights), R_i / beta =
    log(pi_ref(y_i) exp(r_i / beta) / pi(y_i)): the log-weight of y_i. At pi = pi_beta every R_i of a prompt is
    equal, so the advantages are exactly 0 there. The advantages lie in [-1, k - 1] and sum to 0 over a group
    whatever the rewards' scale. Samples grouped as in group_view; k >= 2.
    """
    if kl_coef <= 0:
        raise ValueError(f"dpg_advantages: kl_coef = {kl_coef}; the weights exp(R / kl_coef) need kl_coef > 0")
    R = _groups(sequence_rewards, mask, k, "dpg_advantages")
    return _on_real_tokens(k * torch.softmax(R / kl_coef, dim=1) - 1, mask)


def reinforce_pp_advantages(rewards: torch.Tensor, mask: torch.Tensor,
                            gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262), the paper's plain version: per-token ``rewards`` (the score on the
    last real token and the token-level KL penalty on each, as compute_rewards gives them) -> the discounted returns
    over each row's real tokens

        G_t = sum_{s >= t} gamma^(s-t) r_s,

    and advantages = G whitened over every real token of the whole batch (masked_whiten: the unbiased variance;
    OpenRLHF's biased one differs by n / (n - 1) over n real tokens: negligible at a batch's). Returns (advantages,
    returns), each (B, T) and zero off the mask. No critic and no group baseline: the prompts' groups play no part,
    whatever k (OpenRLHF's "REINFORCE++-baseline" would first subtract each group's mean score; not done here).

    This is GAE with V = 0 and lambda = 1 (delta_t = r_t, so A_t = G_t), hence the call.
    """
    require_real_tokens(mask, "reinforce_pp_advantages")
    return gae_advantages(torch.zeros_like(rewards), rewards, mask, gamma, lam=1.0)


def reward_scale(estimator: str, rewards: torch.Tensor, mask: torch.Tensor, values: torch.Tensor | None,
                 returns: torch.Tensor | None, whiten_rewards: bool) -> torch.Tensor:
    """The factor by which ``estimator``'s advantages scale the (B, T) per-token ``rewards`` they come from (0-dim):
    a term added to the loss in reward units, times it, weighs against the policy loss as it would in the reward.
    GAE whitens its advantages over the batch (and with ``whiten_rewards`` its rewards first): 1 / their stds, read
    from its raw advantages, returns - values; REINFORCE++ whitens its returns: 1 / their std; RLOO and Dr. GRPO keep
    the rewards' units: 1. GRPO (a std per group) and DPG (weights) have no one factor: a ValueError."""
    mask = mask.to(rewards.dtype)
    if estimator in ("rloo", "dr_grpo"):
        return torch.ones((), device=rewards.device)
    if estimator == "reinforce_pp":
        return torch.rsqrt(masked_var(returns, mask) + 1e-8)
    if estimator == "gae":
        scale = torch.rsqrt(masked_var(returns - values * mask, mask) + 1e-8)
        return scale * torch.rsqrt(masked_var(rewards, mask) + 1e-8) if whiten_rewards else scale
    raise ValueError(f"reward_scale: {estimator}'s advantages scale each group or sample by its own factor")


# ---------------------------------------------------------------------------------------------------------------------
# the calls


class AdvantageSettings(Protocol):
    """The ppo params an estimator reads (the ppo section satisfies it)."""

    samples_per_prompt: int
    gamma: float
    lam: float
    whiten_rewards: bool


Advantages = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, AdvantageSettings, float],
                      tuple[torch.Tensor, torch.Tensor | None]]
"""(per-token rewards (B, T) as ``compute_rewards`` gives them, masks, values or None, settings, the KL coefficient
those rewards were made with) -> (advantages, returns or None); the estimators that score a whole response take its
summed reward, ``rewards.sum(1)``."""

ADVANTAGES: dict[str, Advantages] = {
    "gae": lambda rewards, masks, values, cfg, kl_coef: gae_advantages(values, rewards, masks, cfg.gamma, cfg.lam,
                                                                       cfg.whiten_rewards),
    "rloo": lambda rewards, masks, values, cfg, kl_coef: (
        rloo_advantages(rewards.sum(1), masks, cfg.samples_per_prompt), None),
    "grpo": lambda rewards, masks, values, cfg, kl_coef: (
        grpo_advantages(rewards.sum(1), masks, cfg.samples_per_prompt), None),
    "dr_grpo": lambda rewards, masks, values, cfg, kl_coef: (
        dr_grpo_advantages(rewards.sum(1), masks, cfg.samples_per_prompt), None),
    "dpg": lambda rewards, masks, values, cfg, kl_coef: (
        dpg_advantages(rewards.sum(1), masks, cfg.samples_per_prompt, kl_coef), None),
    "reinforce_pp": lambda rewards, masks, values, cfg, kl_coef: reinforce_pp_advantages(rewards, masks, cfg.gamma),
}
