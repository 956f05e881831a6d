"""PPO for language models, as pure tensor functions: no I/O, no models, only torch.

Shapes: B sequences, T response positions, V vocabulary. Per-token tensors are (B, T) and come with a ``mask`` of the
same shape (bool or float) that is 1 on real response tokens and 0 on padding; each row's real tokens are one
contiguous run of any length >= 1, padded on the left or the right. The formulas follow TRL 0.11's PPOTrainer
(Ziegler et al. 2019's recipe) unless a comment says otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages.core.logprobs import in_chunks, upcast

# ---------------------------------------------------------------------------------------------------------------------
# masked statistics


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the positions where ``mask`` is 1 (over ``dim``, or everything)."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum()
    return (x * mask).sum(dim) / mask.sum(dim)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``x`` over the masked positions; ``unbiased`` applies Bessel's correction n / (n - 1)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        n = mask.sum()
        if n < 2:
            raise ValueError(f"masked_var: an unbiased variance needs at least two unmasked values, got {int(n)}")
        var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / std over the masked positions; with ``shift_mean=False`` the mean is added back (scale only)."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def require_real_tokens(mask: torch.Tensor, caller: str, why: str = "") -> None:
    """A ValueError from ``caller`` naming the rows of the (B, T) ``mask`` that have no real token."""
    empty = (~mask.bool().any(-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"{caller}: rows {empty} have no real response token{why}")


def first_true_indices(bools: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B,) index of the first nonzero in each row, T where a row has none."""
    T = bools.shape[-1]
    positions = torch.arange(T, device=bools.device).expand(bools.shape)
    return torch.where(bools.bool(), positions, T).min(-1).values


def last_true_indices(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B,) index of the last nonzero in each row, -1 where a row has none."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand(mask.shape)
    return torch.where(mask.bool(), positions, -1).max(-1).values


# ---------------------------------------------------------------------------------------------------------------------
# KL


def _chunk_full_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    logp, ref_logp = F.log_softmax(upcast(logits), -1), F.log_softmax(upcast(ref_logits), -1)  # (b, T, V)
    return (logp.exp() * (logp - ref_logp)).sum(-1)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mode: str = "kl",
               logits: torch.Tensor | None = None, ref_logits: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) per-token estimate of KL(pi || pi_ref) at the sampled tokens.

    kl:  log pi - log pi_ref (k1: unbiased, can be negative per token)
    abs: |k1|;  mse: 0.5 k1^2 (k2)
    k3:  (r - 1) - log r with r = pi_ref / pi (unbiased and non-negative; http://joschu.net/blog/kl-approx.html)
    full: the exact KL over the vocabulary at each position; needs (B, T, V) ``logits`` and ``ref_logits``.
    """
    log_ratio = logprobs - ref_logprobs
    if mode == "kl":
        return log_ratio
    if mode == "abs":
        return log_ratio.abs()
    if mode == "mse":
        return 0.5 * log_ratio.square()
    if mode == "k3":
        return torch.expm1(-log_ratio) + log_ratio  # expm1 keeps the digits exp(r) - 1 loses near r = 0
    if mode == "full":
        if logits is None or ref_logits is None:
            raise ValueError("kl_penalty: mode 'full' needs logits and ref_logits")
        return in_chunks(_chunk_full_kl, logits, ref_logits)
    raise ValueError(f"kl_penalty: unknown mode {mode!r} (expected kl, abs, mse, k3 or full)")


def compute_rewards(scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor,
                    kl_coef: float, kl_mode: str = "kl", logits: torch.Tensor | None = None,
                    ref_logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token rewards: -kl_coef * KL on every real token, plus the sequence's (B,) score on its last real token.

    Returns (rewards, non_score_reward, kl), each (B, T) and zero off the mask.
    """
    require_real_tokens(mask, "compute_rewards", " to carry their score")
    last = last_true_indices(mask)
    mask = mask.to(logprobs.dtype)
    kl = kl_penalty(logprobs, ref_logprobs, kl_mode, logits, ref_logits) * mask
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    rewards[torch.arange(len(scores), device=scores.device), last] += scores.to(rewards.dtype)
    return rewards, non_score_reward, kl


# ---------------------------------------------------------------------------------------------------------------------
# KL controllers


class FixedKLController:
    """A constant kl_coef; also the state (``value``) that the adaptive controller moves."""

    def __init__(self, kl_coef: float) -> None:
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Nothing to adapt."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = state["value"]


class AdaptiveKLController(FixedKLController):
    """Ziegler et al. 2019: move kl_coef so the observed KL tracks ``target``, by <= 20% per ``horizon`` samples."""

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        super().__init__(init_kl_coef)
        self.target, self.horizon = target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """``current_kl``: mean sequence KL of the batch just trained on; ``n_steps``: its number of samples."""
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


# ---------------------------------------------------------------------------------------------------------------------
# advantages


def compute_advantages(values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float,
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
    return compute_advantages(torch.zeros_like(rewards), rewards, mask, gamma, lam=1.0)


def estimate_advantages(estimator: str, rewards: torch.Tensor, mask: torch.Tensor, values: torch.Tensor | None,
                        k: int, gamma: float, lam: float,
                        whiten_rewards: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ppo.advantage_estimator's (advantages, returns) from compute_rewards' per-token ``rewards`` (B, T).

    gae: compute_advantages (needs the critic's ``values``); reinforce_pp: reinforce_pp_advantages (returns, no
    critic); rloo, grpo: their advantages from each sample's summed reward, the B = n_prompts * k samples grouped as
    in group_view, and no returns (None).
    """
    if estimator == "gae":
        return compute_advantages(values, rewards, mask, gamma, lam, whiten_rewards)
    if estimator == "reinforce_pp":
        return reinforce_pp_advantages(rewards, mask, gamma)
    if estimator == "rloo":
        return rloo_advantages(rewards.sum(1), mask, k), None
    if estimator == "grpo":
        return grpo_advantages(rewards.sum(1), mask, k), None
    raise ValueError(f"estimate_advantages: unknown estimator {estimator!r} (expected gae, rloo, grpo or "
                     "reinforce_pp)")


# ---------------------------------------------------------------------------------------------------------------------
# losses


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                cliprange: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate objective (Schulman et al. 2017) as a loss to minimise; (B, T) in, scalar loss out."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.maximum(pg_losses, pg_losses2), mask)
    log_ratio, ratio = log_ratio.detach(), ratio.detach()  # the stats are diagnostics: no graph behind them
    stats = {
        "policy/clipfrac": masked_mean((pg_losses2 > pg_losses).float(), mask),
        "policy/approxkl": 0.5 * masked_mean(log_ratio.square(), mask),
        "policy/policykl": masked_mean(-log_ratio, mask),
        "val/ratio": masked_mean(ratio, mask),
        "val/ratio_max": ratio.masked_fill(~mask.bool(), float("-inf")).max(),
    }
    return loss, stats


def value_loss(vpreds: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: 0.5 * masked mean of max((v - R)^2, (clip(v, v_old +- c) - R)^2); scalar out."""
    vpredclipped = torch.clamp(vpreds, old_values - cliprange_value, old_values + cliprange_value)
    vf_losses1 = (vpreds - returns).square()
    vf_losses2 = (vpredclipped - returns).square()
    loss = 0.5 * masked_mean(torch.maximum(vf_losses1, vf_losses2), mask)
    return loss, {"val/clipfrac": masked_mean((vf_losses2 > vf_losses1).float(), mask)}


def ppo_loss(logprobs: torch.Tensor, values: torch.Tensor | None, old_logprobs: torch.Tensor,
             old_values: torch.Tensor | None, advantages: torch.Tensor, returns: torch.Tensor | None,
             mask: torch.Tensor, cliprange: float, cliprange_value: float, vf_coef: float, ratio_threshold: float,
             ref_logprobs: torch.Tensor | None = None,
             kl_loss_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """pg_loss + vf_coef * vf_loss + kl_loss_coef * KL; multiplied by 0 (the minibatch skipped) when the mean ratio >
    ratio_threshold.

    ``values`` None (a critic-free estimator): no value loss and no value stats. ``kl_loss_coef`` > 0 adds GRPO's KL
    term (``kl_loss``; needs ``ref_logprobs``), its unweighted value logged as ``loss/kl``. Stats are detached 0-dim
    tensors; ``loss/policy``, ``loss/value`` and ``loss/kl`` keep their values when the loss is skipped.
    """
    pg_loss, pg_stats = policy_loss(logprobs, old_logprobs, advantages, mask, cliprange)
    loss, stats = pg_loss, {"loss/policy": pg_loss.detach()}
    if values is not None:
        vf_loss, vf_stats = value_loss(values, old_values, returns, mask, cliprange_value)
        loss = loss + vf_coef * vf_loss
        stats |= {"loss/value": vf_loss.detach(), **vf_stats}
    if kl_loss_coef > 0:
        kl = kl_loss(logprobs, ref_logprobs, mask, 1.0)
        loss = loss + kl_loss_coef * kl
        stats["loss/kl"] = kl.detach()
    skipped = pg_stats["val/ratio"] > ratio_threshold
    # multiplying by 0 (not returning a constant) keeps the graph for backward(); a tensor flag avoids a host sync
    loss = loss * (~skipped).to(pg_loss.dtype)
    return loss, stats | {"loss/total": loss.detach(), "policy/skipped": skipped.float(), **pg_stats}


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor,
            kl_loss_coef: float) -> torch.Tensor:
    """GRPO's KL regulariser as a loss term to add (Shao et al. 2024, eq. 4): kl_loss_coef times the masked mean of
    the per-token k3 estimate of KL(pi || pi_ref),

        pi_ref / pi - log(pi_ref / pi) - 1    (unbiased, >= 0),

    with pi the policy being trained (``logprobs``, differentiable) and pi_ref the reference; (B, T) in, scalar out.
    The paper averages over each response's tokens, then over responses; this averages over every real token of the
    batch, as policy_loss does, so that kl_loss_coef weighs the two terms alike.
    """
    return kl_loss_coef * masked_mean(kl_penalty(logprobs, ref_logprobs, "k3"), mask)


# ---------------------------------------------------------------------------------------------------------------------
# score shaping


class RunningMoments:
    """Running mean and std of all scores seen so far (Chan et al.'s parallel update), for score scaling."""

    def __init__(self) -> None:
        self.mean, self.var, self.count = 0.0, 1.0, 1e-24  # var: population variance of everything seen

    def update(self, x: torch.Tensor) -> None:
        """Fold in a batch of scores (any shape)."""
        x = x.detach().double()
        batch_mean, batch_var, batch_count = x.mean().item(), x.var(unbiased=False).item(), x.numel()
        delta, total = batch_mean - self.mean, self.count + batch_count
        m2 = self.var * self.count + batch_var * batch_count + delta**2 * self.count * batch_count / total
        self.mean += delta * batch_count / total
        self.var, self.count = m2 / total, total

    @property
    def std(self) -> float:
        """Unbiased (ddof=1) std, as TRL's."""
        return (self.var * self.count / max(self.count - 1, 1)) ** 0.5

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]


def scale_scores(scores: torch.Tensor, moments: RunningMoments, use_score_scaling: bool, use_score_norm: bool,
                 score_clip: float | None) -> torch.Tensor:
    """TRL 0.11's optional score shaping of (B,) scores: update the running moments with this batch, divide by their
    std (first subtracting their mean with ``use_score_norm``), then clip to [-score_clip, score_clip]."""
    if use_score_scaling:
        moments.update(scores)
        centre = moments.mean if use_score_norm else 0.0
        scores = (scores - centre) / (moments.std + torch.finfo(scores.dtype).eps)
    if score_clip is not None:
        scores = scores.clamp(-score_clip, score_clip)
    return scores


def apply_missing_eos_penalty(scores: torch.Tensor, has_eos: torch.Tensor, penalty: float | None) -> torch.Tensor:
    """Subtract ``penalty`` from the (B,) score of every response that never emitted EOS (None: off)."""
    if penalty is None:
        return scores
    return torch.where(has_eos, scores, scores - penalty)
