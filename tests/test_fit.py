"""The shared training loop on a tiny regression: it learns, an interrupted run resumes to the uninterrupted result,
gradients accumulate over micro-batches, and a NaN loss stops naming the section's learning rate."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ROOT, set_params

from rlhf.pipeline.errors import PipelineError, TrainingError
from rlhf.pipeline.params import load_params
from rlhf.train.batches import RandomBatches, ShuffledBatches
from rlhf.train.fit import FitPlan, fit

X = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
Y = X @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(64, generator=torch.Generator().manual_seed(1))


class Interrupted(Exception):
    pass


def regression(model: torch.nn.Module, stop_at_call: int | None = None):
    calls = []

    def loss(idx: torch.Tensor) -> torch.Tensor:
        calls.append(idx)
        if len(calls) == stop_at_call:
            raise Interrupted
        return torch.nn.functional.mse_loss(model(X[idx]).squeeze(-1), Y[idx])

    return loss


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


PLAN = FitPlan("sft", steps=30, learning_rate=0.5, warmup_steps=5, max_grad_norm=1.0, accumulation_steps=2,
               checkpoint_every=4, fingerprint="run-a")


def test_fit_learns_and_a_resumed_run_ends_where_an_uninterrupted_one_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    whole = model()
    uninterrupted = fit(whole, whole.parameters(), regression(whole), RandomBatches(64, 8, torch.Generator()
                                                                                    .manual_seed(2)), PLAN)
    assert sum(uninterrupted.losses[-3:]) / 3 < uninterrupted.losses[0] / 10
    # the newest checkpoint stays until the stage's outputs are in place (io.StagedOutputs deletes it then)
    assert [p.name for p in (tmp_path / "data/checkpoints/sft").iterdir()] == ["step-000027"]
    shutil.rmtree(tmp_path / "data/checkpoints/sft")

    first = model()
    with pytest.raises(Interrupted):  # in step 13 (its 27th micro-batch): the newest checkpoint is after step 11
        fit(first, first.parameters(), regression(first, stop_at_call=27),
            RandomBatches(64, 8, torch.Generator().manual_seed(2)), PLAN)
    assert [p.name for p in (tmp_path / "data/checkpoints/sft").iterdir()] == ["step-000011"]
    torch.manual_seed(123)  # the checkpoint restores the global RNGs too
    resumed_model = model()
    resumed = fit(resumed_model, resumed_model.parameters(), regression(resumed_model),
                  RandomBatches(64, 8, torch.Generator().manual_seed(2)), PLAN)
    assert resumed.losses == uninterrupted.losses
    assert torch.equal(resumed_model.weight, whole.weight) and torch.equal(resumed_model.bias, whole.bias)


def test_accumulated_micro_batches_step_like_one_batch_of_their_mean(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    plan = FitPlan("reward", steps=1, learning_rate=0.1, warmup_steps=0, max_grad_norm=100.0)
    split, whole = model(), model()
    fit(split, split.parameters(), regression(split), ShuffledBatches(64, 16, torch.Generator().manual_seed(0)),
        dataclasses.replace(plan, accumulation_steps=4))
    fit(whole, whole.parameters(), regression(whole), ShuffledBatches(64, 64, torch.Generator().manual_seed(0)), plan)
    assert torch.allclose(split.weight, whole.weight, atol=1e-6)


def test_a_nan_loss_stops_naming_the_learning_rate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    net = model()
    with torch.no_grad():
        net.weight.fill_(float("nan"))
    plan = FitPlan("reward", steps=3, learning_rate=0.1, warmup_steps=0, max_grad_norm=1.0)
    with pytest.raises(TrainingError, match=r"^step 0: reward loss is NaN/inf \(lower reward.learning_rate\)$"):
        fit(net, net.parameters(), regression(net), RandomBatches(64, 8, torch.Generator()), plan)


def test_params_changed_mid_run_stop_it_at_the_next_checkpoint(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """params.yaml edited while sft (or reward, dpo) trains: the run stops after its next checkpoint, in one line,
    keeping it, instead of training every step with the old values and only then refusing to replace its outputs."""
    monkeypatch.chdir(tmp_path)
    for name in ("params.yaml", "dvc.yaml"):
        shutil.copy(ROOT / name, name)
    load_params("sft")  # as the stage does: the values it read are remembered
    net, steps = model(), []

    def edit_at_step_5(step: int) -> None:
        steps.append(step)
        if step == 5:
            set_params(tmp_path, **{"sft.learning_rate": 0.125})

    with pytest.raises(PipelineError, match=r"^params.yaml changed while sft ran \(sft.learning_rate: [^)]* -> "
                                            r"0.125\): stopped after step 7, .*; checkpoint "
                                            r"data/checkpoints/sft/step-000007 kept: restore the params and rerun"):
        fit(net, net.parameters(), regression(net), RandomBatches(64, 8, torch.Generator().manual_seed(2)), PLAN,
            after_step=edit_at_step_5)
    assert steps == list(range(8)) and [p.name for p in Path("data/checkpoints/sft").iterdir()] == ["step-000007"]
