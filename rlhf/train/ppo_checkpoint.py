"""Checkpoints of a PPO run: what identifies the run, what a checkpoint holds, finding and restoring one.

The ppo stage saves one every ``ppo.checkpoint_every`` steps, right after a rollout-log flush, so the copies of the
staged rollout log and curves it keeps match the trainer's state (the format is in rlhf/train/checkpoint.py); a
resumed run puts them back into the staging.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rlhf.models.policy import PolicyWithValueHead
from rlhf.pipeline.errors import PipelineError
from rlhf.pipeline.io import remove
from rlhf.pipeline.params import Params
from rlhf.pipeline.paths import (
    CHECKPOINT_PREFIX,
    PPO_CURVES,
    ROLLOUTS_DIR,
    TRAIN_PROMPTS,
    checkpoint_dir,
    staging_path,
)
from rlhf.train import checkpoint, rng, sharding
from rlhf.train.batches import Batches
from rlhf.train.ppo_trainer import PPOTrainer

if TYPE_CHECKING:
    from accelerate import Accelerator


STATE_KEYS = ("trainer", "data", "rng", "live_step", "last_stats", "seconds")  # what a resume reads from state.json


def run_fingerprint(params: Params, models: list[str | None], processes: int) -> str:
    """What determines a PPO run: the params the stage reads, its input files (the prompts and ``models``: the
    policy's, its tokenizer's, the reward model's, where local), the number of processes."""
    # nan_policy is left out: a run under "stop" has met no NaN before its last checkpoint, so after a NaN stop,
    # switching to "skip" resumes from that checkpoint instead of step 0. compile too: the compiled and eager updates
    # train alike (a run's first-use check holds them to it), so a run stopped under one resumes under the other
    return checkpoint.fingerprint("ppo", params, [TRAIN_PROMPTS, *filter(None, models)],
                                  exclude=("ppo.nan_policy", "ppo.compile"), extra={"processes": processes})


@dataclass
class Checkpointing:
    """Where the ppo stage checkpoints, the run's fingerprint, the staged outputs a checkpoint keeps copies of, and
    when the run started (``start``: earlier by the training time a resumed checkpoint saw)."""

    fingerprint: str
    start: float = dataclasses.field(default_factory=time.perf_counter)
    folder: Path = dataclasses.field(default_factory=lambda: checkpoint_dir("ppo"))
    files: dict[str, Path] = dataclasses.field(default_factory=lambda: {"rollouts": staging_path(ROLLOUTS_DIR),
                                                                        "curves": staging_path(PPO_CURVES)})

    def save(self, step: int, trainer: PPOTrainer, order: Batches, live_step: int, last: dict[str, float],
             accelerator: Accelerator) -> None:
        """Every process contributes its RNG states (and, sharded, writes its shards); the main process writes the
        rest."""
        from accelerate.utils import gather_object

        states = [rng.rng_states({"length": trainer.length_generator})]
        if accelerator.num_processes > 1:
            states = gather_object(states)
        # named like a killed save's leftovers, which the next find removes
        shards = self.folder / f".{CHECKPOINT_PREFIX}{step:06d}.shards.tmp" if trainer.sharded else None
        if shards is not None:
            if accelerator.is_main_process:  # what a killed save left
                remove(shards)
            accelerator.wait_for_everyone()
            sharding.save(shards, trainer.policy, trainer.optimizer)  # returns once every process has written
        if not accelerator.is_main_process:
            return
        state = trainer_state(trainer)
        tensors = state.pop("tensors")
        checkpoint.save(self.folder, step, None if shards else trainer.policy, tensors,
                        {"fingerprint": self.fingerprint, "trainer": state, "data": order.state_dict(), "rng": states,
                         "live_step": live_step, "last_stats": last, "seconds": time.perf_counter() - self.start},
                        self.files, shards)

    def stop_if_due(self, step: int, accelerator: Accelerator) -> None:
        """After a save: stop, every process alike, where any has a reason to (``checkpoint.stop_reason``: its dvc
        exited, params.yaml changed)."""
        from accelerate.utils import gather_object

        reasons = [checkpoint.stop_reason("ppo", step)]
        if accelerator.num_processes > 1:
            reasons = gather_object(reasons)
        if why := next((reason for reason in reasons if reason), None):
            raise PipelineError(why)

    def restore(self, found: checkpoint.Checkpoint, trainer: PPOTrainer, order: Batches,
                accelerator: Accelerator) -> None:
        if accelerator.is_main_process:
            checkpoint.restore_files(found, self.files)
        tensors = None
        if trainer.sharded:
            sharding.load(found.path, trainer.policy, trainer.optimizer)
        else:
            checkpoint.load_weights(found, trainer.policy)
            tensors = checkpoint.load_optimizer_state(found)
        load_trainer_state(trainer, {**found.state["trainer"], "tensors": tensors})
        order.load_state_dict(found.state["data"])
        rng.set_rng_states(found.state["rng"][accelerator.process_index], {"length": trainer.length_generator})
        self.start -= found.state["seconds"]


def trainer_state(trainer: PPOTrainer) -> dict[str, object]:
    """What a resumed run needs of the trainer besides the weights and the RNG states; JSON-ready except ``tensors``:
    the optimizer's state and the averaged weights (ppo.ema_decay; None without), or None when sharded (DCP saves
    the optimizer's shards)."""
    tensors = {"optimizer": trainer.optimizer.state_dict(), "average": trainer.average}
    return {"tensors": None if trainer.sharded else tensors,
            "kl_ctl": trainer.kl_ctl.state_dict(), "score_moments": trainer.score_moments.state_dict(),
            "skipped_batches": trainer.skipped_batches}


def load_trainer_state(trainer: PPOTrainer, state: dict[str, object]) -> None:
    if (tensors := state["tensors"]) is not None:
        trainer.optimizer.load_state_dict(tensors["optimizer"])
        with torch.no_grad():
            for average, saved in zip(trainer.average or [], tensors["average"] or [], strict=True):
                average.copy_(saved)
    for group in trainer.optimizer.param_groups:  # the step reads its learning rate on the device
        group["lr"] = torch.as_tensor(group["lr"], device=trainer.device)
    trainer.kl_ctl.load_state_dict(state["kl_ctl"])
    trainer.score_moments.load_state_dict(state["score_moments"])
    trainer.skipped_batches = state["skipped_batches"]


def find_checkpoint(params: Params, models: list[str | None], policy: PolicyWithValueHead,
                    accelerator: Accelerator) -> tuple[Checkpointing | None, checkpoint.Checkpoint | None]:
    """The run's checkpointing (None when ppo.checkpoint_every is 0) and the checkpoint to resume from, if any."""
    if not params.ppo.checkpoint_every:
        return None, None
    ckpt = Checkpointing(run_fingerprint(params, models, accelerator.num_processes))
    if accelerator.is_main_process:
        needed = checkpoint.checkpoint_bytes(policy)
        if params.ppo.ema_decay is not None:  # and the averaged weights, a copy of the trained ones
            needed += sum(p.numel() * p.element_size() for p in checkpoint.trained_weights(policy).values())
        checkpoint.check_room_for_checkpoints(ckpt.folder, needed, "ppo.checkpoint_every", ckpt.fingerprint)
        found = checkpoint.find(ckpt.folder, ckpt.fingerprint, True, STATE_KEYS, params.ppo.steps)
    accelerator.wait_for_everyone()  # the main process has pruned other runs' checkpoints
    if not accelerator.is_main_process:
        found = checkpoint.find(ckpt.folder, ckpt.fingerprint, False, STATE_KEYS, params.ppo.steps)
    return ckpt, found
