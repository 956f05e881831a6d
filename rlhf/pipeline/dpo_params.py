"""The ``dpo:`` params section (method dpo: rlhf/train/dpo.py, stages/dpo.py and stages/sample_pairs.py). Declared
like every section (rlhf/pipeline/schema.py); its defaults are in params.yaml."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf.pipeline.sections import Section


class DpoParams(Section):
    loss: Literal["dpo", "ipo"]
    """dpo: -log sigmoid(beta h) (Rafailov et al. 2023), with label_smoothing the conservative cDPO; ipo:
    (h - 1 / (2 tau))^2 (Azar et al. 2023); h: the chosen minus the rejected log-ratio log pi / pi_ref."""
    beta: float = Field(gt=0)
    """DPO's KL coefficient: small lets the policy move far from the reference."""
    label_smoothing: float = Field(ge=0, lt=0.5)
    """cDPO: the probability that a pair's label is flipped (0: plain DPO; 0.5 would learn nothing)."""
    tau: float = Field(gt=0)
    """IPO's regularisation strength: the target log-ratio margin is 1 / (2 tau) nats per sequence."""
    pairs: Literal["prepare", "sampled"]
    """prepare: prepare's data/pairs (a positive against a negative review's opening, the reward model's pairs);
    sampled: samples_per_prompt completions per train prompt from the initial policy, ranked by the reward scorer
    (data/sampled_pairs, the DPO paper's IMDb setup)."""
    samples_per_prompt: int = Field(ge=2)
    """k: completions sampled per prompt for sampled pairs; every two with different scores make a pair (k = 4: up to
    6 pairs a prompt)."""
    sample_prompts: int | None = Field(gt=0)
    """Train prompts sampled for sampled pairs (the first ones; a tenth of them held out for test pairs); null: all."""
    learning_rate: float = Field(gt=0)
    """Peak AdamW learning rate (warmup, then cosine decay)."""
    batch_size: int = Field(gt=0)
    """Pairs per optimizer step."""
    epochs: int = Field(gt=0)
    """Shuffled passes over the training pairs."""
    max_length: int = Field(gt=0)
    """Token cap of prompt + response; responses are cut to fit."""
    warmup_steps: int = Field(ge=0)
    """Linear warmup steps (at most half of the steps)."""
    max_grad_norm: float = Field(gt=0)
    """Gradient-norm clip of each optimizer step."""
    checkpoint_every: int | None = Field(ge=0)
    """Optimizer steps per resumable checkpoint in data/checkpoints/dpo/ (a rerun after a kill resumes from the
    newest); 0 or null: off."""
