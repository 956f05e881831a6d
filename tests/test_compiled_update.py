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
from rlhf.train.compiled import distance, step_metrics, tolerance
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


def compiled_and_eager(tiny_gpt2_dir: Path, device: torch.device, precision: str,
                       **settings: object) -> tuple[PPOTrainer, PPOTrainer]:
    """Two trainers with the same weights on ``device``, one compiled (ppo.compile: true), one eager."""
    compiled, eager = (make_trainer(tiny_gpt2_dir, precision=precision, device=device.type, compile=compiled,
                                    **settings) for compiled in (True, False))
    return compiled, eager


def check_compiled_matches_eager(tiny_gpt2_dir: Path, device: torch.device, monkeypatch: pytest.MonkeyPatch,
                                 precision: str = "fp32", **settings: object) -> None:
    """Three updates of each trainer on the same (padded) rollout: the compiled one traced as one graph per function
    and, once compiled (and on CUDA, its graphs captured: the first two), read from the device once an update; its
    first use checked and kept (rlhf/train/compiled.py); its stats and weights those of the eager one, to float
    rounding in fp32, to the first-use check's bound in bf16 (where the weights' moves are compared together: a
    weight whose exact gradient is near 0 moves by up to the learning rate on rounding noise, under Adam)."""
    compiled, eager = compiled_and_eager(tiny_gpt2_dir, device, precision,
                                         **{"learning_rate": 1e-3, "max_grad_norm": 1.0, "ppo_epochs": 2} | settings)
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
        if precision == "fp32":
            for key, value in expected.items():
                assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (update, key)
        else:
            assert distance(got, expected) <= tolerance(precision), update
    assert not torch._dynamo.utils.counters["graph_break"]  # fullgraph would raise on one; the count says so too
    assert reads == 1
    assert step_metrics(compiled.compiled_step)["compiled"] and compiled.step_compiled
    weights, moved = compiled.policy.state_dict(), []
    for name, tensor in eager.policy.state_dict().items():
        if precision == "fp32":
            torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-5, msg=name)
        moved.append((tensor - initial[name], weights[name] - initial[name]))
    eager_moves, compiled_moves = (torch.cat([m[i].flatten().float() for m in moved]) for i in (0, 1))
    assert eager_moves.norm() > 0
    assert (compiled_moves - eager_moves).norm() <= tolerance(precision) * eager_moves.norm()


@pytest.mark.slow  # compiling takes ~40 s on 2 cores
def test_the_compiled_update_is_one_graph_read_once_and_matches_eager(tiny_gpt2_dir: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    check_compiled_matches_eager(tiny_gpt2_dir, torch.device("cpu"), monkeypatch)


# the update's other shapes: adapters (the frozen base, the reference the policy with them off) with a critic of its
# own; critic-free estimators (no value head), GRPO with its KL loss term
VARIANTS = {"lora, separate critic": {"lora_r": 4, "value_model": "separate"},
            "rloo": {"advantage_estimator": "rloo", "samples_per_prompt": 2},
            "grpo, kl loss": {"advantage_estimator": "grpo", "samples_per_prompt": 2, "kl_loss_coef": 0.04}}


@pytest.mark.slow  # tracing takes ~10 s a variant on 2 cores
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_of_the_update_compiles_as_one_graph_and_matches_eager(
        variant: str, tiny_gpt2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through Dynamo and AOTAutograd (graph capture, the compiled backward, functionalization: where a variant
    could break the graph or change a gradient) but not Inductor's code generation, which the test above runs for
    the default update and which each variant would take a minute or two to run again on a CPU."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **options: real(fn, **options | {"backend": "aot_eager"}))
    check_compiled_matches_eager(tiny_gpt2_dir, torch.device("cpu"), monkeypatch, **VARIANTS[variant])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", [None, *VARIANTS])
def test_the_compiled_update_on_cuda_graphs_matches_eager(variant: str | None, tiny_gpt2_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """As the GPU default runs it: bf16 autocast, the LM head in TF32 inside the graphs, CUDA graphs, Inductor."""
    check_compiled_matches_eager(tiny_gpt2_dir, torch.device("cuda"), monkeypatch, precision="bf16",
                                 **VARIANTS.get(variant, {}))


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
