"""Seconds per PPO iteration of our trainer on a named config: ``python -m bench.ppo_step --config bench-cpu``.

Drives the real ``PPOTrainer.step`` (the ppo stage's code path) on a randomly initialised GPT-2 of the config's shape
with IMDb prompts and the stand-in scorer. One warm-up iteration is not counted. Prints a per-phase table, then, as
its last line, one JSON object: config, iters, s_per_iter (median), generate_s, score_s, forward_s, update_s,
samples_per_s, tokens_per_s, peak_mem_mb, update_gflops, peak_gflops, update_share_of_peak.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import time
from pathlib import Path

import pandas as pd
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

from bench.configs import CONFIGS, BenchConfig, sample_prompts, stand_in_score
from stages.core.params import PpoParams
from stages.core.policy import PolicyWithValueHead, disable_dropout
from stages.core.trainer import PPOTrainer


class StandInScorer:
    name = "stand_in"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, queries: list[str], responses: list[str]) -> torch.Tensor:
        ids = self.tokenizer(responses, add_special_tokens=False)["input_ids"]
        return torch.tensor([stand_in_score(r) for r in ids], dtype=torch.float32)


def update_flops(cfg: BenchConfig, prompt_tokens: float) -> float:
    """FLOPs of one iteration's PPO update: ppo_epochs x (forward + backward = 3 x 2 FLOPs per weight per token).

    The transformer body (12 L E^2 weights) sees every prompt and response position; the LM head (E x V) only the
    response positions, which is all our update computes it on.
    """
    body = 12 * cfg.n_layer * cfg.n_embd**2
    head = cfg.n_embd * cfg.vocab_size
    per_sample = 6 * (body * (prompt_tokens + cfg.new_tokens) + head * cfg.new_tokens)
    return cfg.ppo_epochs * cfg.batch_size * per_sample


def matmul_peak_gflops(device: torch.device, n: int = 2048) -> float:
    """Measured fp32 matmul throughput of this device (best of 5), the yardstick for the update's FLOP/s."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    best = float("inf")
    for _ in range(6):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


def build_trainer(cfg: BenchConfig, tokenizer, device: torch.device) -> PPOTrainer:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.n_positions, n_embd=cfg.n_embd,
                        n_layer=cfg.n_layer, n_head=cfg.n_head, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    lm, ref = GPT2LMHeadModel(config), GPT2LMHeadModel(config)
    ref.load_state_dict(lm.state_dict())
    disable_dropout(lm)
    disable_dropout(ref)
    ppo = dataclasses.replace(PpoParams(), batch_size=cfg.batch_size, mini_batch_size=cfg.mini_batch_size,
                              ppo_epochs=cfg.ppo_epochs, response_min_tokens=cfg.new_tokens,
                              response_max_tokens=cfg.new_tokens)
    return PPOTrainer(PolicyWithValueHead(lm).to(device), ref.to(device), tokenizer, StandInScorer(tokenizer), ppo,
                      device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="bench-cpu")
    parser.add_argument("--data", type=Path, default=Path("../shared/imdb"), help="IMDb Parquet folder")
    parser.add_argument("--tokenizer", default="../shared/gpt2-tokenizer")
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()

    cfg = CONFIGS[args.config]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    texts = pd.read_parquet(args.data / "train.parquet", columns=["text"])["text"].tolist()
    prompts = sample_prompts(texts, lambda t: tokenizer(t, add_special_tokens=False).input_ids,
                             cfg.batch_size * (args.iters + 1), cfg)
    trainer = build_trainer(cfg, tokenizer, device)

    rows = []
    for i in range(args.iters + 1):
        batch = prompts[i * cfg.batch_size: (i + 1) * cfg.batch_size]
        stats = trainer.step(batch, tokenizer.batch_decode(batch), step=i)
        if i > 0:  # the first iteration pays one-time costs (allocator warm-up, lazy init)
            rows.append(stats)
        print(f"iter {i}{' (warm-up)' if i == 0 else ''}: {stats['time/step']:.2f} s", flush=True)

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    s_per_iter = median("time/step")
    prompt_tokens = sum(map(len, prompts)) / len(prompts)
    update_gflops = update_flops(cfg, prompt_tokens) / median("time/update") / 1e9
    peak = matmul_peak_gflops(device)
    peak_mem = (torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda"
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    result = {
        "config": cfg.name, "device": str(device), "iters": args.iters, "s_per_iter": round(s_per_iter, 3),
        **{f"{phase}_s": round(median(f"time/{phase}"), 3) for phase in ("generate", "score", "forward", "update")},
        "samples_per_s": round(cfg.batch_size / s_per_iter, 2),
        "tokens_per_s": round(cfg.batch_size * cfg.new_tokens / s_per_iter, 1),
        "peak_mem_mb": round(peak_mem, 1), "update_gflops": round(update_gflops, 1),
        "peak_gflops": round(peak, 1), "update_share_of_peak": round(update_gflops / peak, 3),
    }
    print(f"\n{'phase':<10}{'median s':>10}")
    for phase in ("generate", "score", "forward", "update"):
        print(f"{phase:<10}{result[f'{phase}_s']:>10.3f}")
    print(f"{'total':<10}{s_per_iter:>10.3f}   {result['samples_per_s']} samples/s, {result['tokens_per_s']} "
          f"tokens/s, update {update_gflops:.1f} GFLOP/s = {result['update_share_of_peak']:.0%} of the measured "
          f"{peak:.0f} GFLOP/s fp32 matmul peak, peak memory {result['peak_mem_mb']:.0f} MB")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
