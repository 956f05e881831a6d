"""Benchmark configurations and the stand-in scorer, shared by our benchmark and the peer (TRL) scripts.

Standard library only, so a peer's own virtual environment can import it too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


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


CONFIGS = {
    "bench-cpu": BenchConfig("bench-cpu", 6, 384, 6, 50257, batch_size=64, mini_batch_size=16, ppo_epochs=4,
                             new_tokens=16),
    "bench-gpu": BenchConfig("bench-gpu", 12, 768, 12, 50257, batch_size=128, mini_batch_size=128, ppo_epochs=4,
                             new_tokens=16),
    # a smoke-test size: seconds, not minutes
    "toy": BenchConfig("toy", 2, 64, 2, 50257, batch_size=8, mini_batch_size=4, ppo_epochs=1, new_tokens=8),
}


def stand_in_score(response_ids: list[int]) -> float:
    """A cheap, deterministic reward of the response tokens alone: the share of even token ids.

    Every peer scores with exactly this function, so the benchmark measures the PPO machinery, not a classifier.
    """
    return sum(1 for t in response_ids if t % 2 == 0) / max(len(response_ids), 1)


def sample_prompts(texts: list[str], encode, n: int, cfg: BenchConfig, seed: int = 0) -> list[list[int]]:
    """``n`` prompt prefixes of 2-8 tokens from reviews longer than 200 characters (the classic recipe's filter)."""
    rng = random.Random(seed)
    long_texts = [t for t in texts if len(t) > 200]
    picked = rng.sample(long_texts, n)
    return [encode(t)[: rng.randint(cfg.prompt_min_tokens, cfg.prompt_max_tokens)] for t in picked]
