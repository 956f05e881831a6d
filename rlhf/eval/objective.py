"""A trained policy's objective against the optimum's: J = E[r] - beta KL(pi || pi_ref) at the beta its method
maximises, measured on the optimum's pool prompts (rlhf/eval/optimum.py), beside the reference's J (KL 0) and the
optimum's J* = beta log E_ref[exp(r / beta)] (rlhf/rl/optimum.py). Its share of the way from the one to the other,
``optimum.objective_fraction``, is how well the policy was trained for its own objective.

The policy answers each pooled prompt ``POLICY_SAMPLES`` times for evaluate's metrics, ``CURVE_SAMPLES`` for the ppo
stage's curve, at the prompt's evaluation length (the pool's). Its KL is the exact one (summed over the vocabulary at
each sampled position): unbiased, with a fraction of the sampled estimate's variance. Means per prompt, then over
prompts, so that the policy and the pool weigh each prompt alike.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.data.prompts import Prompts
from rlhf.eval.evaluation import sequence_kl
from rlhf.eval.optimum import MIN_ESS, SATURATION, grid
from rlhf.models.rollout import SamplingParams, evaluation_lengths, forward, reference_at
from rlhf.models.runs import Sampler, score_run
from rlhf.models.scorers import REWARD, Scorer
from rlhf.pipeline.errors import DataError
from rlhf.pipeline.params import Params
from rlhf.pipeline.paths import OPTIMUM_POOL
from rlhf.rl import optimum as opt

# a trained policy's reward varies by about 1 within a prompt: over the 32 pooled prompts a share's standard error is
# about 0.05 with 32 responses a prompt, 0.1 with 8, enough for a curve
POLICY_SAMPLES, CURVE_SAMPLES = 32, 8


def objective_beta(params: Params) -> float | None:
    """The KL coefficient of the objective E[r] - beta KL the method maximises: ppo's fixed kl_coef, dpo's beta. None
    where there is no one such objective: the adaptive controller's moving coefficient, IPO, best-of-N, beta 0."""
    if params.method == "ppo" and not params.ppo.adap_kl_ctrl and params.ppo.init_kl_coef > 0:
        return params.ppo.init_kl_coef
    if params.method == "dpo" and params.dpo.loss == "dpo":
        return params.dpo.beta
    return None


@dataclass(frozen=True)
class Objective:
    """The pool's side of the objective on its prompts: the reference's J (KL 0), the optimum's J* and KL, and whether
    the optimum's estimate holds at this beta (as a point of the optimum's curve does)."""

    beta: float
    reference: float
    optimal: float
    optimal_kl: float
    reliable: bool

    @classmethod
    def of(cls, pool: pd.DataFrame, beta: float) -> Objective:
        rewards, n = grid(pool, REWARD), int(pool["sample"].max()) + 1
        kl = opt.tilted_kl(rewards, beta).mean().item()
        ess = opt.effective_sample_size(opt.tilted_weights(rewards, beta)).median().item()
        return cls(beta, rewards.mean().item(), opt.optimal_objective(rewards, beta).mean().item(), kl,
                   ess >= MIN_ESS and kl <= math.log(n) - SATURATION)

    def share(self, rewards: np.ndarray, kl: np.ndarray) -> dict[str, float | bool | None]:
        """A policy's (P, k) rewards and exact KLs on the pool's prompts -> the flat metrics: its objective's share of
        the optimum's gain (``optimum.objective_fraction``), both gains, both KLs, the beta, the reliability."""
        objective = float(rewards.mean(1).mean() - self.beta * kl.mean(1).mean())
        return {"optimum.objective_fraction": opt.objective_fraction(objective, self.reference, self.optimal),
                "optimum.objective_gain": objective - self.reference,
                "optimum.objective_optimum_gain": self.optimal - self.reference,
                "optimum.objective_kl": float(kl.mean()), "optimum.objective_optimum_kl": self.optimal_kl,
                "optimum.objective_beta": self.beta, "optimum.objective_reliable": self.reliable}


@dataclass(frozen=True)
class ObjectiveProbe:
    """Measures a policy's objective on the pool's prompts, each answered ``samples`` times, with the seed's draws
    whatever the caller's random state (which it leaves as it was)."""

    objective: Objective
    query_ids: list[list[int]]
    queries: list[str]
    lengths: list[int]
    scorer: Scorer
    tokenizer: PreTrainedTokenizerBase
    sampling: SamplingParams
    batch_size: int
    seed: int
    samples: int

    @torch.no_grad()
    def measure(self, policy: PreTrainedModel,
                reference: Callable[[], contextlib.AbstractContextManager[PreTrainedModel]]) -> dict:
        """``Objective.share``'s metrics of ``policy``; ``reference()`` enters the frozen reference (a LoRA policy's is
        itself with its adapters off, so it is entered per batch, around the reference's own forward)."""
        k, temperature = self.samples, self.sampling.temperature
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            run = Sampler(policy, self.tokenizer, self.sampling, self.batch_size).run(
                [q for q in self.query_ids for _ in range(k)], [n for n in self.lengths for _ in range(k)],
                self.seed, f"objective: {k} samples per pooled prompt")
        rewards = score_run({REWARD: self.scorer}, [q for q in self.queries for _ in range(k)], run.texts,
                            self.batch_size, "objective: score", run.response_ids)[REWARD]
        kl = []
        for samples in run.batches:
            with reference() as ref_model:
                ref = reference_at(ref_model, samples, temperature)
            out = forward(policy, samples, temperature, ref)
            kl.append(sequence_kl(out.logprobs, out.ref_logprobs, out.kl, samples.response_mask)[1])
        return self.objective.share(rewards.reshape(-1, k), torch.cat(kl).float().cpu().numpy().reshape(-1, k))


def read_pool(params: Params) -> pd.DataFrame | None:
    """The optimum stage's pool, None when it is off (optimum.samples_per_prompt 0)."""
    if params.optimum.samples_per_prompt == 0:
        return None
    if not OPTIMUM_POOL.exists():
        raise DataError(f"{OPTIMUM_POOL}: missing (run the optimum stage first, or set optimum.samples_per_prompt: 0)")
    return pd.read_parquet(OPTIMUM_POOL)


def objective_probe(params: Params, pool: pd.DataFrame | None, prompts: Prompts, scorer: Scorer,
                    tokenizer: PreTrainedTokenizerBase, samples: int, batch_size: int) -> ObjectiveProbe | None:
    """The probe of the method's objective (``objective_beta``) on the ``pool``'s prompts, the first of the eval
    ``prompts``; None without a pool (optimum off) or a beta."""
    beta = objective_beta(params)
    if pool is None or beta is None:
        return None
    P, cfg = int(pool["prompt"].max()) + 1, params.ppo
    lengths = evaluation_lengths(len(prompts), cfg.response_min_tokens, cfg.response_max_tokens, params.seed)[:P]
    return ObjectiveProbe(Objective.of(pool, beta), prompts.input_ids[:P], prompts.queries[:P], lengths, scorer,
                          tokenizer, SamplingParams.of(cfg), batch_size, params.seed, samples)
