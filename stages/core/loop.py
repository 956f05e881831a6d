"""The ppo stage's run: load models and prompts, iterate PPOTrainer.step, log curves and rollouts, save the policy."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from stages.core.errors import DataError, ModelError
from stages.core.io import atomic_path, remove_outputs, seed_everything
from stages.core.modeling import check_vocab_match, context_size, initial_policy, load_causal_lm, load_tokenizer
from stages.core.params import Params
from stages.core.policy import PolicyWithValueHead, disable_dropout
from stages.core.rollout_log import RolloutWriter, experience_rows
from stages.core.scorers import Scorer, make_reward_scorer
from stages.core.trainer import PPOTrainer

log = logging.getLogger("ppo")

PROMPTS = Path("data/prompts/train.parquet")
POLICY_DIR = Path("models/policy")
ROLLOUTS_DIR = Path("data/rollouts")
CURVES_DIR = Path("metrics/ppo")
CHUNK_STEPS = 10  # rollout steps per Parquet file when checkpointing is off


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


def batches(prompts: Prompts, batch_size: int, rank: int, world: int, generator: torch.Generator):
    """Endless shuffled batches; each process takes its own slice of every global batch."""
    n, global_size = len(prompts.queries), batch_size * world
    order, position = torch.randperm(n, generator=generator), 0
    while True:
        if position + global_size > n:
            order, position = torch.randperm(n, generator=generator), 0
        idx = order[position + rank * batch_size: position + (rank + 1) * batch_size].tolist()
        position += global_size
        yield [prompts.input_ids[i] for i in idx], [prompts.queries[i] for i in idx]


def train(params: Params, scorer: Scorer | None = None) -> dict[str, float]:
    """Run ``ppo.steps`` iterations; write models/policy, data/rollouts/, metrics/ppo/. Returns the summary."""
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
    scorer = scorer or make_reward_scorer(params, device)
    trainer = PPOTrainer(policy, ref, tokenizer, scorer, cfg, device,
                         accelerator if accelerator.num_processes > 1 else None,
                         length_generator=torch.Generator().manual_seed(params.seed + accelerator.process_index),
                         precision=params.model.precision)
    data = batches(prompts, cfg.batch_size, accelerator.process_index, accelerator.num_processes,
                   torch.Generator().manual_seed(params.seed))
    main = accelerator.is_main_process
    if main:
        remove_outputs(ROLLOUTS_DIR, CURVES_DIR)
    writer = RolloutWriter(ROLLOUTS_DIR)
    chunk = cfg.checkpoint_every or CHUNK_STEPS
    start, last = time.perf_counter(), {}
    with Live(str(CURVES_DIR), save_dvc_exp=False, dvcyaml=False) as live:
        bar = tqdm(range(cfg.steps), desc="ppo", disable=not main)
        for step in bar:
            query_ids, queries = next(data)
            result = trainer.run_step(query_ids, queries, step)
            if result.skipped:
                continue
            last = result.stats
            if main:
                writer.add(experience_rows(step, queries, result.experience, last["objective/kl_coef"]))
                if (step + 1) % chunk == 0:
                    writer.flush()
                for key, value in last.items():
                    live.log_metric(key, value, plot=True)
                live.next_step()
            if last:
                bar.set_postfix(reward=f"{last['objective/scores']:.3f}", kl=f"{last['objective/kl']:.2f}")
    if main:
        writer.flush()
        save_policy(trainer.policy, tokenizer)
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
