"""The shared training loop on a tiny regression: it learns, an interrupted run resumes to the uninterrupted result,
gradients accumulate over micro-batches, a NaN loss stops naming its step and the section's learning rate, and the
loop reads nothing back from the device but every READ_EVERY steps' losses at once."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ROOT, set_params
from helpers import count_host_reads

from rlhf.pipeline.errors import PipelineError, TrainingError
from rlhf.pipeline.params import load_params
from rlhf.train.batches import RandomBatches, ShuffledBatches
from rlhf.train.fit import READ_EVERY, FitPlan, fit, lr_factor

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
    # the last step's checkpoint stays: the same run again ends at once
    assert [p.name for p in (tmp_path / "data/checkpoints/sft").iterdir()] == ["step-000029"]
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


def test_the_loop_reads_the_device_once_every_read_every_steps(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    net, steps = model(), 2 * READ_EVERY + 5
    plan = FitPlan("sft", steps=steps, learning_rate=0.1, warmup_steps=2, max_grad_norm=1.0, accumulation_steps=2)
    batches = RandomBatches(64, 8, torch.Generator().manual_seed(0))
    reads = count_host_reads(monkeypatch)
    result = fit(net, net.parameters(), regression(net), batches, plan)
    monkeypatch.undo()
    # the losses of READ_EVERY steps, READ_EVERY steps more, and the last 5: three reads, none in between
    assert reads == {"tolist": 3}
    assert len(result.losses) == steps and result.losses[-1] < result.losses[0] / 10


def test_a_nan_read_later_names_its_own_step_and_keeps_no_checkpoint_after_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    net, calls = model(), []
    finite = regression(net)

    def loss(idx: torch.Tensor) -> torch.Tensor:
        calls.append(idx)
        value = finite(idx)
        return value * float("nan") if len(calls) == 11 else value  # step 5's first micro-batch of 2

    with pytest.raises(TrainingError, match=r"^step 5: sft loss is NaN/inf \(lower sft.learning_rate\)$"):
        fit(net, net.parameters(), loss, RandomBatches(64, 8, torch.Generator().manual_seed(2)), PLAN)
    # checkpoints come every 4 steps: after step 3, and none after step 7, whose weights the NaN had reached
    assert [p.name for p in (tmp_path / "data/checkpoints/sft").iterdir()] == ["step-000003"]


def test_the_learning_rate_factor_warms_up_then_decays_to_its_floor() -> None:
    assert [lr_factor(step, 4, 12) for step in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_factor(8, 4, 12) == pytest.approx(0.5) and lr_factor(12, 4, 12) == pytest.approx(0.0)
    assert lr_factor(8, 4, 12, "linear") == pytest.approx(0.5)
    assert lr_factor(6, 4, 12, "linear", floor=0.2) == pytest.approx(0.2 + 0.8 * 0.75)
    assert lr_factor(6, 4, 12, "cosine", floor=0.1) == pytest.approx(0.1 + 0.9 * (2 + 2**0.5) / 4)
    assert lr_factor(11, 0, 12, "constant") == 1.0 and lr_factor(100, 4, 12) == pytest.approx(0.0)
