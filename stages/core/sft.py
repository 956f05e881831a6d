"""Causal-LM training on IMDb text: packed blocks, AdamW with warmup + cosine decay, held-out perplexity."""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedModel, PreTrainedTokenizerBase

from stages.core import checkpoint
from stages.core.errors import DataError, ModelError, TrainingError
from stages.core.modeling import context_size, fast_activations, load_causal_lm
from stages.core.params import Params
from stages.core.paths import CHECKPOINTS_DIR
from stages.core.training import autocast, warmup_cosine


def build_model(params: Params, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A from-scratch GPT-2 of the sft.* shape, or the sft.base checkpoint to fine-tune."""
    s = params.sft
    if s.base != "scratch":
        lm = load_causal_lm(s.base, params.model, what="sft.base")
        if s.block_size > context_size(lm):
            raise ModelError(f"sft.block_size: {s.block_size} exceeds sft.base's {context_size(lm)} positions")
        return lm
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=s.n_positions, n_embd=s.n_embd, n_layer=s.n_layer, n_head=s.n_head,
        resid_pdrop=s.dropout, embd_pdrop=s.dropout, attn_pdrop=s.dropout,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    return fast_activations(GPT2LMHeadModel(config))


def pack(texts: pd.Series, tokenizer: PreTrainedTokenizerBase, block_size: int, max_tokens: int | None,
         rng: np.random.Generator | None = None) -> torch.Tensor:
    """(N, block_size) blocks of the reviews' token stream, EOS between reviews; shuffled reviews when ``rng``.

    Tokenizes in chunks and stops once ``max_tokens`` are collected, so a small budget does not pay for
    tokenizing 75k reviews.
    """
    order = rng.permutation(len(texts)) if rng is not None else np.arange(len(texts))
    stream: list[int] = []
    for start in range(0, len(order), 2000):
        chunk = texts.iloc[order[start: start + 2000]].tolist()
        for ids in tokenizer(chunk, add_special_tokens=False, verbose=False)["input_ids"]:
            stream.extend(ids)
            stream.append(tokenizer.eos_token_id)
        if max_tokens is not None and len(stream) >= max_tokens:
            break
    n_blocks = len(stream) // block_size
    if n_blocks == 0:
        raise DataError(f"the training text holds {len(stream)} tokens, fewer than one sft.block_size={block_size}")
    return torch.tensor(stream[: n_blocks * block_size]).view(n_blocks, block_size)


@torch.no_grad()
def perplexity(lm: PreTrainedModel, blocks: torch.Tensor, batch_size: int, device: torch.device) -> float:
    """exp(mean next-token loss over every predicted token of the blocks)."""
    lm.eval()
    total, count = 0.0, 0
    for i in range(0, len(blocks), batch_size):
        batch = blocks[i: i + batch_size].to(device)
        loss = lm(input_ids=batch, labels=batch).loss  # fp32: a metric, not worth bf16's rounding
        n = batch.numel() - len(batch)  # the first token of each block is never predicted
        total, count = total + loss.item() * n, count + n
    return math.exp(total / count)


@dataclass
class SftResult:
    losses: list[tuple[int, float]]  # (step, loss) for the curve
    tokens: int
    seconds: float


CHECKPOINT_DIR = CHECKPOINTS_DIR / "sft"


def run_fingerprint(params: Params) -> str:
    """What determines an sft run: seed, data.*, model.*, sft.* (not its checkpoint interval) and the local inputs."""
    config = {"seed": params.seed, "data": dataclasses.asdict(params.data), "model": dataclasses.asdict(params.model),
              "sft": dataclasses.asdict(params.sft) | {"checkpoint_every": None}}
    inputs = [params.data.source, params.model.tokenizer or "", params.model.policy, params.sft.base]
    return checkpoint.fingerprint(config, [p for p in inputs if p])


def train(lm: PreTrainedModel, blocks: torch.Tensor, params: Params, device: torch.device,
          generator: torch.Generator) -> SftResult:
    """Next-token training on random blocks until the sft.max_tokens budget is spent.

    With sft.checkpoint_every, a checkpoint every that many steps in data/checkpoints/sft/; a rerun after a kill
    resumes from the newest one of the same run (see stages/core/checkpoint.py) to the same result.
    """
    s = params.sft
    tokens_per_step = s.batch_size * s.block_size * s.gradient_accumulation_steps
    steps = max(1, s.max_tokens // tokens_per_step)
    decay = [p for p in lm.parameters() if p.dim() >= 2]
    no_decay = [p for p in lm.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=s.learning_rate, betas=(0.9, 0.95))
    schedule = warmup_cosine(optimizer, min(s.warmup_steps, steps // 2), steps)
    losses: list[tuple[int, float]] = []
    fingerprint = run_fingerprint(params) if s.checkpoint_every else None
    found = checkpoint.resume_training(CHECKPOINT_DIR, fingerprint, "sft.checkpoint_every", lm, optimizer, schedule,
                                       {"blocks": generator}) if fingerprint else None
    earlier = 0.0  # seconds spent before a resume
    if found is not None:
        losses, earlier = [tuple(pair) for pair in found.state["losses"]], found.state["seconds"]
    lm.train()
    first, start = len(losses), time.perf_counter()
    bar = tqdm(range(first, steps), desc="sft", initial=first, total=steps)
    for step in bar:
        for _ in range(s.gradient_accumulation_steps):
            idx = torch.randint(len(blocks), (s.batch_size,), generator=generator)
            batch = blocks[idx].to(device)
            with autocast(device, params.model.precision):
                loss = lm(input_ids=batch, labels=batch).loss
            if not torch.isfinite(loss):
                raise TrainingError(f"step {step}: sft loss is NaN/inf (lower sft.learning_rate)")
            (loss / s.gradient_accumulation_steps).backward()
        torch.nn.utils.clip_grad_norm_(lm.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append((step, loss.item()))
        elapsed = time.perf_counter() - start
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{(step + 1 - first) * tokens_per_step / elapsed:.0f}")
        if fingerprint and (step + 1) % s.checkpoint_every == 0 and step + 1 < steps:
            checkpoint.save_training(CHECKPOINT_DIR, fingerprint, step, lm, optimizer, schedule, {"blocks": generator},
                                     {"losses": losses, "seconds": earlier + elapsed})
    if fingerprint:
        checkpoint.clear(CHECKPOINT_DIR)
    return SftResult(losses, steps * tokens_per_step, earlier + time.perf_counter() - start)
