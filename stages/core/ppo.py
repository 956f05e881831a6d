"""PPO for language models, as pure tensor functions: no I/O, no models, only torch.

Shapes: B sequences, T response positions, V vocabulary. Per-token tensors are (B, T) and come with a ``mask`` of the
same shape that is 1 on real response tokens and 0 on padding; rows may be ragged and padded on either side.
The formulas follow TRL 0.11's PPOTrainer (Ziegler et al. 2019's recipe) unless a comment says otherwise.
"""

from __future__ import annotations

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
            raise ValueError("masked_var: an unbiased variance needs at least two unmasked values")
        var = var * n / (n - 1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mean) / std over the masked positions; with ``shift_mean=False`` the mean is added back (scale only)."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def first_true_indices(bools: torch.Tensor) -> torch.Tensor:
    """(B, T) bool -> (B,) index of the first True in each row, T where a row has none."""
    T = bools.shape[-1]
    positions = torch.arange(T, device=bools.device).expand_as(bools)
    return torch.where(bools, positions, T).min(-1).values


def last_true_indices(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) mask -> (B,) index of the last 1 in each row, -1 where a row has none."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, -1).max(-1).values


# ---------------------------------------------------------------------------------------------------------------------
# log-probabilities and KL


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits, (B, T) labels -> (B, T) log p(label).

    Equals ``log_softmax(logits).gather(labels)`` without materialising the (B, T, V) log_softmax: only the
    label's logit and the row's logsumexp are needed. Low-precision logits are upcast one row at a time, since a
    bf16 logsumexp over 50k entries loses most of its digits.
    """
    if logits.dtype in (torch.float32, torch.float64):
        return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return torch.stack([logprobs_from_logits(row.float(), row_labels) for row, row_labels in zip(logits, labels,
                                                                                                 strict=True)])


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """At least float32: softmax statistics over 50k entries in bf16 keep too few digits."""
    return x if x.dtype == torch.float64 else x.float()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """(B, T, V) -> (B, T) entropy of softmax(logits): logsumexp(z) - sum p z."""
    logits = _upcast(logits)
    return torch.logsumexp(logits, dim=-1) - (F.softmax(logits, dim=-1) * logits).sum(-1)


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
        return torch.expm1(-log_ratio) + log_ratio
    if mode == "full":
        if logits is None or ref_logits is None:
            raise ValueError("kl_penalty: mode 'full' needs logits and ref_logits")
        logp, ref_logp = F.log_softmax(_upcast(logits), -1), F.log_softmax(_upcast(ref_logits), -1)
        return F.kl_div(ref_logp, logp, log_target=True, reduction="none").sum(-1)
    raise ValueError(f"kl_penalty: unknown mode {mode!r}")


def compute_rewards(scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor,
                    kl_coef: float, kl_mode: str = "kl", logits: torch.Tensor | None = None,
                    ref_logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token rewards: -kl_coef * KL on every real token, plus the sequence's score on its last real token.

    Returns (rewards, non_score_reward, kl), each (B, T) and zero off the mask.
    """
    mask = mask.to(logprobs.dtype)
    kl = kl_penalty(logprobs, ref_logprobs, kl_mode, logits, ref_logits) * mask
    non_score_reward = -kl_coef * kl
    rewards = non_score_reward.clone()
    rows = torch.arange(len(scores), device=scores.device)
    rewards[rows, last_true_indices(mask)] += scores.to(rewards.dtype)
    return rewards, non_score_reward, kl


# ---------------------------------------------------------------------------------------------------------------------
# KL controllers


class AdaptiveKLController:
    """Ziegler et al. 2019: move kl_coef so the observed KL tracks ``target`` over ``horizon`` samples."""

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        self.value, self.target, self.horizon = init_kl_coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = state["value"]


class FixedKLController(AdaptiveKLController):
    """A constant kl_coef."""

    def __init__(self, kl_coef: float) -> None:
        super().__init__(kl_coef, target=1.0, horizon=1.0)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


# ---------------------------------------------------------------------------------------------------------------------
# advantages


def compute_advantages(values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float,
                       whiten_rewards: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the response positions -> (advantages whitened over the mask, returns = advantages + values).

    Values and rewards are zeroed off the mask, so the position after a row's last real token bootstraps from 0 (the
    episode ends there); for a left-padded row the padding precedes the response and never feeds a real position.
    """
    mask = mask.to(values.dtype)
    values, rewards = values * mask, rewards * mask
    if whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False) * mask
    T = rewards.shape[-1]
    lastgaelam = torch.zeros_like(rewards[:, 0])
    advantages_reversed = []
    for t in reversed(range(T)):
        nextvalues = values[:, t + 1] if t < T - 1 else torch.zeros_like(lastgaelam)
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        # a padded position must not pass the advantage of a later real token to an earlier one
        lastgaelam = (delta + gamma * lam * lastgaelam) * mask[:, t] + lastgaelam * (1 - mask[:, t])
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1) * mask
    returns = advantages + values
    return masked_whiten(advantages, mask) * mask, returns


# ---------------------------------------------------------------------------------------------------------------------
# losses


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                cliprange: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate objective (Schulman et al. 2017), as a loss to minimise."""
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.maximum(pg_losses, pg_losses2), mask)
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
    """Clipped value loss: 0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2)."""
    vpredclipped = torch.clamp(vpreds, old_values - cliprange_value, old_values + cliprange_value)
    vf_losses1 = (vpreds - returns).square()
    vf_losses2 = (vpredclipped - returns).square()
    loss = 0.5 * masked_mean(torch.maximum(vf_losses1, vf_losses2), mask)
    return loss, {"val/clipfrac": masked_mean((vf_losses2 > vf_losses1).float(), mask)}


def ppo_loss(logprobs: torch.Tensor, values: torch.Tensor, old_logprobs: torch.Tensor, old_values: torch.Tensor,
             advantages: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, cliprange: float,
             cliprange_value: float, vf_coef: float,
             ratio_threshold: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """pg_loss + vf_coef * vf_loss; zeroed (the minibatch skipped) when the mean ratio exceeds ratio_threshold."""
    pg_loss, pg_stats = policy_loss(logprobs, old_logprobs, advantages, mask, cliprange)
    vf_loss, vf_stats = value_loss(values, old_values, returns, mask, cliprange_value)
    loss = pg_loss + vf_coef * vf_loss
    skipped = pg_stats["val/ratio"] > ratio_threshold
    if skipped:
        loss = loss * 0.0
    stats = {"loss/policy": pg_loss.detach(), "loss/value": vf_loss.detach(), "loss/total": loss.detach(),
             "policy/skipped": skipped.float(), **pg_stats, **vf_stats}
    return loss, stats


# ---------------------------------------------------------------------------------------------------------------------
# score shaping


class RunningMoments:
    """Running mean and std of all scores seen so far (Chan et al.'s parallel update), for score scaling."""

    def __init__(self) -> None:
        self.mean, self.var, self.count = 0.0, 1.0, 1e-24

    def update(self, x: torch.Tensor) -> None:
        x = x.double()
        batch_mean, batch_var, batch_count = x.mean().item(), x.var(unbiased=False).item(), x.numel()
        delta, total = batch_mean - self.mean, self.count + batch_count
        m2 = self.var * self.count + batch_var * batch_count + delta**2 * self.count * batch_count / total
        self.mean += delta * batch_count / total
        self.var, self.count = m2 / total, total

    @property
    def std(self) -> float:
        return (self.var * self.count / max(self.count - 1, 1)) ** 0.5  # unbiased, as numpy's ddof=1

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mean, self.var, self.count = state["mean"], state["var"], state["count"]


def scale_scores(scores: torch.Tensor, moments: RunningMoments, use_score_scaling: bool, use_score_norm: bool,
                 score_clip: float | None) -> torch.Tensor:
    """TRL 0.11's optional score shaping: update the running moments, scale (and centre) by them, then clip."""
    if use_score_scaling:
        moments.update(scores)
        centre = moments.mean if use_score_norm else 0.0
        scores = (scores - centre) / (moments.std + 1e-8)
    if score_clip is not None:
        scores = scores.clamp(-score_clip, score_clip)
    return scores


def apply_missing_eos_penalty(scores: torch.Tensor, has_eos: torch.Tensor, penalty: float | None) -> torch.Tensor:
    """Subtract ``penalty`` from the score of every response that never emitted EOS (None: off)."""
    if penalty is None:
        return scores
    return torch.where(has_eos, scores, scores - penalty)
