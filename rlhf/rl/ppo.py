"""PPO for language models, as pure tensor functions: no I/O, no models, only torch.

Shapes: B sequences, T response positions, V vocabulary. Per-token tensors are (B, T) and come with a ``mask`` of the
same shape (bool or float) that is 1 on real response tokens and 0 on padding; each row's real tokens are one
contiguous run of any length >= 1, padded on the left or the right. The formulas follow TRL 0.11's PPOTrainer
(Ziegler et al. 2019's recipe) unless a comment says otherwise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

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


def last_true_indices(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B,) index of the last nonzero in each row, -1 where a row has none."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand(mask.shape)
    return torch.where(mask.bool(), positions, -1).max(-1).values


# ---------------------------------------------------------------------------------------------------------------------
# KL


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mode: str = "kl",
               full_kl: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) per-token estimate of KL(pi || pi_ref) at the sampled tokens.

    kl:  log pi - log pi_ref (k1: unbiased, can be negative per token)
    abs: |k1|;  mse: 0.5 k1^2 (k2)
    k3:  (r - 1) - log r with r = pi_ref / pi (unbiased and non-negative; http://joschu.net/blog/kl-approx.html)
    full, exact: the exact KL over the vocabulary at each position, ``full_kl`` (``logprobs.head_stats``' kl), as
    it is (exact differs in how the trainer uses it: ``next_position``, and the update's loss term).
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
    if mode in ("full", "exact"):
        if full_kl is None:
            raise ValueError(f"kl_penalty: mode {mode!r} needs full_kl")
        return full_kl
    raise ValueError(f"kl_penalty: unknown mode {mode!r} (expected kl, abs, mse, k3, full or exact)")


def next_position(kl: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) per-position KL -> each token's KL of the position after it (0 after a row's last real token): what
    sampling the token changes of the KL still to come, its reward under ppo.kl_penalty exact."""
    mask = mask.to(kl.dtype)
    return F.pad(kl[:, 1:] * mask[:, 1:], (0, 1)) * mask


def compute_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor,
                    kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards R(x, y) - kl_coef * KL (Ziegler et al. 2019): -kl_coef * ``kl`` on every token, plus the
    sequence's (B,) score on its last real token. ``kl``: ``kl_penalty``'s (B, T) estimate, zero off the mask.

    Returns (rewards, non_score_reward), each (B, T).
    """
    require_real_tokens(mask, "compute_rewards", " to carry their score")
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    rewards[torch.arange(len(scores), device=scores.device), last_true_indices(mask)] += scores.to(rewards.dtype)
    return rewards, non_score_reward


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


@dataclass
class Experience:
    """What the PPO update learns from, one row per sample, per-token tensors (B, T) over the response positions
    (OpenRLHF's Experience). ``experience[idx]`` is the mini-batch of rows ``idx``."""

    logprobs: torch.Tensor  # of the policy that sampled (the update's "old" policy)
    ref_logprobs: torch.Tensor
    values: torch.Tensor | None  # None without a critic
    advantages: torch.Tensor
    returns: torch.Tensor | None  # None for the estimators that score a whole response
    masks: torch.Tensor  # 1 on real response tokens
    ref_hidden: torch.Tensor | None = None  # (B, T, H), ppo.kl_penalty exact only: the reference's LM head input
    kl_weights: torch.Tensor | None = None  # (B,), exact only: the KL loss's weight, kl_coef in the advantages' units

    def __getitem__(self, idx: torch.Tensor) -> Experience:
        return Experience(**{field.name: None if (x := getattr(self, field.name)) is None else x[idx]
                             for field in dataclasses.fields(self)})


class LossSettings(Protocol):
    """The ppo params the loss reads (the ppo section satisfies it)."""

    cliprange: float
    cliprange_value: float
    vf_coef: float
    ratio_threshold: float
    kl_loss_coef: float


def ppo_loss(logprobs: torch.Tensor, values: torch.Tensor | None, old: Experience,
             cfg: LossSettings, kl: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """pg_loss + vf_coef * vf_loss + kl_loss_coef * KL of the policy's ``logprobs`` (and ``values``) on the samples of
    the mini-batch ``old``; multiplied by 0 (the mini-batch skipped) when the mean ratio > ratio_threshold.

    ``old.values`` None (a critic-free estimator): no value loss and no value stats. ``kl_loss_coef`` > 0 adds GRPO's
    KL term (``kl_loss``), its unweighted value logged as ``loss/kl``. ``kl``: the policy's exact per-position KL
    (``logprobs.head_stats``' kl, ppo.kl_penalty exact), added as the masked mean of ``old.kl_weights`` x kl, logged
    unweighted as ``loss/exact_kl``. Stats are detached 0-dim tensors; ``loss/policy``, ``loss/value`` and
    ``loss/kl`` keep their values when the loss is skipped.
    """
    pg_loss, pg_stats = policy_loss(logprobs, old.logprobs, old.advantages, old.masks, cfg.cliprange)
    loss, stats = pg_loss, {"loss/policy": pg_loss.detach()}
    if old.values is not None:
        vf_loss, vf_stats = value_loss(values, old.values, old.returns, old.masks, cfg.cliprange_value)
        loss = loss + cfg.vf_coef * vf_loss
        stats |= {"loss/value": vf_loss.detach(), **vf_stats}
    if cfg.kl_loss_coef > 0:
        k3 = kl_loss(logprobs, old.ref_logprobs, old.masks)
        loss = loss + cfg.kl_loss_coef * k3
        stats["loss/kl"] = k3.detach()
    if kl is not None:
        loss = loss + masked_mean(kl * old.kl_weights[:, None], old.masks)
        stats["loss/exact_kl"] = masked_mean(kl.detach(), old.masks)
    skipped = pg_stats["val/ratio"] > cfg.ratio_threshold
    # multiplying by 0 (not returning a constant) keeps the graph for backward(); a tensor flag avoids a host sync
    loss = loss * (~skipped).to(pg_loss.dtype)
    return loss, stats | {"loss/total": loss.detach(), "policy/skipped": skipped.float(), **pg_stats}


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GRPO's KL regulariser as a loss term (Shao et al. 2024, eq. 4), unweighted (``ppo_loss`` weighs it by
    kl_loss_coef): the masked mean of the per-token k3 estimate of KL(pi || pi_ref),

        pi_ref / pi - log(pi_ref / pi) - 1    (unbiased, >= 0),

    with pi the policy being trained (``logprobs``, differentiable) and pi_ref the reference; (B, T) in, scalar out.
    The paper averages over each response's tokens, then over responses; this averages over every real token of the
    batch, as policy_loss does, so that kl_loss_coef weighs the two terms alike.
    """
    return masked_mean(kl_penalty(logprobs, ref_logprobs, "k3"), mask)


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
