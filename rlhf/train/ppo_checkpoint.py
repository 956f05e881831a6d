"""Checkpoints of a PPO run: what identifies the run, what a checkpoint holds, finding and restoring one.

The ppo stage saves one every ``ppo.checkpoint_every`` steps, right after a rollout-log flush, so the copies of the
staged rollout log and curves it keeps match the trainer's state (the format is in rlhf/train/checkpoint.py); a
resumed run puts them back into the staging.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf.models.loading import initial_policy
from rlhf.models.policy import PolicyWithValueHead
from rlhf.models.scorers import reward_model_path
from rlhf.pipeline.params import Params
from rlhf.pipeline.paths import PPO_CURVES, ROLLOUTS_DIR, TRAIN_PROMPTS, checkpoint_dir, staging_path
from rlhf.train import checkpoint, rng
from rlhf.train.batches import Batches
from rlhf.train.ppo_trainer import PPOTrainer

if TYPE_CHECKING:
    from accelerate import Accelerator


STATE_KEYS = ("trainer", "data", "rng", "live_step", "last_stats")  # what a resume reads from state.json


def run_fingerprint(params: Params, processes: int) -> str:
    """What determines a PPO run: the params the stage reads, its input files, the number of processes."""
    # nan_policy is left out: a run under "stop" has met no NaN before its last checkpoint, so after a NaN stop,
    # switching to "skip" resumes from that checkpoint instead of step 0
    initial = initial_policy(params)
    inputs = [TRAIN_PROMPTS, initial.path, initial.tokenizer]
    if (reward := reward_model_path(params)[0]) is not None:  # none: the reward functions alone (code deps)
        inputs.append(reward)
    return checkpoint.fingerprint("ppo", params, inputs,
                                  exclude=("ppo.nan_policy",), extra={"processes": processes})


@dataclass
class Checkpointing:
    """Where the ppo stage checkpoints, the run's fingerprint, and the staged outputs a checkpoint keeps copies of."""

    fingerprint: str
    folder: Path = dataclasses.field(default_factory=lambda: checkpoint_dir("ppo"))
    files: dict[str, Path] = dataclasses.field(default_factory=lambda: {"rollouts": staging_path(ROLLOUTS_DIR),
                                                                        "curves": staging_path(PPO_CURVES)})

    def save(self, step: int, trainer: PPOTrainer, order: Batches, live_step: int, last: dict[str, float],
             accelerator: Accelerator) -> None:
        """Every process contributes its RNG states; the main process writes."""
        from accelerate.utils import gather_object

        states = [rng.rng_states({"length": trainer.length_generator})]
        if accelerator.num_processes > 1:
            states = gather_object(states)
        if not accelerator.is_main_process:
            return
        state = trainer.state_dict()
        optimizer_state = state.pop("optimizer")
        checkpoint.save(self.folder, step, trainer.policy, optimizer_state,
                        {"fingerprint": self.fingerprint, "trainer": state, "data": order.state_dict(), "rng": states,
                         "live_step": live_step, "last_stats": last}, self.files)

    def stop_if_dvc_gone(self, step: int, accelerator: Accelerator) -> None:
        """After a save: stop, every process alike, when the dvc that started the stage has exited
        (checkpoint.dvc_gone)."""
        from accelerate.utils import gather_object

        gone = [checkpoint.dvc_gone()]
        if accelerator.num_processes > 1:
            gone = gather_object(gone)
        checkpoint.stop_if_dvc_gone("ppo", step, next((pid for pid in gone if pid is not None), None))

    def stop_if_params_changed(self, step: int, accelerator: Accelerator) -> None:
        """After a save: stop, every process alike, when params.yaml changed under the stage
        (checkpoint.params_changed): its outputs would be refused at the end."""
        from accelerate.utils import gather_object

        changes = [checkpoint.params_changed("ppo")]
        if accelerator.num_processes > 1:
            changes = gather_object(changes)
        checkpoint.stop_if_params_changed("ppo", step, next((change for change in changes if change), None))

    def restore(self, found: checkpoint.Checkpoint, trainer: PPOTrainer, order: Batches,
                accelerator: Accelerator) -> None:
        if accelerator.is_main_process:
            checkpoint.restore_files(found, self.files)
        checkpoint.load_weights(found, trainer.policy)
        trainer.load_state_dict({**found.state["trainer"], "optimizer": checkpoint.load_optimizer_state(found)})
        order.load_state_dict(found.state["data"])
        rng.set_rng_states(found.state["rng"][accelerator.process_index], {"length": trainer.length_generator})


def find_checkpoint(params: Params, policy: PolicyWithValueHead,
                    accelerator: Accelerator) -> tuple[Checkpointing | None, checkpoint.Checkpoint | None]:
    """The run's checkpointing (None when ppo.checkpoint_every is 0) and the checkpoint to resume from, if any."""
    if not params.ppo.checkpoint_every:
        return None, None
    ckpt = Checkpointing(run_fingerprint(params, accelerator.num_processes))
    if accelerator.is_main_process:
        checkpoint.check_room_for_checkpoints(ckpt.folder, checkpoint.checkpoint_bytes(policy),
                                              "ppo.checkpoint_every", ckpt.fingerprint)
        found = checkpoint.find(ckpt.folder, ckpt.fingerprint, True, STATE_KEYS, params.ppo.steps)
    accelerator.wait_for_everyone()  # the main process has pruned other runs' checkpoints
    if not accelerator.is_main_process:
        found = checkpoint.find(ckpt.folder, ckpt.fingerprint, False, STATE_KEYS, params.ppo.steps)
    return ckpt, found
