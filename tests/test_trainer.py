"""PPOTrainer on a tiny random GPT-2 with a synthetic scorer: it learns, the KL leash holds, lr 0 changes nothing.

These are the tests that catch a sign error or a mask off by one: each asserts an outcome of training.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from stages.core import ppo
from stages.core.errors import TrainingError
from stages.core.modeling import load_causal_lm, load_tokenizer
from stages.core.params import ModelParams, PpoParams
from stages.core.policy import PolicyWithValueHead, disable_dropout
from stages.core.rollout import forward
from stages.core.trainer import PPOTrainer

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


class NanScorer(TokenShareScorer):
    def __call__(self, queries: list[str], responses: list[str]) -> torch.Tensor:
        scores = super().__call__(queries, responses)
        scores[0] = float("nan")
        return scores


def make_trainer(tiny_gpt2_dir: Path, scorer_cls=TokenShareScorer, **overrides: object) -> PPOTrainer:
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
    policy = PolicyWithValueHead(lm, cfg.value_model == "separate")
    return PPOTrainer(policy, ref, tokenizer, scorer, cfg, torch.device("cpu"))


def batch(trainer: PPOTrainer, n: int = 16) -> tuple[list[list[int]], list[str]]:
    queries = [QUERIES[i % len(QUERIES)] for i in range(n)]
    return [trainer.tokenizer(q).input_ids for q in queries], queries


def train(trainer: PPOTrainer, steps: int) -> list[dict[str, float]]:
    return [trainer.step(*batch(trainer), step=s) for s in range(steps)]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_reward_goes_up(tiny_gpt2_dir: Path, precision: str) -> None:
    trainer = make_trainer(tiny_gpt2_dir)
    trainer.precision = precision
    stats = train(trainer, 40)
    first = sum(s["objective/scores"] for s in stats[:4]) / 4
    last = sum(s["objective/scores"] for s in stats[-4:]) / 4
    # measured at 40 steps: +0.72 to +0.78 in bf16 (1 or 2 threads); at 24 steps bf16 ranged from +0.17 to +0.41
    assert last > first + 0.4, (first, last)


def exact_kl(trainer: PPOTrainer) -> float:
    """Mean over fresh samples of the exact sequence KL(policy || reference), summed over response positions."""
    exp = trainer.make_experience(*batch(trainer, 64), step=0, timings={})
    out = forward(trainer.policy, exp.samples, 1.0, keep_logits=True)
    ref = forward(trainer.ref_policy, exp.samples, 1.0, keep_logits=True)
    return (ppo.kl_penalty(out.logprobs, ref.logprobs, "full", out.logits, ref.logits) * exp.mask).sum(1).mean().item()


@pytest.mark.slow
def test_a_huge_kl_coef_keeps_the_policy_at_the_reference(tiny_gpt2_dir: Path) -> None:
    free = make_trainer(tiny_gpt2_dir, init_kl_coef=0.0)
    train(free, 24)
    leashed = make_trainer(tiny_gpt2_dir, init_kl_coef=50.0)
    train(leashed, 24)
    # measured: free ~18 nats (it collapses onto the rewarded tokens), leashed ~0.4
    assert exact_kl(free) > 5.0
    assert exact_kl(leashed) < 1.0


def test_first_minibatch_ratio_is_one(tiny_gpt2_dir: Path) -> None:
    trainer = make_trainer(tiny_gpt2_dir, ppo_epochs=1, mini_batch_size=16)
    exp = trainer.make_experience(*batch(trainer), step=0, timings={})
    with trainer.autocast():  # the rollout's precision (bf16 on CPUs with native bf16 matmuls)
        out = forward(trainer.policy, exp.samples, trainer.cfg.temperature)
    ratio = torch.exp(out.logprobs - exp.logprobs)[exp.mask]
    assert torch.allclose(ratio, torch.ones_like(ratio), atol=1e-5)
    stats = trainer.update(exp, step=0)
    assert stats["val/ratio"] == pytest.approx(1.0, abs=1e-5)


def test_lr_zero_leaves_the_policy_bit_identical(tiny_gpt2_dir: Path) -> None:
    trainer = make_trainer(tiny_gpt2_dir, learning_rate=1e-30)
    trainer.optimizer.param_groups[0]["lr"] = 0.0
    before = copy.deepcopy(trainer.policy.state_dict())
    train(trainer, 2)
    for name, tensor in trainer.policy.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_a_nan_score_stops_with_the_step_and_quantity(tiny_gpt2_dir: Path) -> None:
    trainer = make_trainer(tiny_gpt2_dir, scorer_cls=NanScorer)
    with pytest.raises(TrainingError, match=r"^step 3: score: the reward scorer returned NaN/inf \(1 of 16 values\); "
                                            r"set ppo.nan_policy: skip"):
        trainer.step(*batch(trainer), step=3)


def test_nan_policy_skip_counts_the_batch(tiny_gpt2_dir: Path) -> None:
    trainer = make_trainer(tiny_gpt2_dir, scorer_cls=NanScorer, nan_policy="skip")
    before = copy.deepcopy(trainer.policy.state_dict())
    stats = trainer.step(*batch(trainer), step=0)
    assert stats["ppo/skipped_batches"] == 1.0
    assert all(torch.equal(t, before[k]) for k, t in trainer.policy.state_dict().items())


def test_a_nan_loss_stops(tiny_gpt2_dir: Path) -> None:
    trainer = make_trainer(tiny_gpt2_dir)
    with torch.no_grad():
        trainer.policy.v_head.weight.fill_(float("nan"))
    with pytest.raises(TrainingError, match=r"^step 0: loss/total: the PPO loss is NaN/inf"):
        trainer.step(*batch(trainer), step=0)
