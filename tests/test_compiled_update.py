"""The PPO update without host waits, eager and compiled (ppo.compile): one read of the device per update, the compiled
step one graph with no break, and its losses and weights those of the eager step on the same inputs."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import batch, count_host_reads, make_rollout, make_trainer

import rlhf
from rlhf.models.rollout import forward
from rlhf.train import ppo_update
from rlhf.train.ppo_trainer import PPOTrainer, Rollout


def update_reads(trainer: PPOTrainer, rollout: Rollout, monkeypatch: pytest.MonkeyPatch,
                 callers_under: Path | None = None) -> tuple[dict, int]:
    """The update's stats on ``rollout`` and how many times it read a value from the device (``callers_under``: the
    reads made by code in that folder)."""
    with monkeypatch.context() as patch:
        reads = count_host_reads(patch, callers_under)
        stats = trainer.update(rollout, step=0)
    return stats, sum(reads.values())


def test_the_eager_update_reads_the_device_once(tiny_gpt2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once in our code: eagerly, transformers' SDPA path also reads whether a padding mask is all ones, twice a
    forward (compiled, that check is traced away: the compiled test counts every read)."""
    trainer = make_trainer(tiny_gpt2_dir, compile=False, max_grad_norm=1.0)  # 4 epochs x 2 optimizer steps
    rollout = make_rollout(trainer, *batch(trainer))
    stats, reads = update_reads(trainer, rollout, monkeypatch, Path(rlhf.__file__).parent)
    assert reads == 1
    assert stats["policy/skipped_steps"] == 0.0 and stats["policy/grad_norm"] > 0


def compiled_and_eager(tiny_gpt2_dir: Path, device: torch.device, **settings: object) -> tuple[PPOTrainer, PPOTrainer]:
    """Two trainers with the same weights on ``device``, one compiled (ppo.compile: true), one eager."""
    compiled, eager = (make_trainer(tiny_gpt2_dir, precision="fp32", device=device.type, compile=compiled, **settings)
                       for compiled in (True, False))
    return compiled, eager


def check_compiled_matches_eager(tiny_gpt2_dir: Path, device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three updates of each trainer on the same (padded) rollout: the compiled one traced as one graph per function
    and, once compiled (and on CUDA, its graphs captured: the first two), read from the device once an update; its
    stats and weights those of the eager one."""
    compiled, eager = compiled_and_eager(tiny_gpt2_dir, device, learning_rate=1e-3, max_grad_norm=1.0, ppo_epochs=2)
    rollout = make_rollout(compiled, *batch(compiled))  # padded to the compiled step's layout
    assert rollout.samples.context_length % 8 == 0 and rollout.samples.responses.shape[1] == 8
    initial = copy.deepcopy(eager.policy.state_dict())
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for update in range(3):
        torch.manual_seed(update)
        got, reads = update_reads(compiled, rollout, monkeypatch)
        torch.manual_seed(update)  # the same mini-batch order
        expected = eager.update(rollout, step=0)
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (update, key)
    assert not torch._dynamo.utils.counters["graph_break"]  # fullgraph would raise on one; the count says so too
    assert reads == 1
    weights = compiled.policy.state_dict()
    moved = 0
    for name, tensor in eager.policy.state_dict().items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-5, msg=name)
        moved += not torch.equal(tensor, initial[name])
    assert moved > 0


@pytest.mark.slow  # compiling takes ~40 s on 2 cores
def test_the_compiled_update_is_one_graph_read_once_and_matches_eager(tiny_gpt2_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    check_compiled_matches_eager(tiny_gpt2_dir, torch.device("cpu"), monkeypatch)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_compiled_update_on_cuda_graphs_matches_eager(tiny_gpt2_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    check_compiled_matches_eager(tiny_gpt2_dir, torch.device("cuda"), monkeypatch)


def test_the_static_layout_changes_no_logprob_or_value(tiny_gpt2_dir: Path) -> None:
    trainer = make_trainer(tiny_gpt2_dir, precision="fp32")
    samples, _, _ = trainer.generate(*batch(trainer))
    padded = ppo_update.static_layout(samples, 12, trainer.tokenizer.pad_token_id)
    assert padded.context_length % ppo_update.PROMPT_BUCKET == 0 and padded.responses.shape[1] == 12
    assert padded.response_ids == samples.response_ids and padded.prompt_ids == samples.prompt_ids
    with torch.no_grad():
        out, out_padded = forward(trainer.policy, samples, 1.0), forward(trainer.policy, padded, 1.0)
    mask, R = samples.response_mask, samples.responses.shape[1]
    assert not padded.response_mask[:, R:].any()
    for name in ("logprobs", "values"):
        torch.testing.assert_close(getattr(out_padded, name)[:, :R][mask], getattr(out, name)[mask], rtol=0,
                                   atol=1e-5, msg=name)
