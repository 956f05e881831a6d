"""The ppo stage's run: load models and prompts, iterate PPOTrainer.step, log curves and rollouts, save the policy."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from stages.core import checkpoint
from stages.core.errors import DataError, ModelError, TrainingError
from stages.core.io import atomic_path, remove_outputs, seed_everything
from stages.core.modeling import check_vocab_match, context_size, initial_policy, load_causal_lm, load_tokenizer
from stages.core.params import Params
from stages.core.paths import CHECKPOINTS_DIR, POLICY_DIR, PPO_CURVES, ROLLOUTS_DIR, TRAIN_PROMPTS
from stages.core.policy import PolicyWithValueHead, disable_dropout
from stages.core.rollout_log import RolloutWriter, experience_rows
from stages.core.scorers import Scorer, make_reward_scorer, reward_model_path
from stages.core.trainer import PPOTrainer, StepResult

log = logging.getLogger("ppo")

PROMPTS = TRAIN_PROMPTS
CURVES_DIR = PPO_CURVES
CHUNK_STEPS = 10  # rollout steps per Parquet file when checkpointing is off
CHECKPOINT_DIR = CHECKPOINTS_DIR / "ppo"


@dataclass
class Prompts:
    input_ids: list[list[int]]
    queries: list[str]


def read_prompts(path: Path) -> Prompts:
    if not path.exists():
        raise DataError(f"{path}: missing (run the prepare stage first)")
    table = pq.read_table(path)
    for column in ("query", "input_ids"):
        if column not in table.column_names:
            raise DataError(f"{path}: missing column {column!r} (columns: {', '.join(table.column_names)})")
    if table.num_rows == 0:
        raise DataError(f"{path}: no prompts")
    return Prompts(table["input_ids"].to_pylist(), table["query"].to_pylist())


def load_models(params: Params, device: torch.device) -> tuple[PolicyWithValueHead, torch.nn.Module, object]:
    """Policy (+ value head), frozen reference and tokenizer, checked against each other and the prompt lengths."""
    path, tokenizer_path, what = initial_policy(params)
    tokenizer = load_tokenizer(tokenizer_path, params.model, what=what if path == tokenizer_path else
                               "model.tokenizer")
    lm = load_causal_lm(path, params.model, what=what)
    ref = load_causal_lm(path, params.model, what=what)
    check_vocab_match(tokenizer, lm, "model.tokenizer")
    longest = params.prepare.prompt_max_tokens + params.ppo.response_max_tokens
    if longest > context_size(lm):
        raise ModelError(f"ppo.response_max_tokens: prompt_max_tokens + response_max_tokens = {longest} exceeds "
                         f"{what}'s {context_size(lm)} positions")
    if params.ppo.disable_dropout:
        disable_dropout(lm)
        disable_dropout(ref)
    policy = PolicyWithValueHead(lm, separate_critic=params.ppo.value_model == "separate")
    return policy.to(device), ref.to(device), tokenizer


class PromptBatches:
    """Endless shuffled batches; each process takes its own slice of every global batch.

    Resumable: the state is how many permutations were drawn and the position in the current one; restoring replays
    the permutations from the generator's initial state, so the order continues exactly where it stopped.
    """

    def __init__(self, prompts: Prompts, batch_size: int, rank: int, world: int, generator: torch.Generator) -> None:
        self.prompts, self.batch_size, self.rank, self.world = prompts, batch_size, rank, world
        self.generator, self.initial_state = generator, generator.get_state()
        self.epochs = 0
        self.shuffle()

    def shuffle(self) -> None:
        self.order, self.position = torch.randperm(len(self.prompts.queries), generator=self.generator), 0
        self.epochs += 1

    def __iter__(self) -> PromptBatches:
        return self

    def __next__(self) -> tuple[list[list[int]], list[str]]:
        global_size = self.batch_size * self.world
        if self.position + global_size > len(self.prompts.queries):
            self.shuffle()
        start = self.position + self.rank * self.batch_size
        idx = self.order[start: start + self.batch_size].tolist()
        self.position += global_size
        return [self.prompts.input_ids[i] for i in idx], [self.prompts.queries[i] for i in idx]

    def state_dict(self) -> dict[str, int]:
        return {"epochs": self.epochs, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.generator.set_state(self.initial_state)
        self.epochs = 0
        for _ in range(state["epochs"]):
            self.shuffle()
        self.position = state["position"]


def check_prompts(path: Path, prompts: Prompts, tokenizer: object, lm: torch.nn.Module,
                  response_max_tokens: int) -> None:
    """Prompts tokenized with another tokenizer, or too long for the model's positions, fail before any sampling."""
    limit, vocab = context_size(lm) - response_max_tokens, len(tokenizer)
    for row, ids in enumerate(prompts.input_ids):
        if not ids:
            raise DataError(f"{path}: row {row}: empty prompt")
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise DataError(f"{path}: row {row}: token id {bad[0]} outside the tokenizer's {vocab} ids "
                            "(prompts tokenized with another tokenizer: rerun prepare)")
        if len(ids) > limit:
            raise DataError(f"{path}: row {row}: a {len(ids)}-token prompt + ppo.response_max_tokens="
                            f"{response_max_tokens} exceed the policy's {context_size(lm)} positions")


# which param to lower when a phase of the iteration runs out of GPU memory (functions of PPOTrainer)
OOM_ADVICE = {
    "make_experience": "lower ppo.batch_size (generation and the rollout forward passes hold the whole batch)",
    "update": "lower ppo.mini_batch_size and raise ppo.gradient_accumulation_steps to keep the same batch",
}


def run_step(trainer: PPOTrainer, query_ids: list[list[int]], queries: list[str], step: int) -> StepResult:
    """``trainer.run_step``, with CUDA out-of-memory turned into one line saying which param to lower."""
    try:
        return trainer.run_step(query_ids, queries, step)
    except torch.OutOfMemoryError:
        frames = [frame.name for frame in traceback.extract_tb(sys.exc_info()[2])]
        phase = next((name for name in frames if name in OOM_ADVICE), None)
        advice = OOM_ADVICE.get(phase, "lower ppo.batch_size or ppo.mini_batch_size")
        raise TrainingError(f"step {step}: out of GPU memory in {phase or 'the PPO step'}: {advice}") from None


def run_fingerprint(params: Params, processes: int) -> str:
    """What determines a PPO run: the params the stage reads, its input files, the number of processes."""
    # nan_policy is left out: a run under "stop" has met no NaN before its last checkpoint, so after a NaN stop,
    # switching to "skip" resumes from that checkpoint instead of step 0
    ppo = dataclasses.asdict(params.ppo) | {"nan_policy": None}
    config = {"seed": params.seed, "model": dataclasses.asdict(params.model), "sft.enabled": params.sft.enabled,
              "reward.train": params.reward.train, "reward.model": params.reward.model,
              "reward.positive_label": params.reward.positive_label, "ppo": ppo, "processes": processes}
    policy, tokenizer, _ = initial_policy(params)
    return checkpoint.fingerprint(config, [PROMPTS, policy, tokenizer, reward_model_path(params)[0]])


@dataclass
class Checkpointing:
    """Where the ppo stage checkpoints (every ppo.checkpoint_every steps, at a rollout-log flush), the run's
    fingerprint, and the outputs a checkpoint keeps copies of."""

    fingerprint: str
    folder: Path = CHECKPOINT_DIR
    files: dict[str, Path] = dataclasses.field(default_factory=lambda: {"rollouts": ROLLOUTS_DIR,
                                                                        "curves": CURVES_DIR})

    def save(self, step: int, trainer: PPOTrainer, data: PromptBatches, live_step: int, last: dict[str, float],
             accelerator: object) -> None:
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
                        {"fingerprint": self.fingerprint, "trainer": state, "data": data.state_dict(), "rng": rng,
                         "live_step": live_step, "last_stats": last}, self.files)

    def restore(self, found: checkpoint.Checkpoint, trainer: PPOTrainer, data: PromptBatches,
                accelerator: object) -> None:
        if accelerator.is_main_process:
            checkpoint.restore_files(found, self.files)
        checkpoint.load_weights(found, trainer.policy)
        trainer.load_state_dict({**found.state["trainer"], "optimizer": checkpoint.load_optimizer_state(found)})
        data.load_state_dict(found.state["data"])
        checkpoint.set_rng_states(found.state["rng"][accelerator.process_index], {"length": trainer.length_generator})


def find_checkpoint(params: Params, policy: PolicyWithValueHead,
                    accelerator: object) -> tuple[Checkpointing | None, checkpoint.Checkpoint | None]:
    """The run's checkpointing (None when ppo.checkpoint_every is 0) and the checkpoint to resume from, if any."""
    if not params.ppo.checkpoint_every:
        return None, None
    ckpt = Checkpointing(run_fingerprint(params, accelerator.num_processes))
    if accelerator.is_main_process:
        checkpoint.check_free_space(ckpt.folder, checkpoint.checkpoint_bytes(policy), "ppo.checkpoint_every")
        found = checkpoint.find(ckpt.folder, ckpt.fingerprint, prune=True)
    accelerator.wait_for_everyone()  # the main process has pruned other runs' checkpoints
    if not accelerator.is_main_process:
        found = checkpoint.find(ckpt.folder, ckpt.fingerprint, prune=False)
    return ckpt, found


def train(params: Params, scorer: Scorer | None = None) -> dict[str, float]:
    """Run ``ppo.steps`` iterations; write models/policy, data/rollouts/, metrics/ppo/. Returns the summary.

    With ``ppo.checkpoint_every`` > 0 the run saves a checkpoint at every rollout-log flush and, rerun after a kill,
    resumes from the newest one (see stages/core/checkpoint.py).
    """
    from accelerate import Accelerator
    from dvclive import Live

    cfg = params.ppo
    prompts = read_prompts(PROMPTS)
    if len(prompts.queries) < cfg.batch_size:
        raise DataError(f"{PROMPTS}: {len(prompts.queries)} prompts, fewer than ppo.batch_size={cfg.batch_size}")
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    device = accelerator.device
    seed_everything(params.seed + accelerator.process_index)
    policy, ref, tokenizer = load_models(params, device)
    check_prompts(PROMPTS, prompts, tokenizer, policy.lm, cfg.response_max_tokens)
    scorer = scorer or make_reward_scorer(params, device)
    trainer = PPOTrainer(policy, ref, tokenizer, scorer, cfg, device,
                         accelerator if accelerator.num_processes > 1 else None,
                         length_generator=torch.Generator().manual_seed(params.seed + accelerator.process_index),
                         precision=params.model.precision)
    data = PromptBatches(prompts, cfg.batch_size, accelerator.process_index, accelerator.num_processes,
                         torch.Generator().manual_seed(params.seed))
    main = accelerator.is_main_process
    ckpt, found = find_checkpoint(params, policy, accelerator)
    if main:
        remove_outputs(ROLLOUTS_DIR, CURVES_DIR)
    first, last = 0, {}
    if found is not None:
        ckpt.restore(found, trainer, data, accelerator)
        first, last = found.step + 1, found.state["last_stats"]
        log.info("ppo: resuming after step %d from %s", found.step, found.path)
    writer = RolloutWriter(ROLLOUTS_DIR)
    chunk = cfg.checkpoint_every or CHUNK_STEPS
    start = time.perf_counter()
    # only the main process writes curves: another process's Live would read them while they are being written
    live = Live(str(CURVES_DIR), save_dvc_exp=False, dvcyaml=False, resume=found is not None) if main else None
    with live or contextlib.nullcontext():
        if live is not None and found is not None:
            live.step = found.state["live_step"]
        bar = tqdm(range(first, cfg.steps), desc="ppo", disable=not main, initial=first, total=cfg.steps)
        for step in bar:
            query_ids, queries = next(data)
            result = run_step(trainer, query_ids, queries, step)
            if not result.skipped:
                last = result.stats
                if main:
                    writer.add(experience_rows(step, queries, result.experience, last["objective/kl_coef"]))
                    for key, value in last.items():
                        live.log_metric(key, value, plot=True)
                    live.next_step()
                bar.set_postfix(reward=f"{last['objective/scores']:.3f}", kl=f"{last['objective/kl']:.2f}")
            if (step + 1) % chunk == 0:
                if main:
                    writer.flush()
                if ckpt is not None and step + 1 < cfg.steps:
                    ckpt.save(step, trainer, data, live.step if main else 0, last, accelerator)
    if main:
        writer.flush()
        save_policy(trainer.policy, tokenizer)
        if ckpt is not None:
            checkpoint.clear(ckpt.folder)
    return {"steps": cfg.steps, "processes": accelerator.num_processes,
            "seconds": round(time.perf_counter() - start, 1),
            "skipped_batches": trainer.skipped_batches,
            **{k: v for k, v in last.items() if k.startswith(("objective/", "throughput/"))}}


def save_policy(policy: PolicyWithValueHead, tokenizer: object) -> None:
    """models/policy: the LM loadable by AutoModelForCausalLM, its tokenizer, and the value head beside them."""
    with atomic_path(POLICY_DIR) as tmp:
        policy.lm.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        policy.save_value_head(tmp)
