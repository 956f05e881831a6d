"""Step 6 of a PPO iteration, the update, as work the device runs without waiting for the host.

Each optimizer step is decided on the device: one whose every mini-batch was skipped, or whose loss or gradient is
NaN/inf, is dropped by the fused AdamW's own switch (``found_inf``, GradScaler's), which leaves weights and optimizer
state as they were. Every statistic stays on the device until ``UpdateLog.read``, the update's one host read, where a
NaN/inf loss or gradient stops the run.

With ppo.compile the mini-batch loss (forward of policy and value, the losses; its backward compiled with it) and the
gradient clipping each run as one torch.compile graph with no break, on CUDA replayed as CUDA graphs (mode
reduce-overhead). Their shapes are static: every batch is padded to one layout (``static_layout``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from rlhf.models.precision import autocast
from rlhf.models.rollout import Samples, forward
from rlhf.pipeline.errors import TrainingError
from rlhf.pipeline.ppo_params import PpoParams
from rlhf.rl import ppo
from rlhf.rl.logprobs import Reference

PROMPT_BUCKET = 8  # compiled: prompts left-padded to a multiple of this many tokens, so a few shapes compile in all

F = TypeVar("F", bound=Callable)


def compiled(fn: F, device: torch.device) -> F:
    """``fn`` under torch.compile as one graph (fullgraph: a break is an error), for static shapes; on CUDA in mode
    reduce-overhead, which replays it as a CUDA graph: the update at these sizes is bound by kernel launches."""
    mode = "reduce-overhead" if device.type == "cuda" else None
    return torch.compile(fn, fullgraph=True, dynamic=False, mode=mode)


def static_layout(samples: Samples, response_tokens: int, pad_id: int) -> Samples:
    """``samples`` with the prompts left-padded to a multiple of PROMPT_BUCKET and the responses right-padded to
    ``response_tokens`` (ppo.response_max_tokens): the compiled step sees a few shapes, not one per batch."""
    P = samples.context_length
    return samples.padded(-(-P // PROMPT_BUCKET) * PROMPT_BUCKET, response_tokens, pad_id)


def minibatch_loss(policy: torch.nn.Module, samples: Samples, experience: ppo.Experience, mb: torch.Tensor,
                   cfg: PpoParams, precision: str,
                   ref_head: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO loss of the rows ``mb`` of a rollout under the current ``policy``, and its stats (detached 0-dim
    tensors). ``precision``: model.precision resolved, 'bf16' or 'fp32' (its auto probes the CPU, which
    torch.compile cannot trace). ``ref_head``: the reference's LM head at ppo.temperature, for the exact KL of
    ppo.kl_penalty exact on the rollout's ``ref_hidden``."""
    old = experience[mb]
    ref = None if old.ref_hidden is None else Reference(ref_head, old.ref_hidden)
    with autocast(mb.device, precision):
        out = forward(policy, samples[mb], cfg.temperature, ref)
    loss, stats = ppo.ppo_loss(out.logprobs, out.values, old, cfg, out.kl)
    stats["policy/entropy"] = ppo.masked_mean(out.entropy, old.masks)
    # TRL 0.11's ppo/val/mean and ppo/returns/mean: the mean over mini-batches of each one's masked mean
    if old.values is not None:
        stats["val/mean"] = ppo.masked_mean(old.values, old.masks)
    if old.returns is not None:
        stats["val/returns"] = ppo.masked_mean(old.returns, old.masks)
    return loss, stats


def drop_step(norm: torch.Tensor, losses: torch.Tensor, skipped: torch.Tensor) -> torch.Tensor:
    """Whether an optimizer step is dropped (a 0-dim bool on the device): every mini-batch of it ``skipped``, or a
    NaN/inf loss or gradient ``norm``."""
    return skipped | ~torch.isfinite(norm) | ~torch.isfinite(losses).all()


def clip_gradients(params: list[torch.Tensor], max_grad_norm: float | None, losses: torch.Tensor,
                   skipped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale the gradients of ``params`` to a global L2 norm of at most ``max_grad_norm`` (None: unscaled, as
    clipping by inf would still rescale them): (their norm before, ``drop_step``'s verdict)."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if max_grad_norm is not None:
        torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norm)
    return norm, drop_step(norm, losses, skipped)


def update_numbers(stats: dict[str, float]) -> dict[str, float]:
    """What a compiled update's first use is checked on (rlhf/train/compiled.py): its losses and gradient norm."""
    return {k: v for k, v in stats.items() if k.startswith("loss/") or k == "policy/grad_norm"}


def nan_error(step: int, quantity: str, what: str, bad: int, total: int, always_stop: bool = False) -> TrainingError:
    """The error that stops a run at a NaN/inf ``quantity``: ``bad`` of ``total`` values at iteration ``step``.
    ``always_stop``: ppo.nan_policy skip does not skip it, so the message does not advise it."""
    advice = ("it stops whatever ppo.nan_policy says: lower ppo.learning_rate" if always_stop
              else "set ppo.nan_policy: skip to skip such batches")
    return TrainingError(f"step {step}: {quantity}: {what} ({bad} of {total} values); {advice}")


@dataclass
class UpdateLog:
    """The update's stats where the device keeps them: one row per mini-batch (its ``minibatch_loss`` stats, in the
    order of ``keys``), one per optimizer step (its gradient norm, 1 where it was dropped). Each row is a fresh
    tensor: a CUDA graph's outputs are overwritten by its next replay."""

    keys: list[str] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)
    steps: list[torch.Tensor] = field(default_factory=list)

    def add(self, stats: dict[str, torch.Tensor]) -> torch.Tensor:
        """Log a mini-batch's stats; its row."""
        self.keys = list(stats)
        self.rows.append(torch.stack([x.float() for x in stats.values()]))
        return self.rows[-1]

    def add_step(self, norm: torch.Tensor, dropped: torch.Tensor) -> None:
        self.steps.append(torch.stack([norm.float(), dropped.float()]))

    def column(self, rows: torch.Tensor, key: str) -> torch.Tensor:
        return rows[..., self.keys.index(key)]

    def read(self, step: int, nan_policy: str) -> dict[str, float]:
        """The update's stats, read from the device in one transfer: the mean of each mini-batch stat,
        ``policy/ratio_max``, ``policy/skipped_steps`` (the dropped optimizer steps) and ``policy/grad_norm`` (the
        mean norm of the steps taken; 0.0 where none was). A NaN/inf loss stops the run (TrainingError); so does a
        NaN/inf gradient, unless ``nan_policy`` is skip (its step was dropped)."""
        table = torch.stack(self.rows)  # (mini-batches, keys)
        losses, ratio_max = self.column(table, "loss/total"), self.column(table, "val/ratio_max").max()
        steps = torch.stack(self.steps).T  # (2, optimizer steps): norms, dropped
        read = torch.cat([table.mean(0), ratio_max[None], losses, steps.flatten()]).tolist()  # the one wait
        n_keys, n_mb, n_steps = len(self.keys), len(losses), len(self.steps)
        mean = dict(zip(self.keys, read[:n_keys], strict=True)) | {"policy/ratio_max": read[n_keys]}
        losses_read = read[n_keys + 1: n_keys + 1 + n_mb]
        norms, dropped = read[-2 * n_steps: -n_steps], read[-n_steps:]
        if bad := sum(not math.isfinite(x) for x in losses_read):
            raise nan_error(step, "loss/total", "the PPO loss is NaN/inf", bad, n_mb, always_stop=True)
        if (bad := sum(not math.isfinite(x) for x in norms)) and nan_policy == "stop":
            raise nan_error(step, "policy/grad_norm", "a gradient is NaN/inf", bad, n_steps)
        applied = [norm for norm, drop in zip(norms, dropped, strict=True) if not drop]
        mean["policy/skipped_steps"] = float(n_steps - len(applied))
        mean["policy/grad_norm"] = sum(applied) / len(applied) if applied else 0.0  # none applied
        return mean


@contextlib.contextmanager
def weights_in(params: list[torch.Tensor], weights: list[torch.Tensor] | None) -> Iterator[None]:
    """``weights`` copied into ``params`` inside the block, the params' own copied back after (copied, not swapped: a
    compiled step's CUDA graphs hold their addresses); None: the params as they are."""
    pairs = list(zip(params, weights, strict=True)) if weights is not None else []
    held = [p.detach().clone() for p, _ in pairs]
    with torch.no_grad():
        for p, weight in pairs:
            p.copy_(weight)
    try:
        yield
    finally:
        with torch.no_grad():
            for (p, _), weight in zip(pairs, held, strict=True):
                p.copy_(weight)
