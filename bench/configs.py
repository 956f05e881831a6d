"""What every PPO benchmark script shares, ours and the peers' (TRL): the named configs, the prompts, the stand-in
scorer, the update's FLOP count and the result line.

Imports only the standard library at module level (torch, pandas and transformers lazily, inside the functions that
need them), so a peer's own virtual environment, which has those but not our package's dependencies, imports it too.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from rlhf.pipeline.paths import RAW_IMDB, RAW_TOKENIZER

PHASES = ("generate", "score", "forward", "update")


@dataclass(frozen=True)
class BenchConfig:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    batch_size: int
    mini_batch_size: int
    ppo_epochs: int
    new_tokens: int  # every response is exactly this long
    prompt_min_tokens: int = 2
    prompt_max_tokens: int = 8
    n_positions: int = 64
    learning_rate: float = 1.41e-5

    @property
    def body_params(self) -> int:
        """Weights of the transformer blocks (attention 4 E^2 + MLP 8 E^2 per layer; biases and norms ignored)."""
        return 12 * self.n_layer * self.n_embd**2

    @property
    def head_params(self) -> int:
        """Weights of the LM head (E x V, tied to the token embedding)."""
        return self.n_embd * self.vocab_size


CONFIGS = {
    "bench-cpu": BenchConfig("bench-cpu", 6, 384, 6, 50257, batch_size=64, mini_batch_size=16, ppo_epochs=4,
                             new_tokens=16),
    "bench-gpu": BenchConfig("bench-gpu", 12, 768, 12, 50257, batch_size=128, mini_batch_size=128, ppo_epochs=4,
                             new_tokens=16),
    # GPT-2-medium and GPT-2-large shapes, the batch of bench-gpu
    "bench-gpu-medium": BenchConfig("bench-gpu-medium", 24, 1024, 16, 50257, batch_size=128, mini_batch_size=128,
                                    ppo_epochs=4, new_tokens=16),
    "bench-gpu-large": BenchConfig("bench-gpu-large", 36, 1280, 20, 50257, batch_size=128, mini_batch_size=128,
                                   ppo_epochs=4, new_tokens=16),
    # GPT-2-medium's shape at a CPU batch (LoRA against full fine-tuning: bench.compare --peers ours-lora16)
    "bench-cpu-medium": BenchConfig("bench-cpu-medium", 24, 1024, 16, 50257, batch_size=16, mini_batch_size=8,
                                    ppo_epochs=1, new_tokens=16),
    # a 152k vocabulary (Qwen2's) on a tiny body: the LM head's logits are nearly all of an update's memory
    "tiny-152k": BenchConfig("tiny-152k", 2, 64, 2, 151936, batch_size=64, mini_batch_size=16, ppo_epochs=4,
                             new_tokens=16),
    # the offline-cpu preset's policy and batch (presets/offline-cpu.yaml): 4 x 256, batch 128, mini-batch 32
    "offline-cpu": BenchConfig("offline-cpu", 4, 256, 4, 50257, batch_size=128, mini_batch_size=32, ppo_epochs=4,
                               new_tokens=16, learning_rate=3e-5),
    # a smoke-test size: seconds, not minutes
    "toy": BenchConfig("toy", 2, 64, 2, 50257, batch_size=8, mini_batch_size=4, ppo_epochs=1, new_tokens=8),
}


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", choices=sorted(CONFIGS), default="bench-cpu")
    # where the offline recipe keeps its local copies (tools/recipe.py): what a user who ran it has
    parser.add_argument("--data", type=Path, default=RAW_IMDB, help="IMDb Parquet folder")
    parser.add_argument("--tokenizer", default=str(RAW_TOKENIZER), help="GPT-2 tokenizer folder")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations, after one warm-up iteration")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own, one per core)")
    parser.add_argument("--precision", choices=["auto", "fp32"], default="auto",
                        help="auto: bf16 mixed precision for every runner where the device has native bf16; "
                             "fp32: none")


def set_threads(threads: int | None) -> None:
    """On a CPU that other jobs share, 1 thread gives steadier timings than 2 threads that wait on each other."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)


def stand_in_score(response_ids: list[int]) -> float:
    """A cheap, deterministic reward of the response tokens alone: the share of even token ids.

    Every peer scores with exactly this function, so the benchmark measures the PPO machinery, not a classifier.
    """
    return sum(1 for t in response_ids if t % 2 == 0) / max(len(response_ids), 1)


def sample_prompts(texts: list[str], encode: Callable[[str], list[int]], n: int, cfg: BenchConfig,
                   seed: int = 0) -> list[list[int]]:
    """``n`` prompt prefixes of 2-8 tokens from reviews longer than 200 characters (the classic recipe's filter)."""
    rng = random.Random(seed)
    long_texts = [t for t in texts if len(t) > 200]
    picked = rng.sample(long_texts, n)
    return [encode(t)[: rng.randint(cfg.prompt_min_tokens, cfg.prompt_max_tokens)] for t in picked]


def load_prompts(data: Path, tokenizer, cfg: BenchConfig, iters: int) -> list[list[list[int]]]:
    """One batch of prompts per iteration (warm-up first) from ``data``/train.parquet, identical for every peer."""
    import pandas as pd

    texts = pd.read_parquet(data / "train.parquet", columns=["text"])["text"].tolist()
    prompts = sample_prompts(texts, lambda t: tokenizer(t, add_special_tokens=False)["input_ids"],
                             cfg.batch_size * (iters + 1), cfg)
    return [prompts[i: i + cfg.batch_size] for i in range(0, len(prompts), cfg.batch_size)]


def gpt2_config_kwargs(cfg: BenchConfig, eos_token_id: int) -> dict:
    """``GPT2Config`` keyword arguments of the config's shape: every peer builds the same architecture, dropout off
    (PPO's probability ratio needs deterministic forward passes; TRL 1.x and ours switch it off anyway)."""
    return dict(vocab_size=cfg.vocab_size, n_positions=cfg.n_positions, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
                n_head=cfg.n_head, bos_token_id=eos_token_id, eos_token_id=eos_token_id, resid_pdrop=0.0,
                embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)


def mean_padded_length(cfg: BenchConfig, batches: list[list[list[int]]]) -> float:
    """Mean over ``batches`` of the longest prompt + the response: the positions a left-padded batch computes."""
    return statistics.mean(max(map(len, batch)) + cfg.new_tokens for batch in batches)


def pass_flops(cfg: BenchConfig, positions: float, head_positions: float, bodies: int = 1, heads: int = 1,
               backward: bool = False, weight_grads: bool = True) -> float:
    """Analytic FLOPs of running models over one batch: 2 per weight per position forward, 4 more backward (2 for
    the inputs' gradients, 2 for the weights'; ``weight_grads`` False: frozen weights, as under LoRA, whose small
    adapters are left out).

    ``batch x (2, 4 or 6) x (bodies x 12 L E^2 x positions + heads x E V x head_positions)``, where ``positions`` is
    the padded length (longest prompt + response), ``head_positions`` the positions that go through the
    50,257-wide LM head (the response positions for us, every position for TRL), and ``bodies`` / ``heads`` count
    the transformers / LM heads run (policy, reference, a separate value model). Attention scores (quadratic in a
    ~24-token length) and the 1-wide value head are left out.
    """
    per_sample = bodies * cfg.body_params * positions + heads * cfg.head_params * head_positions
    per_weight = 2 + (2 + 2 * weight_grads if backward else 0)
    return per_weight * cfg.batch_size * per_sample


def use_bf16(precision: str) -> bool:
    """``--precision auto``: bf16 mixed precision where the device multiplies bf16 natively (CUDA, or a CPU with AMX
    / AVX-512 BF16), for every runner alike (ours: ``model.precision``; TRL: its accelerator's / Trainer's bf16), so
    the comparison is like for like; ``fp32``: every runner in fp32."""
    import torch

    # the rule of rlhf.models.precision.mixed_precision("auto"), restated: a peer's venv cannot import our package
    native = torch.cuda.is_available() or torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    return precision == "auto" and native


def matmul_peak_gflops(dtype_name: str) -> float:
    """Measured matmul throughput of this machine's device in ``dtype_name`` (best of 10): the update's yardstick.

    1024^2 products on CPU (as fast per FLOP as 2048^2 on the 2-core CPU), 8192^2 on CUDA, big enough to fill a GPU.
    """
    import torch

    cuda = torch.cuda.is_available()
    n, dtype = (8192 if cuda else 1024), getattr(torch, dtype_name)
    a, b = (torch.randn(n, n, device="cuda" if cuda else "cpu", dtype=dtype) for _ in range(2))
    times: dict[str, float] = {}
    best = float("inf")
    for _ in range(10):
        times.clear()
        with timed(times, "matmul"):
            a @ b
        best = min(best, times["matmul"])
    return 2 * n**3 / best / 1e9


@contextlib.contextmanager
def timed(row: dict[str, float], name: str) -> Iterator[None]:
    """Adds the block's wall time to ``row[name]``; on CUDA it waits for queued kernels on both ends, so the phase is
    charged its own GPU time."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    sync()
    start = time.perf_counter()
    yield
    sync()
    row[name] = row.get(name, 0.0) + time.perf_counter() - start


def peak_memory_mb() -> float:
    """CUDA peak allocated memory on a GPU machine, else the process's peak resident set size."""
    import resource

    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def summarize(runner: str, cfg: BenchConfig, batches: list[list[list[int]]], rows: list[dict[str, float]],
              update_flops: float, forward_flops: float, bf16: bool, notes: str = "") -> dict:
    """Print the per-phase table of the timed ``rows`` (seconds per phase and ``step`` = wall time of the whole
    iteration) and return the result every benchmark script prints as its last line.

    ``bf16``: the runner trained under bf16 mixed precision. ``update_flops`` / ``forward_flops``: analytic FLOPs
    (``pass_flops``) of the update (ppo_epochs of forward + backward) and of the forward phase's no-grad passes;
    ``learn_gflops`` is both over both phases' time."""
    import torch

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    s_per_iter = median("step")
    update_gflops = update_flops / median("update") / 1e9
    learn_gflops = (update_flops + forward_flops) / (median("update") + median("forward")) / 1e9
    # the yardstick: the bf16 peak where runs are mixed precision (matmuls in bf16; ours keeps the LM head in fp32,
    # so it cannot reach it), else the fp32 peak
    peak_dtype = "bfloat16" if bf16 else "float32"
    peak = matmul_peak_gflops(peak_dtype)
    result = {
        "runner": runner, "config": cfg.name, "device": "cuda" if torch.cuda.is_available() else "cpu",
        "torch_threads": torch.get_num_threads(), "iters": len(rows), "s_per_iter": round(s_per_iter, 3),
        **{f"{phase}_s": round(median(phase), 3) for phase in PHASES},
        "samples_per_s": round(cfg.batch_size / s_per_iter, 2),
        "tokens_per_s": round(cfg.batch_size * cfg.new_tokens / s_per_iter, 1),
        "peak_mem_mb": round(peak_memory_mb(), 1), "update_gflop": round(update_flops / 1e9, 1),
        "update_gflops": round(update_gflops, 1), "peak_gflops": round(peak, 1), "peak_dtype": peak_dtype,
        "precision": "bf16 mixed" if bf16 else "fp32",
        "update_share_of_peak": round(update_gflops / peak, 3), "forward_gflop": round(forward_flops / 1e9, 1),
        "learn_gflops": round(learn_gflops, 1),
        "prompts_sha1": hashlib.sha1(json.dumps(batches).encode()).hexdigest()[:12], "notes": notes,
    }
    print(f"\n{runner} on {cfg.name}: medians over {len(rows)} iterations")
    print(f"{'phase':<10}{'s':>9}")
    for phase in PHASES:
        print(f"{phase:<10}{result[f'{phase}_s']:>9.3f}")
    print(f"{'iteration':<10}{s_per_iter:>9.3f}   {result['samples_per_s']} samples/s, {result['tokens_per_s']} "
          f"response tokens/s, peak memory {result['peak_mem_mb']:.0f} MB")
    print(f"update: {update_flops / 1e9:.0f} GFLOP in {median('update'):.2f} s = {update_gflops:.1f} GFLOP/s, "
          f"{result['update_share_of_peak']:.0%} of the measured {peak:.0f} GFLOP/s {peak_dtype} matmul peak; "
          f"with the forward phase's {forward_flops / 1e9:.0f} GFLOP: {learn_gflops:.1f} GFLOP/s")
    return result
