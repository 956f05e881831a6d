"""The KL-regularised optimum and best-of-n, estimated from reference samples alone: pure tensor functions, no I/O.

For a reward r and a coefficient beta, the policy that maximises E[r] - beta KL(pi || pi_ref) (PPO's objective with a
fixed KL coefficient, and DPO's under its preference model) is pi_beta(y|x) ∝ pi_ref(y|x) exp(r(x, y) / beta)
(Korbak et al. 2022; Gao et al. 2022). From N reference samples of a prompt, self-normalised importance weights
w_i ∝ exp(r_i / beta) estimate any expectation under it, E[f] ≈ sum_i w_i f(y_i), and its KL,

    KL(pi_beta || pi_ref) ≈ sum_i w_i r_i / beta - log mean_i exp(r_i / beta),

which saturates at log N as the weights collapse onto one sample; the effective sample size 1 / sum_i w_i^2 says how
many samples the estimate rests on. The objective's value there, J*_beta = E_beta[r] - beta KL = beta log E_ref[exp(r /
beta)], is the most any policy reaches at that beta; a policy's share of it is how far it got from the reference's
J = E_ref[r] towards it. Best-of-n over the same samples (Beirami et al. 2024) needs no new draw either:
the i-th lowest of N rewards is the best of a random n-subset with probability C(i-1, n-1) / C(N, n).

Shapes: P prompts, N samples each; (P, N) rewards in, (P, N) weights or (P,) per-prompt values out.
"""

from __future__ import annotations

import math

import torch


def tilted_weights(rewards: torch.Tensor, beta: float) -> torch.Tensor:
    """(P, N) rewards -> (P, N) self-normalised weights of pi_beta over each prompt's samples."""
    return torch.softmax(rewards / beta, dim=-1)


def tilted_kl(rewards: torch.Tensor, beta: float) -> torch.Tensor:
    """(P, N) rewards -> (P,) KL(pi_beta || pi_ref) per prompt: sum_i w_i r_i / beta - log mean_i exp(r_i / beta)."""
    z = rewards / beta
    return (torch.softmax(z, -1) * z).sum(-1) - (torch.logsumexp(z, -1) - math.log(z.shape[-1]))


def effective_sample_size(weights: torch.Tensor) -> torch.Tensor:
    """(P, N) weights summing to 1 per prompt -> (P,) Kish's effective sample size 1 / sum_i w_i^2, in [1, N]."""
    return 1.0 / weights.square().sum(-1)


def best_of_n_weights(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """(P, N) rewards -> (P, N) probabilities that each sample is the best of n drawn without replacement from the N:
    C(i-1, n-1) / C(N, n) for the sample of rank i (1 = lowest; ties broken by position). n = 1 is uniform, n = N puts
    everything on the highest."""
    N = rewards.shape[-1]
    if not 1 <= n <= N:
        raise ValueError(f"best_of_n_weights: n = {n}; it must be in [1, {N}] (the samples per prompt)")
    rank = torch.empty_like(rewards, dtype=torch.float64)
    rank.scatter_(-1, rewards.argsort(dim=-1, stable=True),
                  torch.arange(1, N + 1, dtype=torch.float64, device=rewards.device).expand(rewards.shape).clone())

    def log_choose(a: torch.Tensor, b: float) -> torch.Tensor:
        return torch.lgamma(a + 1) - math.lgamma(b + 1) - torch.lgamma(a - b + 1)

    log_p = log_choose(rank - 1, n - 1) - log_choose(torch.tensor(float(N), dtype=torch.float64), n)
    return torch.where(rank >= n, log_p.exp(), torch.zeros_like(log_p)).to(rewards.dtype)


def selection_kl(weights: torch.Tensor) -> torch.Tensor:
    """(P, N) probabilities over each prompt's N samples -> (P,) KL of that selection from the uniform draw of one
    sample, sum_i p_i log(N p_i): the KL from the reference of a policy that picks among the samples so (best-of-n's
    estimate, at most log N)."""
    N = weights.shape[-1]
    terms = weights * torch.log(N * weights)
    return torch.where(weights > 0, terms, torch.zeros_like(terms)).sum(-1)


def optimal_objective(rewards: torch.Tensor, beta: float) -> torch.Tensor:
    """(P, N) rewards -> (P,) the objective's optimum per prompt, J*_beta = max_pi E_pi[r] - beta KL(pi || pi_ref)
    = beta log mean_i exp(r_i / beta), reached by pi_beta (biased low where the weights collapse, as its KL)."""
    return beta * (torch.logsumexp(rewards / beta, -1) - math.log(rewards.shape[-1]))


def objective_fraction(objective: float, reference: float, optimal: float) -> float | None:
    """A policy's objective J as a share of the way from the reference's J to the optimum's, (J - J_ref) / (J* -
    J_ref): 0 at the reference, 1 at the optimum; None where the optimum gains nothing over the reference."""
    return (objective - reference) / (optimal - reference) if optimal > reference else None
