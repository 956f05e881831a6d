"""One PPO iteration for a causal LM, narrated in the order of the algorithm; each step calls into rlhf.rl.ppo.

Device-agnostic: tensors live on ``device``; an optional ``accelerate.Accelerator`` adds data parallelism (each
process samples its own batch, gradients are averaged, the KL controller sees the mean over processes).
``PPOTrainer.step`` is the one entry point, for the ppo stage, the tests and the benchmark alike.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.models.policy import PolicyWithValueHead
from rlhf.models.scorers import Scorer
from rlhf.pipeline.errors import TrainingError
from rlhf.pipeline.ppo_params import PpoParams
from rlhf.rl import ppo
from rlhf.rl.advantages import estimate_advantages
from rlhf.rl.rollout import Samples, SamplingParams, decode_responses, forward, generate, response_lengths
from rlhf.train.precision import autocast

if TYPE_CHECKING:
    from accelerate import Accelerator

@dataclass
class Experience:
    """What one iteration learns from; per-token tensors are (B, R) over the response positions, and the B samples
    are samples_per_prompt answers to each prompt in turn (sample = prompt * k + j)."""

    samples: Samples
    queries: list[str]  # B texts: the prompt of each sample
    responses_text: list[str]
    scores: torch.Tensor  # (B,) after EOS penalty and scaling
    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor | None  # None without a critic
    rewards: torch.Tensor
    non_score_reward: torch.Tensor
    kl: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor | None  # None for the estimators that score a whole response (the group baselines)
    entropy: torch.Tensor

    @property
    def mask(self) -> torch.Tensor:
        return self.samples.response_mask


@dataclass
class StepResult:
    stats: dict[str, float]
    experience: Experience | None  # None: the batch was skipped (a NaN/inf under ppo.nan_policy: skip)

    @property
    def skipped(self) -> bool:
        return self.experience is None


@dataclass
class PPOTrainer:
    policy: PolicyWithValueHead  # the trained module: checkpointed and saved
    ref_policy: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    scorer: Scorer
    cfg: PpoParams
    device: torch.device
    precision: str  # model.precision
    accelerator: Accelerator | None = None
    length_generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))
    skipped_batches: int = 0

    def __post_init__(self) -> None:
        cfg = self.cfg
        # fused: one kernel over all parameters instead of a dozen passes per step (the gain: benchmark notes)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=cfg.learning_rate,
                                           weight_decay=cfg.weight_decay, fused=True)
        # the update's forward and backward go through this one: DDP-wrapped by accelerate so that gradients are
        # averaged over processes, else the policy itself (sampling and saving use the unwrapped policy)
        self.wrapped_policy: torch.nn.Module = self.policy
        if self.accelerator is not None:
            self.wrapped_policy, self.optimizer = self.accelerator.prepare(self.policy, self.optimizer)
        self.kl_ctl = (ppo.AdaptiveKLController(cfg.init_kl_coef, cfg.target, cfg.horizon) if cfg.adap_kl_ctrl
                       else ppo.FixedKLController(cfg.init_kl_coef))
        self.score_moments = ppo.RunningMoments()
        self.sampling = SamplingParams(cfg.top_k, cfg.top_p, cfg.temperature)
        self.ref_policy.eval().requires_grad_(False)

    # --- the iteration ---------------------------------------------------------------------------------------------

    def step(self, query_ids: list[list[int]], queries: list[str], step: int = 0) -> StepResult:
        """One full PPO iteration on a batch of ppo.prompts_per_step prompts, each answered ppo.samples_per_prompt
        times: its stats (timings included) and experience."""
        timings: dict[str, float] = {}
        # 1-5. generate, score, forward policy and reference, shape rewards, advantages
        experience = self.make_experience(query_ids, queries, step, timings)
        return self.learn(experience, step, timings)

    def learn(self, experience: Experience | None, step: int, timings: dict[str, float]) -> StepResult:
        """6-7 of the iteration, on ``experience`` (None: a skipped batch, counted): the update, then the KL
        controller; its stats, those of the experience and the ``timings`` of all phases."""
        if experience is None:
            self.skipped_batches += 1
            return StepResult({"ppo/skipped_batches": float(self.skipped_batches)}, None)
        # 6. ppo epochs over shuffled minibatches
        with self.timer(timings, "update"):
            update_stats = self.update(experience, step)
        # 7. adapt the KL coefficient to the mean sequence KL of the batch
        mean_kl = self.mean_over_processes(experience.kl.sum(1).mean())
        kl_coef = self.kl_ctl.value
        self.kl_ctl.update(mean_kl, self.cfg.batch_size)
        stats = self.experience_stats(experience, mean_kl, kl_coef) | update_stats
        stats |= {f"time/{k}": v for k, v in timings.items()}
        n_tokens = experience.mask.sum().item()
        total = sum(timings.values())
        stats |= {"time/step": total, "throughput/samples_per_s": len(experience.queries) / total,
                  "throughput/tokens_per_s": n_tokens / total, "ppo/skipped_batches": float(self.skipped_batches)}
        return StepResult(stats, experience)

    def make_experience(self, query_ids: list[list[int]], queries: list[str], step: int,
                        timings: dict[str, float]) -> Experience | None:
        cfg = self.cfg
        with self.timer(timings, "generate"):
            # one length per prompt, shared by its k samples: with k = 1 the draws are those of one sample per prompt
            lengths = response_lengths(len(query_ids), cfg.response_min_tokens, cfg.response_max_tokens,
                                       self.length_generator)
            query_ids, queries, lengths = (repeat_each(x, cfg.samples_per_prompt) for x in (query_ids, queries,
                                                                                           lengths))
            with self.autocast():
                samples = generate(self.policy.lm, self.tokenizer, query_ids, lengths, self.sampling)
            responses_text = decode_responses(self.tokenizer, samples)
        return self.score_experience(samples, queries, responses_text, step, timings)

    def score_experience(self, samples: Samples, queries: list[str], responses_text: list[str], step: int,
                         timings: dict[str, float]) -> Experience | None:
        """2-5 of the iteration on sampled responses: score, forward policy and reference, rewards, advantages;
        None where ppo.nan_policy skips a NaN/inf score."""
        cfg = self.cfg
        with self.timer(timings, "score"):
            raw_scores = self.scorer(queries, responses_text).to(self.device)
            if not self.finite(raw_scores, step, "score", "the reward scorer returned NaN/inf"):
                return None
            scores = ppo.apply_missing_eos_penalty(raw_scores, samples.has_eos, cfg.missing_eos_penalty)
            scores = ppo.scale_scores(scores, self.score_moments, cfg.use_score_scaling, cfg.use_score_norm,
                                      cfg.score_clip)
        with self.timer(timings, "forward"), torch.no_grad():
            full = cfg.kl_penalty == "full"
            self.policy.eval()
            with self.autocast():
                out = forward(self.policy, samples, cfg.temperature, keep_logits=full)
                ref = forward(self.ref_policy, samples, cfg.temperature, keep_logits=full)
            mask = samples.response_mask
            rewards, non_score_reward, kl = ppo.compute_rewards(
                scores, out.logprobs, ref.logprobs, mask, self.kl_ctl.value, cfg.kl_penalty, out.logits, ref.logits)
            advantages, returns = estimate_advantages(cfg.advantage_estimator, rewards, mask, out.values,
                                                      cfg.samples_per_prompt, cfg.gamma, cfg.lam, cfg.whiten_rewards)
        return Experience(samples, queries, responses_text, scores, out.logprobs, ref.logprobs, out.values, rewards,
                          non_score_reward, kl, advantages, returns, out.entropy)

    def update(self, exp: Experience, step: int) -> dict[str, float]:
        """``ppo_epochs`` passes over shuffled minibatches; gradients accumulate over micro-batches.

        An optimizer step whose every mini-batch was skipped (mean ratio above ppo.ratio_threshold) is not taken:
        weights and optimizer state stay as they were (Adam's momentum would otherwise still move the weights, as it
        does in TRL 0.11, which only zeroes the loss); ``policy/skipped_steps`` counts them.
        """
        cfg = self.cfg
        self.wrapped_policy.train()
        B = len(exp.scores)
        micro = cfg.mini_batch_size
        stats: list[dict[str, torch.Tensor]] = []
        grad_norms = []
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(B)
            for start in range(0, B, micro * cfg.gradient_accumulation_steps):
                group = []
                for mb_start in range(start, start + micro * cfg.gradient_accumulation_steps, micro):
                    mb = order[mb_start: mb_start + micro].to(self.device)
                    loss, mb_stats = self.minibatch_loss(exp, mb)
                    self.finite(loss, step, "loss/total", "the PPO loss is NaN/inf", always_stop=True)
                    self.backward(loss / cfg.gradient_accumulation_steps)
                    group.append(mb_stats)
                stats += group
                # every process must agree, or their weights would part: skipped only where all processes skipped
                if self.mean_over_processes(torch.stack([s["policy/skipped"] for s in group]).min()) == 1.0:
                    self.optimizer.zero_grad(set_to_none=True)
                else:
                    grad_norms.append(self.optimizer_step(step))
        self.wrapped_policy.eval()
        mean = {k: torch.stack([s[k] for s in stats]).mean().item() for k in stats[0]}
        mean["policy/ratio_max"] = max(s["val/ratio_max"].item() for s in stats)
        n_steps = cfg.ppo_epochs * B // (micro * cfg.gradient_accumulation_steps)
        mean["policy/skipped_steps"] = float(n_steps - len(grad_norms))
        mean["policy/grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else 0.0  # none applied
        return mean

    def minibatch_loss(self, exp: Experience, mb: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        s = exp.samples
        mb_samples = Samples(s.query_responses[mb], s.attention_mask[mb], s.context_length, s.response_mask[mb],
                             s.has_eos[mb])
        cfg = self.cfg
        with self.autocast():
            out = forward(self.wrapped_policy, mb_samples, cfg.temperature)
        critic = exp.values is not None
        loss, stats = ppo.ppo_loss(out.logprobs, out.values, exp.logprobs[mb], exp.values[mb] if critic else None,
                                   exp.advantages[mb], exp.returns[mb] if critic else None, mb_samples.response_mask,
                                   cfg.cliprange, cfg.cliprange_value, cfg.vf_coef, cfg.ratio_threshold,
                                   exp.ref_logprobs[mb], cfg.kl_loss_coef)
        mask = mb_samples.response_mask
        stats["policy/entropy"] = ppo.masked_mean(out.entropy, mask)
        # TRL 0.11's ppo/val/mean and ppo/returns/mean: the mean over mini-batches of each one's masked mean
        if critic:
            stats["val/mean"] = ppo.masked_mean(exp.values[mb], mask)
        if exp.returns is not None:
            stats["val/returns"] = ppo.masked_mean(exp.returns[mb], mask)
        return loss, stats

    def optimizer_step(self, step: int) -> float:
        params = self.wrapped_policy.parameters()
        if self.cfg.max_grad_norm is None:  # the norm is still logged, but clipping by inf would rescale every grad
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        elif self.accelerator is not None:
            norm = self.accelerator.clip_grad_norm_(params, self.cfg.max_grad_norm)
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)
        if not self.finite(norm, step, "policy/grad_norm", "a gradient is NaN/inf"):
            self.optimizer.zero_grad(set_to_none=True)
            return float("nan")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm.item()

    # --- helpers ---------------------------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        if self.accelerator is not None:
            self.accelerator.backward(loss)
        else:
            loss.backward()

    def finite(self, x: torch.Tensor, step: int, quantity: str, what: str, always_stop: bool = False) -> bool:
        """False (skip the batch) or a TrainingError naming the step and quantity when ``x`` has NaN/inf."""
        if torch.isfinite(x).all():
            return True
        if always_stop or self.cfg.nan_policy == "stop":
            bad = int((~torch.isfinite(x)).sum())
            advice = ("it stops whatever ppo.nan_policy says: lower ppo.learning_rate" if always_stop
                      else "set ppo.nan_policy: skip to skip such batches")
            raise TrainingError(f"step {step}: {quantity}: {what} ({bad} of {x.numel()} values); {advice}")
        return False

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.device, self.precision)

    def mean_over_processes(self, x: torch.Tensor) -> float:
        if self.accelerator is not None:
            x = self.accelerator.reduce(x.detach(), reduction="mean")
        return x.item()

    def timer(self, timings: dict[str, float], name: str) -> _Timer:
        return _Timer(timings, name, self.device)

    def experience_stats(self, exp: Experience, mean_kl: float, kl_coef: float) -> dict[str, float]:
        """The batch's stats. Those named like TRL 0.11's mean what TRL's mean: ``objective/entropy`` is the mean
        over samples of the sequence's summed -logprob (a one-sample estimate of the sequence entropy), and
        ``objective/non_score_reward`` the mean over samples of the summed KL penalty (PPOv2Trainer's; the legacy
        trainer's ``ppo/mean_non_score_reward``, a per-token mean, is this / ``tokens/response_length``).
        ``objective/token_entropy`` is the exact entropy of the rollout policy, averaged over the real tokens."""
        mask = exp.mask
        return {
            "objective/scores": exp.scores.mean().item(),
            "objective/scores_std": exp.scores.std().item() if len(exp.scores) > 1 else 0.0,
            "objective/kl": mean_kl,
            "objective/kl_coef": kl_coef,
            "objective/non_score_reward": exp.non_score_reward.sum(1).mean().item(),
            "objective/entropy": (-exp.logprobs * mask).sum(1).mean().item(),
            "objective/token_entropy": ppo.masked_mean(exp.entropy, mask).item(),
            "val/num_eos_tokens": exp.samples.has_eos.sum().item(),
            "tokens/response_length": mask.sum(1).float().mean().item(),
        }

    # --- checkpointing ---------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        """What a resumed run needs besides the weights and the RNG states; JSON-ready except ``optimizer``."""
        return {"optimizer": self.optimizer.state_dict(), "kl_ctl": self.kl_ctl.state_dict(),
                "score_moments": self.score_moments.state_dict(), "skipped_batches": self.skipped_batches}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.score_moments.load_state_dict(state["score_moments"])
        self.skipped_batches = state["skipped_batches"]


def repeat_each(items: list, k: int) -> list:
    """Each item k times in a row: [a, b] -> [a, a, b, b] for k = 2 (a prompt's samples are contiguous)."""
    return [item for item in items for _ in range(k)]


class _Timer:
    """Wall time of a phase; on CUDA it waits for the queued kernels so the phase gets its own time."""

    def __init__(self, timings: dict[str, float], name: str, device: torch.device) -> None:
        self.timings, self.name, self.cuda = timings, name, device.type == "cuda"

    def __enter__(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        self.timings[self.name] = self.timings.get(self.name, 0.0) + time.perf_counter() - self.start
