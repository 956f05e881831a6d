"""Learning from preferences without a reward model, as pure tensor functions: no I/O, no models, only torch.

DPO (Rafailov et al. 2023), its conservative variant cDPO for noisy labels (Mitchell 2023, "A note on DPO with
noisy preferences"; TRL's ``sigmoid`` loss with ``label_smoothing``), IPO (Azar et al. 2023), RPO's NLL term on the
chosen response (Pang et al. 2024; TRL's ``rpo_alpha``), the implicit rewards
and their accuracy and margin (named as TRL's DPOTrainer logs them), best-of-N selection with its analytic KL bound,
and the ranking of k scored completions per prompt into preference pairs.

Shapes: B pairs (or sequences), T response positions. Sequence log-probs are (B,) sums over a response's real
tokens; every loss takes the policy's and the frozen reference's, for the chosen and the rejected response.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def sequence_logprobs(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) per-token log-probs, (B, T) mask of real response tokens -> (B,) log pi(y | x), their sum.

    Padding is selected away, not multiplied by 0: a padded position may hold -inf or NaN (a token the model gives
    probability 0), and 0 * -inf would poison the row and its gradient.
    """
    return torch.where(mask.bool(), logprobs, torch.zeros_like(logprobs)).sum(-1)


def logratio_difference(chosen_logprobs: torch.Tensor, rejected_logprobs: torch.Tensor,
                        ref_chosen_logprobs: torch.Tensor, ref_rejected_logprobs: torch.Tensor) -> torch.Tensor:
    """(B,) h = log pi(y_w) / pi_ref(y_w) - log pi(y_l) / pi_ref(y_l): the one quantity DPO and IPO are losses of."""
    return (chosen_logprobs - ref_chosen_logprobs) - (rejected_logprobs - ref_rejected_logprobs)


def dpo_loss(chosen_logprobs: torch.Tensor, rejected_logprobs: torch.Tensor, ref_chosen_logprobs: torch.Tensor,
             ref_rejected_logprobs: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """(B,) per-pair DPO loss from (B,) sequence log-probs.

    Rafailov et al. 2023, eq. 7: -log sigma(beta * h). With ``label_smoothing`` eps (cDPO: each label is flipped with
    probability eps; Mitchell's note, eq. 3), the expected loss under the noisy label:
    -(1 - eps) log sigma(beta h) - eps log sigma(-beta h), as TRL's ``sigmoid`` loss. eps = 0.5 makes the loss
    symmetric in the pair (it learns nothing); eps must be < 0.5.
    """
    logits = beta * logratio_difference(chosen_logprobs, rejected_logprobs, ref_chosen_logprobs,
                                        ref_rejected_logprobs)
    return -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)


def ipo_loss(chosen_logprobs: torch.Tensor, rejected_logprobs: torch.Tensor, ref_chosen_logprobs: torch.Tensor,
             ref_rejected_logprobs: torch.Tensor, tau: float) -> torch.Tensor:
    """(B,) per-pair IPO loss from (B,) sequence log-probs: (h - 1 / (2 tau))^2.

    Azar et al. 2023 (arXiv 2310.12036v2), eq. 17, the sampled IPO loss, with h of whole-sequence log-probs as the
    paper defines it. TRL's ``ipo`` loss averages log-probs per token instead (its ``beta`` plays tau): that moves the
    target margin from 1 / (2 tau) nats per sequence to per token, so equal tau values are not comparable between the
    two.
    """
    h = logratio_difference(chosen_logprobs, rejected_logprobs, ref_chosen_logprobs, ref_rejected_logprobs)
    return (h - 1 / (2 * tau)).square()


def chosen_nll(chosen_logprobs: torch.Tensor, chosen_lengths: torch.Tensor) -> torch.Tensor:
    """(B,) -log pi(y_w | x) / |y_w|: the chosen response's negative log-likelihood per token, the term RPO adds to
    each pair's DPO loss (Pang et al. 2024, "Iterative Reasoning Preference Optimization", with
    weight 1; TRL's ``rpo_alpha``). DPO's loss sees only the difference of two log-ratios, so it can lower the chosen
    response's likelihood too, moving mass to responses in neither side of any pair (likelihood displacement); the
    NLL term holds the chosen one up."""
    return -chosen_logprobs / chosen_lengths


def implicit_rewards(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, beta: float) -> torch.Tensor:
    """(B,) beta * log pi(y|x) / pi_ref(y|x): the reward DPO's policy is optimal for, up to a per-prompt constant
    (Rafailov et al. 2023, eq. 5); TRL's ``rewards/chosen`` and ``rewards/rejected`` are its means."""
    return beta * (logprobs - ref_logprobs)


def reward_accuracy(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> torch.Tensor:
    """Share of pairs whose chosen implicit reward is strictly higher (TRL's ``rewards/accuracies``: a tie, as at the
    start where the policy is the reference, counts as wrong)."""
    return (chosen_rewards > rejected_rewards).float().mean()


def reward_margin(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor) -> torch.Tensor:
    """Mean chosen minus rejected implicit reward (TRL's ``rewards/margins``)."""
    return (chosen_rewards - rejected_rewards).mean()


def best_of_n_kl(n: int) -> float:
    """KL(best-of-n || reference) <= log n - (n - 1) / n: the analytic value every alignment paper plots for
    best-of-N (Stiennon et al. 2020; Gao et al. 2022). It is an upper bound, approached as the reference's responses
    become all distinct and none likely (Beirami et al. 2024); n = 1 gives 0."""
    if n < 1:
        raise ValueError(f"best_of_n_kl: n must be >= 1, got {n}")
    return math.log(n) - (n - 1) / n


def best_of_n(scores: torch.Tensor) -> torch.Tensor:
    """(P, N) scores of N responses per prompt -> (P,) index of the best; of equal best scores, the first."""
    if scores.isnan().any():
        raise ValueError("best_of_n: NaN scores cannot be ranked")
    return scores.argmax(-1)  # torch documents argmax as returning the first of several maxima


def preference_pairs(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(P, k) scores of k completions per prompt -> (prompt, chosen, rejected), each (M,) int64: every pair of one
    prompt's completions with different scores, the higher-scored one chosen (k distinct scores: k (k - 1) / 2
    pairs per prompt). Ordered by prompt, then by the pair's (lower index, higher index); equal scores give no pair.
    """
    if scores.isnan().any():
        raise ValueError("preference_pairs: NaN scores cannot be ranked")
    P, k = scores.shape
    i, j = torch.triu_indices(k, k, offset=1, device=scores.device)  # (k (k - 1) / 2,) each, i < j
    a, b = scores[:, i], scores[:, j]  # (P, k (k - 1) / 2)
    prompt, pair = (a != b).nonzero(as_tuple=True)
    first_wins = a[prompt, pair] > b[prompt, pair]
    chosen = torch.where(first_wins, i[pair], j[pair])
    rejected = torch.where(first_wins, j[pair], i[pair])
    return prompt, chosen, rejected
