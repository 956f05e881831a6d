"""Helpers that several test modules share (conftest.py holds the fixtures and the tiny-model builders).

Test modules import from here or from conftest, never from one another.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import torch

from stages.core.modeling import load_causal_lm, load_tokenizer
from stages.core.params import ModelParams, PpoParams
from stages.core.policy import PolicyWithValueHead, disable_dropout
from stages.core.trainer import PPOTrainer


def run(project: Path, *command: str) -> subprocess.CompletedProcess:
    """Run ``command`` (default: the ppo stage) in ``project`` with its own ``stages`` package."""
    return subprocess.run(list(command or (sys.executable, "-m", "stages.ppo")), cwd=project, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(project)})


def run_cli(project: Path, stage: str) -> subprocess.CompletedProcess:
    """``python -m stages.<stage>`` in ``project``."""
    return run(project, sys.executable, "-m", f"stages.{stage}")


def signal_pairs(n: int, seed: int) -> pd.DataFrame:
    """Pairs with an obvious signal: chosen texts say 'great', rejected ones 'awful'."""
    g = torch.Generator().manual_seed(seed)
    filler = ["the movie", "a plot", "this film was", "the actor", "it is"]
    pick = torch.randint(len(filler), (n, 2), generator=g).tolist()
    return pd.DataFrame({"chosen": [f"{filler[a]} great {filler[b]}" for a, b in pick],
                         "rejected": [f"{filler[a]} awful {filler[b]}" for a, b in pick],
                         "chosen_rating": 8, "rejected_rating": 2})


# --- PPOTrainer on a tiny GPT-2 with a synthetic reward ----------------------------------------------------------

QUERIES = ["The movie was", "I think", "This film", "A story of", "The actor", "What a", "It was a", "My favourite"]


class TokenShareScorer:
    """Share of response tokens whose id is below ``cutoff``: a reward the policy can only get by changing."""

    name = "token_share"

    def __init__(self, tokenizer, cutoff: int) -> None:
        self.tokenizer, self.cutoff = tokenizer, cutoff

    def __call__(self, queries: list[str], responses: list[str]) -> torch.Tensor:
        shares = []
        for text in responses:
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
            shares.append(sum(i < self.cutoff for i in ids) / max(len(ids), 1))
        return torch.tensor(shares, dtype=torch.float32)


def make_trainer(tiny_gpt2_dir: Path, scorer_cls: type = TokenShareScorer, precision: str = "auto",
                 **overrides: object) -> PPOTrainer:
    """A PPOTrainer on the tiny GPT-2 (dropout off) with a scorer of ``scorer_cls``; ``overrides`` are ppo.* params."""
    torch.manual_seed(0)
    settings = dict(batch_size=16, mini_batch_size=8, ppo_epochs=4, learning_rate=3e-3, adap_kl_ctrl=False,
                    init_kl_coef=0.01, response_min_tokens=4, response_max_tokens=8)
    cfg = PpoParams().model_copy(update=settings | overrides)
    tokenizer = load_tokenizer(str(tiny_gpt2_dir), ModelParams())
    lm = load_causal_lm(str(tiny_gpt2_dir), ModelParams())
    ref = load_causal_lm(str(tiny_gpt2_dir), ModelParams())
    disable_dropout(lm)
    disable_dropout(ref)
    scorer = scorer_cls(tokenizer, cutoff=len(tokenizer) // 4)
    policy = PolicyWithValueHead(lm, cfg.critic)
    return PPOTrainer(policy, ref, tokenizer, scorer, cfg, torch.device("cpu"), precision)


def batch(trainer: PPOTrainer, n: int | None = None) -> tuple[list[list[int]], list[str]]:
    """``n`` prompts (default: the ppo.prompts_per_step of one step; token ids, texts) cycling through QUERIES."""
    queries = [QUERIES[i % len(QUERIES)] for i in range(n or trainer.cfg.prompts_per_step)]
    return [trainer.tokenizer(q).input_ids for q in queries], queries
