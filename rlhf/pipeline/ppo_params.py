"""The ``ppo:`` params section: PPO's schedule, KL control, advantage estimator (whose records, rlhf/rl/estimators.py's
``ESTIMATORS``, say what each needs), losses, score shaping and sampling."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhf.pipeline.section import Rule, Section, at_most
from rlhf.rl.estimators import ESTIMATORS


class PpoParams(Section):
    steps: int = Field(gt=0)
    """PPO iterations; each samples batch_size prompts (194 x 128 is one pass over the 24,895 train prompts)."""
    learning_rate: float = Field(gt=0)
    """Peak Adam learning rate of the policy (and, unless value_learning_rate, of the value head)."""
    value_learning_rate: float | None = Field(gt=0)
    """Peak Adam learning rate of the value head (and a separate or reward critic's body), on the same schedule;
    null: learning_rate. Adam moves each weight by about its rate whatever vf_coef is, so this rate, not vf_coef, sets
    how fast the head fits (docs/experiments.md: a faster head fit better, but brought PPO no nearer the optimum)."""
    warmup_steps: int = Field(ge=0)
    """Iterations of linear learning-rate warmup from learning_rate / warmup_steps."""
    lr_decay: Literal["constant", "linear", "cosine"]
    """The learning rate after the warmup: constant, or decaying (linearly, or as a half cosine) to 0 at the last
    iteration."""
    weight_decay: float = Field(ge=0)
    """Decoupled (AdamW) weight decay of every policy and value-head parameter; 0 is TRL's PPOTrainer (plain Adam)."""
    batch_size: int = Field(ge=2)
    """Samples per iteration, per process: batch_size / samples_per_prompt prompts, each answered samples_per_prompt
    times. At least 2: advantages are whitened over the batch's response tokens."""
    mini_batch_size: int = Field(gt=0)
    """Samples per forward/backward pass of the update."""
    gradient_accumulation_steps: int = Field(gt=0)
    """Mini-batches per optimizer step."""
    ppo_epochs: int = Field(gt=0)
    """Passes of the update over each batch."""
    init_kl_coef: float = Field(ge=0)
    """Initial (or, with adap_kl_ctrl false, fixed) coefficient of the KL penalty in the reward."""
    adap_kl_ctrl: bool
    """Adapt the KL coefficient towards target (Ziegler et al. 2019)."""
    target: float = Field(ge=0)
    """Adaptive KL controller's target KL (nats per sequence)."""
    horizon: float = Field(gt=0)
    """Adaptive KL controller's horizon, in samples."""
    advantage_estimator: Literal[tuple(ESTIMATORS)] = Field(  # type: ignore[valid-type]
        description="How advantages are computed (R: a sample's score plus its summed KL penalty). "
                    + ". ".join(f"{name}: {e.summary}" for name, e in ESTIMATORS.items()) + ".")
    samples_per_prompt: int = Field(gt=0)
    """k: responses sampled per prompt in a batch (at least what the estimator's baseline needs)."""
    kl_loss_coef: float = Field(ge=0)
    """grpo and dr_grpo: weight of GRPO's k3 KL(policy || reference) loss term (the paper: 0.04, with init_kl_coef 0
    and adap_kl_ctrl false); 0: off."""
    gamma: float = Field(ge=0, le=1)
    """Discount of GAE and of REINFORCE++'s returns."""
    lam: float = Field(ge=0, le=1)
    """Lambda of GAE."""
    cliprange: float = Field(gt=0)
    """Clip range of the policy ratio."""
    cliprange_value: float = Field(gt=0)
    """Clip range of the value prediction around its rollout value."""
    vf_coef: float = Field(ge=0)
    """Weight of the value loss."""
    kl_penalty: Literal["kl", "abs", "mse", "full", "k3", "exact"]
    """Per-token KL estimate in the reward: kl (k1, log-ratio), abs, mse (k2), k3, or full (exact over the vocab: a
    function of the prefix, not of the sampled token, so it barely holds the KL; docs/experiments.md). exact: the
    exact KL's gradient, its term at each position as a loss, the KL of the positions after a token in its reward."""
    whiten_rewards: bool
    """Scale the per-token rewards to unit std over the batch, their mean kept (TRL's whiten_rewards), before GAE; the
    offline-cpu preset turns it on: PPO then nears the optimum (docs/experiments.md)."""
    ratio_threshold: float = Field(gt=0)
    """Skip a mini-batch whose mean probability ratio exceeds this (its loss counts 0); an optimizer step whose every
    mini-batch is skipped is not taken (policy/skipped_steps)."""
    max_grad_norm: float | None = Field(gt=0)
    """Gradient-norm clip of each optimizer step (null: no clipping; the norm is still logged)."""
    ema_decay: float | None = Field(gt=0, lt=1)
    """The policy written (models/policy) and measured on the pool's prompts (the objective curve) is an exponential
    moving average of the trained weights, w <- d w + (1 - d) w_trained after each step (Polyak averaging: it keeps
    the trend and averages out the steps' noise), bias-corrected as Adam's moments are: after t steps the weights of
    step s weigh d^(t-s) (1 - d) / (1 - d^t), so the initial weights weigh nothing and an early average does not lag
    towards them. The rollouts still sample the trained weights. null: the trained weights themselves. Not with
    ppo.shard."""
    use_score_scaling: bool
    """Divide scores by their running standard deviation."""
    use_score_norm: bool
    """With use_score_scaling, also subtract their running mean."""
    score_clip: float | None = Field(gt=0)
    """Clip the (scaled) scores to [-score_clip, score_clip] (null: off)."""
    missing_eos_penalty: float | None = Field(ge=0)
    """Subtracted from the score of a response that has no EOS token (null: off)."""
    response_min_tokens: int = Field(gt=0)
    """Shortest response; each prompt's length is drawn uniformly from [min, max]."""
    response_max_tokens: int = Field(gt=0)
    """Longest response, in tokens."""
    top_k: int = Field(ge=0)
    """Sampling: keep the k most likely tokens (0: all)."""
    top_p: float = Field(gt=0, le=1)
    """Sampling: nucleus probability mass (1: all)."""
    temperature: float = Field(ge=0.01)
    """Sampling temperature (log-probabilities are taken at the same temperature); below 0.01 logits / temperature
    lose their precision (top_k: 1 samples greedily)."""
    disable_dropout: bool
    """Switch dropout off in the policy and the reference."""
    value_model: Literal["shared", "detached", "separate", "reward"]
    """'shared': a value head on the policy's backbone, both losses training it; 'detached': the same head, its loss
    training the head alone; 'separate': a critic initialised from the policy; 'reward': a critic initialised from
    the trained reward model (reward.train), its score head the value head's start (gae only)."""
    checkpoint_every: int | None = Field(ge=0)
    """Steps per rollout-log file and per resumable checkpoint in data/checkpoints/ppo/ (a rerun after a kill
    resumes from the newest). 0 or null: no checkpoints, rollout files of 10 steps."""
    compile: bool | Literal["auto"]
    """torch.compile the update's step (the forward of policy and value, the loss and its backward, the clipping), on
    CUDA replayed as CUDA graphs, every batch padded to one shape: true, false, or auto: on CUDA only. Single-process
    only (auto runs an accelerate launch eagerly); the same losses and weights to float rounding, its first use checked
    against the eager update: where it fails or differs, auto runs eagerly, true stops (docs/gpu.md)."""
    nan_policy: Literal["stop", "skip"]
    """On a NaN/inf score, loss or gradient: stop with a message, or skip the batch and count it. A run whose first 10
    steps (or all its steps, if fewer) are all skipped stops there: its policy, never updated, would go on scoring
    NaN/inf."""

    shard: bool
    """Shard the policy, its value head or critic and the reference over the launcher's processes (FSDP2's
    fully_shard, a unit per transformer block): each process holds 1/N of the weights, gradients and optimizer state
    (docs/gpu.md). Needs several processes (torchrun or accelerate launch); false: each process holds a whole copy
    (data-parallel)."""

    @model_validator(mode="after")
    def _rules(self) -> PpoParams:
        at_most(self, "response_min_tokens", "response_max_tokens", "ppo")
        step = self.mini_batch_size * self.gradient_accumulation_steps
        if self.batch_size % step:
            raise Rule("batch_size", f"must be a multiple of ppo.mini_batch_size x ppo.gradient_accumulation_steps "
                                     f"({step})", self.batch_size)
        name, k, estimator = self.advantage_estimator, self.samples_per_prompt, ESTIMATORS[self.advantage_estimator]
        if k < estimator.min_samples_per_prompt:
            raise Rule("samples_per_prompt", f"must be >= {estimator.min_samples_per_prompt} with "
                                             f"ppo.advantage_estimator {name} (its baseline is the prompt's other "
                                             "samples)", k)
        if self.batch_size % k:
            raise Rule("batch_size", f"must be a multiple of ppo.samples_per_prompt ({k})", self.batch_size)
        if self.kl_loss_coef > 0 and not estimator.kl_loss:
            raise Rule("kl_loss_coef", f"must be 0 with ppo.advantage_estimator {name} (a KL loss term is GRPO's; "
                                       "the others keep the KL penalty in the reward: ppo.init_kl_coef)",
                       self.kl_loss_coef)
        if estimator.needs_kl_coef and self.init_kl_coef <= 0:
            raise Rule("init_kl_coef", f"must be > 0 with ppo.advantage_estimator {name} (its weights are exp(R / "
                                       "kl_coef))", self.init_kl_coef)
        if estimator.needs_kl_coef and self.kl_penalty != "kl":
            raise Rule("kl_penalty", f"must be kl with ppo.advantage_estimator {name} (only k1's summed log-ratio "
                                     "makes R / kl_coef the sample's log importance weight)", self.kl_penalty)
        if self.kl_penalty == "exact" and not estimator.reward_units:
            raise Rule("kl_penalty", f"exact needs an estimator whose advantages keep one scale of the rewards (not "
                                     f"{name})", self.kl_penalty)
        if self.kl_penalty == "exact" and self.shard:
            raise Rule("kl_penalty", "exact is not run with ppo.shard: true (every mini-batch would gather the "
                                     "reference's head)", self.kl_penalty)
        if self.ema_decay is not None and self.shard:
            raise Rule("ema_decay", "must be null with ppo.shard: true (the average is not sharded)", self.ema_decay)
        if self.value_model in ("separate", "reward") and not estimator.trains_critic:
            raise Rule("value_model", f"must be 'shared' with ppo.advantage_estimator {name}, which trains no "
                                      "critic (a separate critic would never be used)", self.value_model)
        return self

    @property
    def prompts_per_step(self) -> int:
        return self.batch_size // self.samples_per_prompt

    @property
    def critic(self) -> Literal["shared", "detached", "separate", "reward"] | None:
        """The value model to train: value_model where the estimator trains a critic, else None."""
        return self.value_model if ESTIMATORS[self.advantage_estimator].trains_critic else None

    @property
    def unused_keys(self) -> list[str]:
        """The ppo.* keys that the estimator leaves unused (the stage logs them once)."""
        return [f"ppo.{key}" for key in ESTIMATORS[self.advantage_estimator].unused_keys]
