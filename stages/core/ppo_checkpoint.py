"""Checkpoints of a PPO run: what identifies the run, what a checkpoint holds, finding and restoring one.

The ppo stage saves one every ``ppo.checkpoint_every`` steps, right after a rollout-log flush, so the copies of the
staged rollout log and curves it keeps match the trainer's state (the format is in stages/core/checkpoint.py); a
resumed run puts them back into the staging.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from stages.core import checkpoint
from stages.core.batches import Batches
from stages.core.modeling import initial_policy
from stages.core.params import Params, stage_params
from stages.core.paths import CHECKPOINTS_DIR, PPO_CURVES, ROLLOUTS_DIR, TRAIN_PROMPTS, staging_path
from stages.core.policy import PolicyWithValueHead
from stages.core.scorers import reward_model_path
from stages.core.trainer import PPOTrainer

if TYPE_CHECKING:
    from accelerate import Accelerator

CHECKPOINT_DIR = CHECKPOINTS_DIR / "ppo"


def run_fingerprint(params: Params, processes: int) -> str:
    """What determines a PPO run: the params the stage reads, its input files, the number of processes."""
    # nan_policy is left out: a run under "stop" has met no NaN before its last checkpoint, so after a NaN stop,
    # switching to "skip" resumes from that checkpoint instead of step 0
    config = stage_params(params, "ppo", exclude=("ppo.nan_policy",)) | {"processes": processes}
    policy, tokenizer, _ = initial_policy(params)
    return checkpoint.fingerprint(config, [TRAIN_PROMPTS, policy, tokenizer, reward_model_path(params)[0]])


@dataclass
class Checkpointing:
    """Where the ppo stage checkpoints, the run's fingerprint, and the staged outputs a checkpoint keeps copies of."""

    fingerprint: str
    folder: Path = CHECKPOINT_DIR
    files: dict[str, Path] = dataclasses.field(default_factory=lambda: {"rollouts": staging_path(ROLLOUTS_DIR),
                                                                        "curves": staging_path(PPO_CURVES)})

    def save(self, step: int, trainer: PPOTrainer, order: Batches, live_step: int, last: dict[str, float],
             accelerator: Accelerator) -> None:
        """Every process contributes its RNG states; the main process writes."""
        from accelerate.utils import gather_object

        rng = [checkpoint.rng_states({"length": trainer.length_generator})]
        if accelerator.num_processes > 1:
            rng = gather_object(rng)
        if not accelerator.is_main_process:
            return
        state = trainer.state_dict()
        optimizer_state = state.pop("optimizer")
        checkpoint.save(self.folder, step, trainer.policy, optimizer_state,
                        {"fingerprint": self.fingerprint, "trainer": state, "data": order.state_dict(), "rng": rng,
                         "live_step": live_step, "last_stats": last}, self.files)

    def restore(self, found: checkpoint.Checkpoint, trainer: PPOTrainer, order: Batches,
                accelerator: Accelerator) -> None:
        if accelerator.is_main_process:
            checkpoint.restore_files(found, self.files)
        checkpoint.load_weights(found, trainer.policy)
        trainer.load_state_dict({**found.state["trainer"], "optimizer": checkpoint.load_optimizer_state(found)})
        order.load_state_dict(found.state["data"])
        checkpoint.set_rng_states(found.state["rng"][accelerator.process_index], {"length": trainer.length_generator})


def find_checkpoint(params: Params, policy: PolicyWithValueHead,
                    accelerator: Accelerator) -> tuple[Checkpointing | None, checkpoint.Checkpoint | None]:
    """The run's checkpointing (None when ppo.checkpoint_every is 0) and the checkpoint to resume from, if any."""
    if not params.ppo.checkpoint_every:
        return None, None
    ckpt = Checkpointing(run_fingerprint(params, accelerator.num_processes))
    if accelerator.is_main_process:
        checkpoint.check_free_space(ckpt.folder, checkpoint.checkpoint_bytes(policy), "ppo.checkpoint_every",
                                    ckpt.fingerprint)
        found = checkpoint.find(ckpt.folder, ckpt.fingerprint, prune=True)
    accelerator.wait_for_everyone()  # the main process has pruned other runs' checkpoints
    if not accelerator.is_main_process:
        found = checkpoint.find(ckpt.folder, ckpt.fingerprint, prune=False)
    return ckpt, found
