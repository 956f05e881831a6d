"""One PPO iteration for a causal LM, narrated in the order of the algorithm; each step calls into rlhf.rl.ppo.

Device-agnostic: tensors live on ``device``; an optional ``accelerate.Accelerator`` adds data parallelism (each
process samples its own batch, gradients are averaged, the KL controller sees the mean over processes).
``PPOTrainer.step`` is the one entry point, for the ppo stage, the tests and the benchmark alike.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.optim.swa_utils import get_ema_multi_avg_fn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.models.lora import adapters_disabled
from rlhf.models.policy import PolicyWithValueHead, head_at
from rlhf.models.precision import autocast, cuda_matmul_precision, mixed_precision, to_device
from rlhf.models.rollout import Samples, SamplingParams, decode_responses, forward, generate, response_lengths
from rlhf.models.rollout import reference_at as reference_head_input
from rlhf.models.scorers import Scorer
from rlhf.pipeline.ppo_params import PpoParams
from rlhf.rl import ppo
from rlhf.rl.advantages import reward_scale
from rlhf.rl.estimators import ESTIMATORS
from rlhf.train import ppo_update, sharding
from rlhf.train.batches import repeat_each
from rlhf.train.compiled import CompiledStep, compiles, mark_static_address, saved_state, skip_step_if
from rlhf.train.fit import lr_factor
from rlhf.train.ppo_update import F
from rlhf.train.system_use import Clock

if TYPE_CHECKING:
    from accelerate import Accelerator

log = logging.getLogger(__name__)


@dataclass
class Rollout:
    """One iteration's samples and what the update learns from them: B = prompts x samples_per_prompt rows, each
    prompt's samples in a row (sample = prompt * k + j); per-token tensors are (B, R) over the response positions."""

    samples: Samples
    queries: list[str]  # the prompt of each sample
    responses: list[str]
    scores: torch.Tensor  # (B,) after the EOS penalty and score scaling
    experience: ppo.Experience
    rewards: torch.Tensor  # per token: the KL penalty, plus the score on the last real token
    non_score_reward: torch.Tensor
    kl: torch.Tensor
    entropy: torch.Tensor

    @property
    def masks(self) -> torch.Tensor:
        return self.experience.masks


@dataclass
class StepResult:
    stats: dict[str, float]
    rollout: Rollout | None  # None: the batch was skipped (a NaN/inf score under ppo.nan_policy: skip)

    @property
    def skipped(self) -> bool:
        return self.rollout is None


@dataclass
class PPOTrainer:
    policy: PolicyWithValueHead  # the trained module: checkpointed and saved
    ref_policy: PreTrainedModel | None  # None: the policy's LM with its LoRA adapters off (``reference``)
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
        self.compiled = compiles(cfg.compile, self.device, "ppo.compile", processes=self.accelerator is not None)
        self.sharded = self.accelerator is not None and cfg.shard
        if self.sharded:  # before the optimizer
            sharding.shard([self.policy, self.ref_policy], self.device, self.accelerator.num_processes)
        # fused: one kernel over all parameters instead of a dozen passes per step; it also drops a step on the
        # device (ppo_update). The learning rate lives on the device: the step reads it there
        self.trained = [p for p in self.policy.parameters() if p.requires_grad]  # every one but a LoRA run's base
        groups = self.policy.param_groups(cfg.learning_rate, cfg.value_learning_rate or cfg.learning_rate, self.device)
        self.optimizer = torch.optim.AdamW(groups, weight_decay=cfg.weight_decay, fused=True)
        # ppo.ema_decay: the weights written and measured (``averaged``), a moving average of the trained ones
        self.average = [p.detach().clone() for p in self.trained] if cfg.ema_decay is not None else None
        # the update's forward and backward go through this one: DDP-wrapped by accelerate so that gradients are
        # averaged over processes, else the policy itself (sampling and saving use the unwrapped policy)
        self.wrapped_policy: torch.nn.Module = self.policy
        if self.accelerator is not None and not self.sharded:
            self.wrapped_policy, self.optimizer = self.accelerator.prepare(self.policy, self.optimizer)
        self.kl_ctl = (ppo.AdaptiveKLController(cfg.init_kl_coef, cfg.target, cfg.horizon) if cfg.adap_kl_ctrl
                       else ppo.FixedKLController(cfg.init_kl_coef))
        self.score_moments = ppo.RunningMoments()
        self.sampling = SamplingParams.of(cfg)
        if self.ref_policy is not None:
            self.ref_policy.eval().requires_grad_(False)
        # ppo.kl_penalty exact: the update's exact KL runs the reference's head on the rollout's stored hidden states;
        # a LoRA policy's LM head has no adapters (lora.py), so it is its reference's
        self.ref_head = head_at(self.ref_policy or self.policy.lm, cfg.temperature)
        # model.precision resolved here: its auto probes the CPU, which torch.compile cannot trace
        self.step_precision = "bf16" if mixed_precision(self.device, self.precision) else "fp32"
        # a compiled step cannot switch the LM head's fp32 matmuls to TF32 inside its graph (policy.lm_head): under
        # bf16 on CUDA the update holds that setting around its steps, which holds it for the value head's too
        self.cuda_bf16 = self.device.type == "cuda" and self.step_precision == "bf16"
        # None: eager. The compiled update's first use is checked against the eager update (``update``)
        self.compiled_step = CompiledStep("ppo.compile", cfg.compile, self.step_precision) if self.compiled else None
        self.step_compiled = False  # whether the update's step runs compiled now (``run_update``)
        if self.compiled:
            log.info("ppo: the update's step compiles in its first iterations (ppo.compile: %s)", cfg.compile)
            self.compiled_fns = {fn: ppo_update.compiled(fn, self.device)
                                 for fn in (ppo_update.minibatch_loss, ppo_update.clip_gradients)}
            for p in self.trained:  # gradients accumulate in place, at fixed addresses a CUDA graph can hold
                p.grad = torch.zeros_like(p)
                if self.device.type == "cuda":
                    mark_static_address(p.grad)

    def step_fn(self, fn: F) -> F:
        """``fn`` (a function of ppo_update) as the update's step runs it now: compiled or eager."""
        return self.compiled_fns[fn] if self.step_compiled else fn

    # --- the iteration ---------------------------------------------------------------------------------------------

    def step(self, query_ids: list[list[int]], queries: list[str], step: int = 0) -> StepResult:
        """One full PPO iteration on a batch of ppo.prompts_per_step prompts, each answered ppo.samples_per_prompt
        times: its stats (the phases' wall times included) and rollout."""
        clock = Clock(self.device)
        learning_rate = self.set_learning_rate(step)
        with clock("generate"):  # 1. sample k responses per prompt
            samples, queries, responses = self.generate(query_ids, queries)
        with clock("score"):  # 2. score them
            scores = self.score(samples, queries, responses, step)
        if scores is None:
            self.skipped_batches += 1
            return StepResult({"ppo/skipped_batches": float(self.skipped_batches)}, None)
        with clock("forward"):  # 3-5. forward policy and reference, per-token rewards, advantages
            rollout = self.make_experience(samples, queries, responses, scores)
        result = self.learn(rollout, step)  # 6-7. the update, the KL controller
        timings = clock.timings | {"update": result.stats["time/update"]}
        total, n_tokens = sum(timings.values()), rollout.masks.sum().item()
        result.stats |= {f"time/{k}": v for k, v in timings.items()}
        result.stats |= {"time/step": total, "throughput/samples_per_s": len(rollout.queries) / total,
                         "throughput/tokens_per_s": n_tokens / total, "ppo/learning_rate": learning_rate}
        return result

    def learn(self, rollout: Rollout, step: int) -> StepResult:
        """6-7: the update on ``rollout``, then the KL controller; the stats of both (``time/update``: wall time)."""
        clock = Clock(self.device)
        with clock("update"):  # 6. ppo epochs over shuffled mini-batches
            update_stats = self.update(rollout, step)
            if (d := self.cfg.ema_decay) is not None:  # bias-corrected as Adam's moments: the trained steps alone
                decay = d * (1 - d**step) / (1 - d ** (step + 1))  # 0 at step 0: the first trained weights
                get_ema_multi_avg_fn(decay)(self.average, [p.detach() for p in self.trained], None)
        # 7. adapt the KL coefficient to the mean sequence KL of the batch
        mean_kl = self.mean_over_processes(rollout.kl.sum(1).mean()).item()
        kl_coef = self.kl_ctl.value
        self.kl_ctl.update(mean_kl, self.cfg.batch_size)
        stats = self.rollout_stats(rollout, mean_kl, kl_coef) | update_stats
        stats |= {"time/update": clock.timings["update"], "ppo/skipped_batches": float(self.skipped_batches)}
        return StepResult(stats, rollout)

    def generate(self, query_ids: list[list[int]],
                 queries: list[str]) -> tuple[Samples, list[str], list[str]]:
        """Each prompt answered samples_per_prompt times in a row: (samples, the prompt of each, the responses)."""
        cfg = self.cfg
        # one length per prompt, shared by its k samples: with k = 1 the draws are those of one sample per prompt
        lengths = response_lengths(len(query_ids), cfg.response_min_tokens, cfg.response_max_tokens,
                                   self.length_generator)
        query_ids, queries, lengths = (repeat_each(x, cfg.samples_per_prompt) for x in (query_ids, queries, lengths))
        with self.autocast(), sharding.gathered(self.policy):
            samples = generate(self.policy.lm, self.tokenizer, query_ids, lengths, self.sampling, not self.sharded)
        if self.compiled:  # rollout and update alike see the compiled step's few shapes
            samples = ppo_update.static_layout(samples, cfg.response_max_tokens, self.tokenizer.pad_token_id)
        return samples, queries, decode_responses(self.tokenizer, samples)

    def score(self, samples: Samples, queries: list[str], responses: list[str], step: int) -> torch.Tensor | None:
        """(B,) scores after the EOS penalty and score scaling; None where ppo.nan_policy skips a NaN/inf score."""
        cfg = self.cfg
        raw_scores = self.scorer(queries, responses, samples.response_ids).to(self.device)
        if not (finite := torch.isfinite(raw_scores)).all():
            if cfg.nan_policy == "stop":
                raise ppo_update.nan_error(step, "score", "the reward scorer returned NaN/inf", int((~finite).sum()),
                                           finite.numel())
            return None
        scores = ppo.apply_missing_eos_penalty(raw_scores, samples.has_eos, cfg.missing_eos_penalty)
        return ppo.scale_scores(scores, self.score_moments, cfg.use_score_scaling, cfg.use_score_norm, cfg.score_clip)

    @torch.no_grad()
    def make_experience(self, samples: Samples, queries: list[str], responses: list[str],
                        scores: torch.Tensor) -> Rollout:
        """3-5 of the iteration: log-probs (and values) of policy and reference, per-token rewards, advantages."""
        cfg, kl_coef = self.cfg, self.kl_ctl.value
        exact = cfg.kl_penalty == "exact"
        full = exact or cfg.kl_penalty == "full"
        self.policy.eval()
        # full, exact: a sharded reference's head runs after its context, in the policy's forward: gathered till then
        with self.autocast(), sharding.gathered(self.ref_policy if full else None):
            with self.reference() as ref_model:  # full, exact: the reference's head runs in the policy's forward
                ref = reference_head_input(ref_model, samples, cfg.temperature) if full else None
                ref_logprobs = None if full else forward(ref_model, samples, cfg.temperature).logprobs
            out = forward(self.policy, samples, cfg.temperature, ref)
        if full:
            ref_logprobs = out.ref_logprobs
        masks = samples.response_mask
        kl = ppo.kl_penalty(out.logprobs, ref_logprobs, cfg.kl_penalty, out.kl) * masks
        # exact: a token's reward holds the KL it leads to; the KL at its own position is the update's loss term
        rewards, non_score_reward = ppo.compute_rewards(scores, ppo.next_position(kl, masks) if exact else kl, masks,
                                                        kl_coef)
        advantages, returns = ESTIMATORS[cfg.advantage_estimator].advantages(rewards, masks, out.values, cfg, kl_coef)
        experience = ppo.Experience(logprobs=out.logprobs, ref_logprobs=ref_logprobs, values=out.values,
                                    advantages=advantages, returns=returns, masks=masks)
        if exact:
            non_score_reward = -kl_coef * kl  # the stats' penalty: every position's KL
            scale = reward_scale(cfg.advantage_estimator, rewards, masks, out.values, returns, cfg.whiten_rewards)
            experience.ref_hidden, experience.kl_weights = ref.hidden, (kl_coef * scale).expand(len(scores))
        return Rollout(samples=samples, queries=queries, responses=responses, scores=scores, experience=experience,
                       rewards=rewards, non_score_reward=non_score_reward, kl=kl, entropy=out.entropy)

    def update(self, rollout: Rollout, step: int) -> dict[str, float]:
        """The update on ``rollout`` (``run_update``), compiled where ppo.compile compiles it, its first compiled use
        checked against the eager update on the same rollout and state (``CompiledStep.run``)."""
        if self.compiled_step is None:
            return self.run_update(rollout, step, compiled=False)
        return self.compiled_step.run(lambda compiled: self.run_update(rollout, step, compiled),
                                      ppo_update.update_numbers, lambda: saved_state(self.trained, self.optimizer))

    def run_update(self, rollout: Rollout, step: int, compiled: bool) -> dict[str, float]:
        """``ppo_epochs`` passes over shuffled minibatches, their step ``compiled`` or eager; gradients accumulate
        over micro-batches. Nothing in it
        waits for the device but its one read of the stats at the end (``ppo_update.UpdateLog.read``).

        An optimizer step whose every mini-batch was skipped (mean ratio above ppo.ratio_threshold) is not taken:
        weights and optimizer state stay as they were (Adam's momentum would otherwise still move the weights, as it
        does in TRL 0.11, which only zeroes the loss); nor is one with a NaN/inf gradient (ppo.nan_policy skip; stop
        stops at the read). ``policy/skipped_steps`` counts both.
        """
        cfg = self.cfg
        self.step_compiled = compiled
        self.wrapped_policy.train()
        B, micro, accumulate = len(rollout.scores), cfg.mini_batch_size, cfg.gradient_accumulation_steps
        # every epoch's permutation, drawn as before, goes to the device in one copy that does not wait
        orders = to_device(torch.stack([torch.randperm(B) for _ in range(cfg.ppo_epochs)]), self.device)
        stats = ppo_update.UpdateLog()
        with cuda_matmul_precision("tf32" if compiled and self.cuda_bf16 else None):
            for order in orders:
                for start in range(0, B, micro * accumulate):
                    group = []
                    for mb_start in range(start, start + micro * accumulate, micro):
                        loss, mb_stats = self.minibatch_loss(rollout, order[mb_start: mb_start + micro])
                        self.backward(loss / accumulate)
                        group.append(stats.add(mb_stats))
                    stats.add_step(*self.optimizer_step(stats, torch.stack(group)))
        self.wrapped_policy.eval()
        return stats.read(step, cfg.nan_policy)

    def minibatch_loss(self, rollout: Rollout, mb: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.step_compiled and self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the previous replay's outputs are logged (UpdateLog.add)
        loss_fn = self.step_fn(ppo_update.minibatch_loss)
        return loss_fn(self.wrapped_policy, rollout.samples, rollout.experience, mb, self.cfg, self.step_precision,
                       self.ref_head)

    def optimizer_step(self, stats: ppo_update.UpdateLog, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip and apply the gradients accumulated over the mini-batches whose stats are the rows of ``group``:
        (their norm, whether the step was dropped), both on the device (``ppo_update.drop_step``). A dropped step
        moves nothing: the fused AdamW skips it on its ``found_inf`` flag, as under GradScaler."""
        losses = stats.column(group, "loss/total")
        # every process must agree, or their weights would part: skipped only where all processes skipped
        skipped = self.mean_over_processes(stats.column(group, "policy/skipped").min()) == 1
        if self.accelerator is not None and (self.sharded or self.cfg.max_grad_norm is not None):
            norm = sharding.clip_gradients(self.trained, self.cfg.max_grad_norm)  # the norm over every process's
            dropped = ppo_update.drop_step(norm, losses, skipped)
        else:
            clip = self.step_fn(ppo_update.clip_gradients)
            norm, dropped = clip(self.trained, self.cfg.max_grad_norm, losses, skipped)
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wraps torch's
        skip_step_if(optimizer, dropped.float())
        with sharding.scalars_replicated():
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=not self.compiled)
        return norm, dropped

    # --- helpers ---------------------------------------------------------------------------------------------------

    def set_learning_rate(self, step: int) -> float:
        """The schedule's learning rates for iteration ``step``, a function of it alone (a resumed run needs no state),
        written into each parameter group's device tensor that the optimizer step reads; the policy's returned."""
        cfg = self.cfg
        factor = lr_factor(step, min(cfg.warmup_steps, cfg.steps), cfg.steps, cfg.lr_decay)
        for group in getattr(self.optimizer, "optimizer", self.optimizer).param_groups:
            group["lr"].fill_(group["base_lr"] * factor)
        return cfg.learning_rate * factor

    def backward(self, loss: torch.Tensor) -> None:
        if self.accelerator is not None and not self.sharded:
            self.accelerator.backward(loss)
        else:
            loss.backward()

    def averaged(self) -> contextlib.AbstractContextManager:
        """The policy with its averaged weights (ppo.ema_decay) in place of the trained ones; without an average, the
        policy as it is."""
        return ppo_update.weights_in(self.trained, self.average)

    @contextlib.contextmanager
    def reference(self) -> Iterator[PreTrainedModel]:
        """The frozen reference: ``ref_policy``, or the policy's LM with its adapters off inside the block."""
        with (sharding.gathered(self.ref_policy or self.policy),
              contextlib.nullcontext(self.ref_policy) if self.ref_policy else adapters_disabled(self.policy.lm) as lm):
            yield lm

    def autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.device, self.precision)

    def mean_over_processes(self, x: torch.Tensor) -> torch.Tensor:
        if self.accelerator is not None:
            x = self.accelerator.reduce(x.detach(), reduction="mean")
        return x

    def rollout_stats(self, rollout: Rollout, mean_kl: float, kl_coef: float) -> dict[str, float]:
        """The batch's stats. Those named like TRL 0.11's mean what TRL's mean: ``objective/entropy`` is the mean
        over samples of the sequence's summed -logprob (a one-sample estimate of the sequence entropy), and
        ``objective/non_score_reward`` the mean over samples of the summed KL penalty (PPOv2Trainer's; the legacy
        trainer's ``ppo/mean_non_score_reward``, a per-token mean, is this / ``tokens/response_length``).
        ``objective/token_entropy`` is the exact entropy of the rollout policy, averaged over the real tokens."""
        mask, scores = rollout.masks, rollout.scores
        return {
            "objective/scores": scores.mean().item(),
            "objective/scores_std": scores.std().item() if len(scores) > 1 else 0.0,
            "objective/kl": mean_kl,
            "objective/kl_coef": kl_coef,
            "objective/non_score_reward": rollout.non_score_reward.sum(1).mean().item(),
            "objective/entropy": (-rollout.experience.logprobs * mask).sum(1).mean().item(),
            "objective/token_entropy": ppo.masked_mean(rollout.entropy, mask).item(),
            "val/num_eos_tokens": rollout.samples.has_eos.sum().item(),
            "tokens/response_length": mask.sum(1).float().mean().item(),
        }

