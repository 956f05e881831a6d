"""ppo: PPO against the reward scorer, from the initial policy (models/sft or model.policy).

Reads   data/prompts/train.parquet, the initial policy and reference (models/sft when sft.enabled, else
        model.policy), the reward (models/reward when reward.train, else reward.model, plus reward.functions), and
        with optimum.samples_per_prompt > 0 the optimum's pool and data/prompts/eval.parquet (the curve below)
Writes  models/policy/          the trained LM + tokenizer (AutoModelForCausalLM), value_head.safetensors beside it
                                (gae only: the other estimators train no value head); when method is not ppo, only
                                DISABLED markers here, in data/rollouts/ and in metrics/ppo/
        data/rollouts/*.parquet one row per sample per step
        metrics/ppo/            DVCLive curves (reward, KL, kl_coef, losses, clip fractions, throughput), and
                                system.csv: CPU, memory and GPU use while training (rlhf/train/system_use.py); with
                                a pool, at every rollout-log flush the objective's share of the optimum's gain on
                                the pool's prompts (optimum/objective_fraction, optimum/kl, and optimum/samples
                                trained on: rlhf/eval/objective.py)
        metrics/ppo.json        summary
The outputs are written under staging siblings (the rollout chunks and curves as the run goes) and replaced together
when the stage completes, or not at all (rlhf/pipeline/io.py's StagedOutputs).

With ppo.checkpoint_every > 0 the run saves a checkpoint at every rollout-log flush, with copies of the staged rollout
chunks and curves, and, rerun after a kill, resumes from the newest one (see rlhf/train/checkpoint.py).

ppo.advantage_estimator picks the advantages: gae (PPO with a value head) or a critic-free estimator (the records
in rlhf/rl/estimators.py, listed below); each step draws ppo.batch_size / ppo.samples_per_prompt prompts and answers
each samples_per_prompt times.

Multi-process: ``accelerate launch --num_processes N -m stages.ppo`` on GPUs, ``torchrun --nproc_per_node N -m
stages.ppo`` on CPU (each process samples ppo.batch_size responses); with ppo.shard the models are sharded over the
processes (FSDP2, rlhf/train/sharding.py), else each holds a whole copy (docs/gpu.md).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf.pipeline.cli import run_stage
from rlhf.pipeline.errors import DataError, ModelError, ParamsError, TrainingError, interrupted_at
from rlhf.pipeline.io import DISABLED_MARKER, StagedOutputs, write_disabled, write_json
from rlhf.pipeline.params import InitialPolicy, Params, initial_policy, load_params, reward_model
from rlhf.pipeline.paths import EVAL_PROMPTS, POLICY_DIR, PPO_CURVES, ROLLOUTS_DIR, TRAIN_PROMPTS
from rlhf.pipeline.wiring import wiring
from rlhf.train.system_use import HEADER as SYSTEM_HEADER

if TYPE_CHECKING:
    from accelerate import Accelerator
    from dvclive import Live

    from rlhf.data.prompts import Prompts
    from rlhf.eval.objective import ObjectiveProbe
    from rlhf.train import checkpoint
    from rlhf.train.batches import Batches
    from rlhf.train.ppo_checkpoint import Checkpointing
    from rlhf.train.ppo_trainer import PPOTrainer

log = logging.getLogger("ppo")

CHUNK_STEPS = 10  # rollout steps per Parquet file when checkpointing is off
# a run whose first steps are all skipped (ppo.nan_policy: skip) stops after this many (the param's doc says so): the
# policy has not changed since step 0, so the batches after them would score NaN/inf as well
SKIPPED_AT_START = 10
DISABLED = "method is not ppo: evaluate reads the method's own policy"

STAGE = "ppo"
PPO_METRICS = Path("metrics/ppo.json")
PPO_SYSTEM = PPO_CURVES / "system.csv"
# what to lower when the GPU runs out of memory
OUT_OF_MEMORY = ("lower ppo.batch_size (generation holds the whole batch) or ppo.mini_batch_size (raising "
                 "ppo.gradient_accumulation_steps keeps the same batch)")


def main() -> None:
    params = load_params(STAGE)
    if params.method != "ppo":
        with StagedOutputs.of(STAGE) as outputs:
            write_disabled(outputs, POLICY_DIR, DISABLED, {PPO_METRICS: '{"ppo": {"trained": false}}\n',
                                                           ROLLOUTS_DIR / DISABLED_MARKER: DISABLED + "\n",
                                                           PPO_CURVES / DISABLED_MARKER: DISABLED + "\n",
                                                           PPO_SYSTEM: SYSTEM_HEADER})
        return
    # imported here and in the functions below: switched off, the stage loads none of it (stages/__init__.py)
    from accelerate import Accelerator

    from rlhf.data.prompts import read_prompts
    from rlhf.models.devices import pick_device

    prompts = read_prompts(TRAIN_PROMPTS)
    cfg = params.ppo
    if len(prompts) < cfg.prompts_per_step:
        raise DataError(f"{TRAIN_PROMPTS}: {len(prompts)} prompts, fewer than the {cfg.prompts_per_step} a step "
                        f"needs (ppo.batch_size={cfg.batch_size} / ppo.samples_per_prompt={cfg.samples_per_prompt})")
    if cfg.unused_keys:
        log.info("ppo: advantage_estimator %s ignores %s", cfg.advantage_estimator, ", ".join(cfg.unused_keys))
    initial, reward = initial_policy(params), reward_model(params)
    accelerator = Accelerator(cpu=pick_device().type == "cpu")
    check_launch(cfg.shard, accelerator)
    # only the main process writes outputs
    staged = StagedOutputs.of(STAGE) if accelerator.is_main_process else contextlib.nullcontext()
    with staged as outputs:
        run(params, prompts, initial, reward, accelerator, outputs)
    # every process leaves together, after the main one has written the outputs, and takes its process group down
    # first: a rank exiting with a live gloo group while a peer still works can abort at interpreter exit
    accelerator.wait_for_everyone()
    accelerator.end_training()


def run(params: Params, prompts: Prompts, initial: InitialPolicy, reward: tuple[str | None, str],
        accelerator: Accelerator, outputs: StagedOutputs | None) -> None:
    """Train from ``initial`` (or the newest checkpoint) against ``reward`` (``params.reward_model``) and its
    functions, and write the outputs (``outputs``: None on every process but the main one)."""
    import torch

    from rlhf.data.prompts import check_prompts, read_prompts
    from rlhf.eval.objective import CURVE_SAMPLES, objective_probe, read_pool
    from rlhf.models.loading import context_size, load_sequence_classifier, load_trainable_policy
    from rlhf.models.policy import PolicyWithValueHead, checkpoint_activations, disable_dropout, save_policy
    from rlhf.models.reward_functions import load_functions
    from rlhf.models.scorers import make_reward_scorer
    from rlhf.train import checkpoint, sharding
    from rlhf.train.batches import ShuffledBatches
    from rlhf.train.compiled import step_metrics
    from rlhf.train.ppo_checkpoint import find_checkpoint
    from rlhf.train.ppo_trainer import PPOTrainer
    from rlhf.train.rng import seed_everything
    from rlhf.train.system_use import SystemUse

    cfg = params.ppo
    device, rank, is_main = accelerator.device, accelerator.process_index, accelerator.is_main_process
    # first: a reward function that fails, or a model that cannot score (or not the longest prompt + response),
    # is refused before any model loads
    functions = load_functions(params.reward.functions, prompts, STAGE, wiring(STAGE).deps)
    scorer = make_reward_scorer(functions, *reward, params.reward.positive_label, params.model, device,
                                prompts.longest + cfg.response_max_tokens)
    seed_everything(params.seed + rank)
    # the policy (+ value head), its frozen reference (None under LoRA: the policy with its adapters off), checked
    # against the longest prompt + response
    lm, ref, tokenizer = load_trainable_policy(initial, params.model)
    if (longest := params.prepare.prompt_max_tokens + cfg.response_max_tokens) > context_size(lm):
        raise ModelError(f"ppo.response_max_tokens: prompt_max_tokens + response_max_tokens = {longest} exceeds "
                         f"{initial.what}'s {context_size(lm)} positions")
    critic = load_sequence_classifier(reward[0], params.model, reward[1]) if cfg.critic == "reward" else None
    for model in (lm, ref, critic) if cfg.disable_dropout else ():
        if model is not None:
            disable_dropout(model)
    policy = PolicyWithValueHead(lm, cfg.critic, critic).to(device)
    if params.model.gradient_checkpointing:
        checkpoint_activations(policy)
    ref = ref.to(device) if ref is not None else None
    if is_main:
        outputs.check_free_space(POLICY_DIR, checkpoint.weights_bytes(policy))
    check_prompts(TRAIN_PROMPTS, prompts, tokenizer, policy.lm, cfg.response_max_tokens, "the policy")
    pool = read_pool(params)
    probe = None if pool is None else objective_probe(params, pool, read_prompts(EVAL_PROMPTS), scorer, tokenizer,
                                                      CURVE_SAMPLES, cfg.batch_size)
    trainer = PPOTrainer(policy, ref, tokenizer, scorer, cfg, device, params.model.precision,
                         accelerator if accelerator.num_processes > 1 else None,
                         length_generator=torch.Generator().manual_seed(params.seed + rank))
    # every process draws the same permutations (one seed) and takes its own slice of each global batch
    order = ShuffledBatches(len(prompts), cfg.prompts_per_step, torch.Generator().manual_seed(params.seed), rank,
                            accelerator.num_processes)
    ckpt, found = find_checkpoint(params, [initial.path, initial.tokenizer, reward[0]], policy, accelerator)
    if found is not None:
        ckpt.restore(found, trainer, order, accelerator)
        log.info("ppo: resuming after step %d from %s", found.step, found.path)

    start = ckpt.start if ckpt is not None else time.perf_counter()  # a resumed run's: the time before counts
    with outputs.steps() if is_main else contextlib.nullcontext(), SystemUse(device) as system:
        last = train(trainer, prompts, order, ckpt, found, accelerator, outputs, probe)

    # sharded: every process takes part in gathering the weights, which the main one writes
    whole = sharding.full_state_dict(trainer.policy) if trainer.sharded else None
    if is_main:
        with trainer.averaged():  # ppo.ema_decay: the average is the policy written
            save_policy(trainer.policy, tokenizer, outputs[POLICY_DIR], whole)
        # the training time of every step (those before a resume too), every process's samples, the last objective
        seconds = time.perf_counter() - start
        samples = cfg.steps * cfg.batch_size * accelerator.num_processes
        summary = {"trained": True, "processes": accelerator.num_processes, "samples": samples,
                   # the main process's weights and optimizer state: a 1/N shard of them under ppo.shard
                   "weights_and_optimizer_bytes": sharding.local_bytes(trainer.policy, trainer.optimizer),
                   "seconds": round(seconds, 1),
                   "skipped_batches": trainer.skipped_batches,
                   "throughput/samples_per_s": round(samples / seconds, 2),
                   "system": system.summary(), "compile": step_metrics(trainer.compiled_step),
                   **{k: v for k, v in last.items() if k.startswith("objective/")}}
        write_json({"ppo": summary}, outputs[PPO_METRICS])
        system.write(outputs[PPO_SYSTEM])
        log.info("ppo: %s", summary)


def check_launch(shard: bool, accelerator: Accelerator) -> None:
    """Refuse, before any model loads, a launch that contradicts ppo.shard: sharding in a single process, or
    accelerate's own FSDP or DeepSpeed (its config or flags), which would wrap the models a second way."""
    from accelerate.utils import DistributedType

    if shard and accelerator.num_processes == 1:
        raise ParamsError("ppo.shard: true, but the stage runs as one process: launch it as several (torchrun "
                          "--nproc_per_node N, accelerate launch --num_processes N: docs/gpu.md) or set it to false",
                          "ppo.shard")
    if (kind := accelerator.distributed_type) in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise ParamsError(f"ppo.shard: the launcher turns on accelerate's {kind.value}, which this stage does not "
                          "run: launch without it (accelerate config) and shard with ppo.shard: true", "ppo.shard")


def train(trainer: PPOTrainer, prompts: Prompts, order: Batches, ckpt: Checkpointing | None,
          found: checkpoint.Checkpoint | None, accelerator: Accelerator, outputs: StagedOutputs | None,
          probe: ObjectiveProbe | None) -> dict[str, float]:
    """The steps after the resumed one (if any) to ppo.steps, logging rollouts and curves (main process, under
    ``outputs``' staging), measuring the objective with ``probe`` and checkpointing at each rollout-log flush. Returns
    the last step's stats."""
    from tqdm import tqdm

    from rlhf.train import sharding
    from rlhf.train.curves import open_curves  # dvclive's import is slow: only where curves are written
    from rlhf.train.rollout_log import RolloutWriter, rollout_rows

    cfg, is_main = trainer.cfg, accelerator.is_main_process
    first, last = (found.step + 1, found.state["last_stats"]) if found is not None else (0, {})
    writer = RolloutWriter(outputs[ROLLOUTS_DIR]) if is_main else None
    chunk = cfg.checkpoint_every or CHUNK_STEPS
    # only the main process writes curves: another process's Live would read them while they are being written
    live = open_curves(outputs[PPO_CURVES], resume=found is not None) if is_main else None
    if is_main and probe is None:
        empty_objective_curve(outputs[PPO_CURVES])
    step = first  # the step a Ctrl-C names
    said_empty = False  # every response of a batch empty is said once: it would repeat at every step
    with live or contextlib.nullcontext(), interrupted_at(lambda: step):
        if live is not None and found is not None:
            live.step = found.state["live_step"]
        bar = tqdm(range(first, cfg.steps), desc="ppo", disable=not is_main, initial=first, total=cfg.steps)
        for step in bar:
            batch = prompts.take(next(order).tolist())
            result = trainer.step(batch.input_ids, batch.queries, step)
            if result.skipped and trainer.skipped_batches == step + 1 >= min(SKIPPED_AT_START, cfg.steps):
                raise TrainingError(f"steps 0-{step} were all skipped (ppo.nan_policy: skip; the reward scorer "
                                    "returned NaN/inf in every batch, and the policy, never updated, would go on "
                                    f"doing so): nothing was trained{previous_outputs()}")
            if not result.skipped:
                last = result.stats
                if is_main and not said_empty and not any(text.strip() for text in result.rollout.responses):
                    with tqdm.external_write_mode():  # on a line of its own, not after the progress bar
                        log.warning("ppo: step %d: every response is empty (the policy answers EOS at once, or "
                                    "tokens that decode to nothing): the reward scores the prompts alone (said once)",
                                    step)
                    said_empty = True
                if is_main:
                    writer.add(rollout_rows(step, result.rollout, last["objective/kl_coef"]))
                    for key, value in last.items():
                        live.log_metric(key, value, plot=True)
                    live.next_step()
                bar.set_postfix(reward=f"{last['objective/scores']:.3f}", kl=f"{last['objective/kl']:.2f}")
            if (step + 1) % chunk == 0 or step + 1 == cfg.steps:
                if probe is not None:  # every process: a sharded policy's forward needs them all
                    # the reference too: its head runs after its context, in the policy's forward
                    with (trainer.autocast(), sharding.gathered(trainer.policy), sharding.gathered(trainer.ref_policy),
                          trainer.averaged()):
                        measured = probe.measure(trainer.policy.lm, trainer.reference)
                    if is_main:
                        log_objective(live, measured, (step + 1) * cfg.batch_size * accelerator.num_processes)
                if is_main:
                    writer.flush()
                if ckpt is not None:  # the last step's too: a rerun of a finished run (one DVC never recorded)
                    ckpt.save(step, trainer, order, live.step if is_main else 0, last, accelerator)  # ends at once
                    ckpt.stop_if_due(step, accelerator)
    return last


def empty_objective_curve(curves: Path) -> None:
    """Without a probe (no pool, or no one beta), the files of the dvc.yaml plots ``objective`` and ``objective_kl``
    hold their headers alone: DVC draws an empty chart where a missing file would be an error."""
    folder = curves / "plots/metrics/optimum"
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("objective_fraction", "kl", "samples"):
        (folder / f"{name}.tsv").write_text(f"step\t{name}\n")


def log_objective(live: Live, measured: dict, samples: int) -> None:
    """The objective's share of the optimum's gain and the KL on the pool's prompts, with the samples trained on, at
    the curves' current step."""
    live.log_metric("optimum/samples", samples, plot=True)
    live.log_metric("optimum/kl", measured["optimum.objective_kl"], plot=True)
    fraction = measured["optimum.objective_fraction"]
    live.log_metric("optimum/objective_fraction", math.nan if fraction is None else fraction, plot=True)


def previous_outputs() -> str:
    """What became of the stage's previous outputs when it fails: they are kept; but a dvc repro or dvc exp run
    deleted them before it ran the stage, which the error line says (``cli.under_dvc``), so nothing is added here."""
    return "" if "DVC_STAGE" in os.environ else "; the previous outputs are kept"


if __name__ == "__main__":
    run_stage(main, OUT_OF_MEMORY)
