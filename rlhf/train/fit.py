"""The one supervised training loop (sft and reward): AdamW, linear warmup + cosine decay, gradient clipping, a NaN/inf
stop naming the param to lower, a progress bar, and checkpoints every N steps that a rerun after a kill resumes from
to the same result (see rlhf/train/checkpoint.py).

The caller supplies the model, its optimizer param groups, the loss of a batch of indices and the resumable order
those batches come in (rlhf/train/batches.py); a checkpoint holds the weights, optimizer, schedule, every global RNG
and the order's state, so a resumed run draws the same batches and the same dropout masks.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import ParamsT
from tqdm import tqdm

from rlhf.pipeline.errors import PipelineError, TrainingError, interrupted_at
from rlhf.pipeline.paths import checkpoint_dir
from rlhf.train import checkpoint, rng
from rlhf.train.batches import Batches

log = logging.getLogger(__name__)

LOSS_WINDOW = 20  # steps averaged in the progress bar
# steps whose losses are read from the device at once (and checked for NaN/inf): reading one waits for the GPU to
# finish that step, so a read every step would keep the host from queuing the next step's kernels meanwhile
READ_EVERY = 20
STATE_KEYS = ("losses", "seconds", "data", "rng")  # what a resume reads from a checkpoint's state.json


@dataclass(frozen=True)
class FitPlan:
    """How to train; ``section`` is the params section the values come from ('sft', 'reward'): messages name its
    keys, and its checkpoints live in data/checkpoints/<section>/."""

    section: str
    steps: int
    learning_rate: float
    warmup_steps: int  # the schedule warms up over min(warmup_steps, steps // 2) steps
    max_grad_norm: float
    accumulation_steps: int = 1  # micro-batches per optimizer step
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW's
    checkpoint_every: int | None = None
    fingerprint: str | None = None  # what determines the run (checkpoint.fingerprint); None: no checkpoints


@dataclass
class FitResult:
    losses: list[float]  # one per step: the loss of its last micro-batch
    seconds: float  # wall time, the time before a resume included


def fit(model: torch.nn.Module, param_groups: ParamsT,
        loss_fn: Callable[[torch.Tensor], torch.Tensor], batches: Batches, plan: FitPlan,
        after_step: Callable[[int], None] | None = None) -> FitResult:
    """Train ``model`` for ``plan.steps`` optimizer steps, each over ``plan.accumulation_steps`` micro-batches of
    indices from ``batches``; resume from this run's newest checkpoint if there is one. ``param_groups``: the
    parameters, or torch's per-group dicts (e.g. weight decay for some only). ``after_step(step)`` runs after each
    optimizer step (curves, held-out evaluation); after a resume it runs again for the steps past the checkpoint."""
    # fused: one kernel over all parameters instead of a few passes over every tensor (as the PPO trainer)
    optimizer = torch.optim.AdamW(param_groups, lr=plan.learning_rate, betas=plan.betas, fused=True)
    schedule = warmup_cosine(optimizer, min(plan.warmup_steps, plan.steps // 2), plan.steps)
    folder = checkpoint_dir(plan.section)
    losses, earlier = [], 0.0
    found = resume(folder, plan, model, optimizer, schedule) if plan.fingerprint else None
    if found is not None:
        losses, earlier = found.state["losses"], found.state["seconds"]
        batches.load_state_dict(found.state["data"])
    model.train()
    first, start = len(losses), time.perf_counter()
    bar = tqdm(range(first, plan.steps), desc=plan.section, initial=first, total=plan.steps)
    pending: list[torch.Tensor] = []  # the losses of the steps since the last read, still on the device
    step = first  # the step a Ctrl-C names
    with interrupted_at(lambda: step):
        for step in bar:
            loss = None
            for _ in range(plan.accumulation_steps):
                micro = loss_fn(next(batches))
                (micro / plan.accumulation_steps).backward()
                # the last micro-batch's loss, unless an earlier one's was NaN/inf: then that one, for the read to see
                loss = micro.detach() if loss is None else torch.where(torch.isfinite(loss), micro.detach(), loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), plan.max_grad_norm)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            pending.append(loss)
            # the last step's too: a rerun of a finished run (one DVC never recorded) ends at once
            checkpoint_due = bool(plan.fingerprint) and ((step + 1) % plan.checkpoint_every == 0
                                                         or step + 1 == plan.steps)
            if len(pending) == READ_EVERY or checkpoint_due or step + 1 == plan.steps:
                losses += read_losses(pending, step + 1 - len(pending), plan.section)
                pending = []
                bar.set_postfix(loss=f"{sum(losses[-LOSS_WINDOW:]) / len(losses[-LOSS_WINDOW:]):.3f}")
            if after_step is not None:
                after_step(step)
            if checkpoint_due:
                save(folder, plan, step, model, optimizer, schedule, {
                    "losses": losses, "seconds": earlier + time.perf_counter() - start, "data": batches.state_dict()})
                if why := checkpoint.stop_reason(plan.section, step):
                    raise PipelineError(why)
    return FitResult(losses, earlier + time.perf_counter() - start)


def read_losses(pending: list[torch.Tensor], first: int, section: str) -> list[float]:
    """The losses of steps ``first``, ``first + 1``, ... in one read from the device; a NaN/inf one stops training,
    naming its step (the steps after it trained on, but nothing of theirs is kept: no checkpoint is written unread)."""
    values = torch.stack(pending).tolist()
    for step, value in enumerate(values, first):
        if not math.isfinite(value):
            raise TrainingError(f"step {step}: {section} loss is NaN/inf (lower {section}.learning_rate)")
    return values


def save(folder: Path, plan: FitPlan, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         schedule: torch.optim.lr_scheduler.LRScheduler, state: dict[str, Any]) -> None:
    """Checkpoint after ``step``: weights, optimizer and schedule, the global RNGs, and the loop's own ``state``."""
    checkpoint.save(folder, step, model, {"optimizer": optimizer.state_dict(), "schedule": schedule.state_dict()},
                    {"fingerprint": plan.fingerprint, "rng": rng.rng_states({}), **state}, {})


def resume(folder: Path, plan: FitPlan, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           schedule: torch.optim.lr_scheduler.LRScheduler) -> checkpoint.Checkpoint | None:
    """Load this run's newest checkpoint into the model, optimizer, schedule and global RNGs (None: start at step 0).
    The disk is checked first, naming the checkpoint key: a checkpoint is written before the previous one goes."""
    checkpoint.check_room_for_checkpoints(folder, checkpoint.checkpoint_bytes(model),
                                          f"{plan.section}.checkpoint_every", plan.fingerprint)
    found = checkpoint.find(folder, plan.fingerprint, required=STATE_KEYS, steps=plan.steps)
    if found is None:
        return None
    checkpoint.load_weights(found, model)
    state = checkpoint.load_optimizer_state(found)
    optimizer.load_state_dict(state["optimizer"])
    schedule.load_state_dict(state["schedule"])
    rng.set_rng_states(found.state["rng"], {})
    log.info("%s: resuming after step %d from %s", plan.section, found.step, found.path)
    return found


def lr_factor(step: int, warmup_steps: int, total_steps: int, decay: str = "cosine", floor: float = 0.0) -> float:
    """The learning rate of step ``step`` (from 0) as a factor of the peak: linear warmup over ``warmup_steps``, then
    ``decay`` (constant, linear or cosine) to ``floor`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    shape = {"constant": 1.0, "linear": 1 - progress, "cosine": 0.5 * (1 + math.cos(math.pi * progress))}[decay]
    return floor + (1 - floor) * shape


def warmup_cosine(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                  floor: float = 0.1) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the base LR, then cosine decay to ``floor`` x base LR at ``total_steps``."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup_steps, total_steps, "cosine", floor))
