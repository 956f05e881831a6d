"""Compiled steps that check themselves (rlhf/train/compiled.py): where they compile, their first use against the eager
step, the eager step for the rest of a run where the compiled one fails or differs (``auto``) or one error line
(``true``), and the private torch APIs they use.

Failures are injected through torch.compile's backend, the compiler the step under test calls: one that raises while
compiling (a Dynamo, Inductor or lowering error), one whose compiled graph raises when called (a CUDA graph capture),
and one whose graph returns wrong values. A backend that only traces keeps these tests to seconds; the compiled steps
themselves are tested against eager under Inductor in tests/test_compiled_update.py and tests/test_sft_reward.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import batch, make_rollout, make_trainer
from test_sft_reward import CPU, VOCAB, structured_blocks, tiny_params

from rlhf.pipeline.errors import ParamsError
from rlhf.pipeline.params import defaults
from rlhf.train import compiled, ppo_checkpoint, ppo_trainer, sft
from rlhf.train.compiled import CompiledStep, compile_problem, compiles, distance, step_metrics, tolerance


def raises_compiling(gm: torch.fx.GraphModule, inputs: list) -> Callable:
    raise RuntimeError("injected lowering failure\nits second line")


def raises_when_called(gm: torch.fx.GraphModule, inputs: list) -> Callable:
    def run(*args: object) -> object:
        raise RuntimeError("injected capture failure")

    return run


def wrong_values(gm: torch.fx.GraphModule, inputs: list) -> Callable:
    """The graph's floating-point outputs (a loss, its stats, a gradient norm) half as large again."""
    def run(*args: object) -> object:
        out = gm(*args)
        return type(out)(x * 1.5 if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in out)

    return run


FAULTS = {"at compile time": (raises_compiling, "failed (BackendCompilerFailed:"),
          "at the first call": (raises_when_called, "failed (RuntimeError: injected capture failure)"),
          "in its values": (wrong_values, "differs from the eager step by")}


def compile_with(monkeypatch: pytest.MonkeyPatch, backend: Callable) -> None:
    """torch.compile, as the steps call it, compiles with ``backend``."""
    real = torch.compile
    torch._dynamo.reset()  # no graph compiled by another test's backend is reused
    monkeypatch.setattr(torch, "compile", lambda fn, **options: real(fn, fullgraph=True, dynamic=False,
                                                                     backend=backend))


def test_compile_auto_is_cuda_only_and_a_true_that_cannot_run_names_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [compiles(setting, cpu, "sft.compile") for setting in ("auto", True, False)] == [False, True, False]
    assert compiles("auto", cuda, "sft.compile") is (compile_problem(cuda) is None)
    monkeypatch.setattr(compiled, "compile_problem", lambda device: "no Triton")
    assert compiles("auto", cuda, "sft.compile") is False  # eager, with a warning
    assert compiles(False, cpu, "sft.compile") is False
    with pytest.raises(ParamsError, match=r"^sft.compile: true, but torch.compile cannot run here \(no Triton\)"):
        compiles(True, cpu, "sft.compile")


def test_the_private_torch_apis_are_where_the_code_reaches_them() -> None:
    """Each wrapper reaches its private API (a torch release that moves one fails here, naming it), and the fused
    AdamW's ``found_inf`` still drops a step: weights and moments as they were, and a step taken where it is 0."""
    assert isinstance(compiled.dynamo_supported(), bool) and isinstance(compiled.triton_available(), bool)
    compiled.mark_static_address(torch.zeros(2))
    for flag in (1.0, 0.0):
        weight = torch.nn.Parameter(torch.ones(4))
        optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
        weight.grad = torch.ones(4)
        compiled.skip_step_if(optimizer, torch.tensor(flag))
        optimizer.step()
        assert torch.equal(weight.detach(), torch.ones(4)) is (flag == 1.0), flag
        assert optimizer.state[weight]["exp_avg"].any().item() is (flag == 0.0), flag


def test_the_bound_follows_the_precision_and_the_distance_is_relative_above_one() -> None:
    assert tolerance("fp32") < 1e-3 < tolerance("bf16") < 0.1
    assert distance({"a": 2.0, "b": 0.0}, {"a": 2.0, "b": 0.0}) == 0.0
    assert distance({"a": 110.0, "b": 0.01}, {"a": 100.0, "b": 0.0}) == pytest.approx(0.1)  # 10/100 > 0.01/1
    assert distance({"a": 1.0}, {"a": 1.0, "b": 0.0}) == float("inf")


@pytest.mark.slow  # tracing the update's step: seconds a graph
@pytest.mark.parametrize("fault", ["at compile time", "in its values"])  # the first call's: the true test's, sft's
def test_under_auto_a_failing_or_wrong_compiled_update_gives_way_to_an_eager_run_s(
        fault: str, tiny_gpt2_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Two updates: the compiled attempt changes nothing (weights, gradients, optimizer, RNG), so the stats and
    weights are those of an eager trainer, bit for bit; one warning names the key and what went wrong."""
    backend, problem = FAULTS[fault]
    compile_with(monkeypatch, backend)
    monkeypatch.setattr(ppo_trainer, "compiles", lambda setting, *args, **kwargs: bool(setting))  # auto: on CPU too
    checked, eager = (make_trainer(tiny_gpt2_dir, precision="fp32", compile=setting, max_grad_norm=1.0, ppo_epochs=2)
                      for setting in ("auto", False))
    rollout = make_rollout(checked, *batch(checked))
    caplog.set_level(logging.WARNING)
    for update in range(2):
        torch.manual_seed(update)
        got = checked.update(rollout, step=update)
        torch.manual_seed(update)
        assert got == eager.update(rollout, step=update), update
    weights = checked.policy.state_dict()
    assert all(torch.equal(weights[name], tensor) for name, tensor in eager.policy.state_dict().items())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"ppo.compile: auto, but the compiled step {problem}")
    assert warnings[0].endswith("the step runs eagerly for the rest of the run")
    metrics = step_metrics(checked.compiled_step)
    assert metrics["compiled"] is False
    assert (metrics["distance"] is None) is (fault != "in its values")
    if fault == "in its values":
        assert metrics["distance"] > tolerance("fp32")


def test_under_true_a_failing_compiled_update_is_one_line_naming_the_key(
        tiny_gpt2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compile_with(monkeypatch, raises_when_called)
    trainer = make_trainer(tiny_gpt2_dir, precision="fp32", compile=True)
    with pytest.raises(ParamsError) as error:
        trainer.update(make_rollout(trainer, *batch(trainer)), step=0)
    assert str(error.value) == ("ppo.compile: true, but the compiled step failed (RuntimeError: injected capture "
                                "failure); set it to auto or false")


def sft_run(params: object, monkeypatch: pytest.MonkeyPatch, setting: bool | str) -> tuple[list[float], list]:
    """sft.train of a tiny model under sft.compile ``setting`` (auto compiling on CPU here): losses and weights."""
    monkeypatch.setattr(sft, "compiles", lambda s, *args: bool(s))
    run = params.model_copy(update={"sft": params.sft.model_copy(update={"compile": setting})})
    torch.manual_seed(0)
    lm = sft.scratch_model(run.sft, VOCAB, 0)
    step = sft.compiled_step(run, CPU)
    result = sft.train(lm, structured_blocks(32, run.sft.block_size), run, CPU, torch.Generator().manual_seed(0),
                       step)
    return result.losses, [p.detach() for p in lm.parameters()], step


@pytest.mark.slow  # tracing the step: seconds
def test_under_auto_a_wrong_compiled_sft_step_gives_way_to_an_eager_run_s(
        tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The compiled attempt ran forward and backward: its gradients and random draws are put back (dropout on: the
    eager run's masks would differ otherwise). The other faults are the update's, through the same check."""
    fault = "in its values"
    params = tiny_params(tokenizer_dir, max_tokens=8 * 32 * 3, warmup_steps=1, learning_rate=1e-3)
    params = params.model_copy(update={"model": params.model.model_copy(update={"precision": "fp32"}),
                                       "sft": params.sft.model_copy(update={"dropout": 0.1})})
    eager_losses, eager_weights, _ = sft_run(params, monkeypatch, False)
    compile_with(monkeypatch, FAULTS[fault][0])
    caplog.set_level(logging.WARNING)
    losses, weights, step = sft_run(params, monkeypatch, "auto")
    assert losses == eager_losses
    assert all(torch.equal(w, e) for w, e in zip(weights, eager_weights, strict=True))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"sft.compile: auto, but the compiled step {FAULTS[fault][1]}")
    assert step_metrics(step)["compiled"] is False


def test_under_true_a_wrong_compiled_sft_step_is_one_line_naming_the_key(tokenizer_dir: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    params = tiny_params(tokenizer_dir, max_tokens=8 * 32 * 2, warmup_steps=1)
    compile_with(monkeypatch, wrong_values)
    with pytest.raises(ParamsError, match=r"^sft.compile: true, but the compiled step differs from the eager step by "
                                          r"[0-9.e+-]+ \(bound [0-9.e+-]+, (fp32|bf16)\); set it to auto or false$"):
        sft_run(params, monkeypatch, True)


def test_the_compile_keys_are_not_in_the_checkpoint_fingerprints() -> None:
    """A run stopped compiled resumes eagerly and the other way (tests/test_resume.py runs it for ppo)."""
    params = defaults()
    fingerprints = {"sft": sft.run_fingerprint, "ppo": lambda p: ppo_checkpoint.run_fingerprint(p, [], processes=1)}
    for section, fingerprint in fingerprints.items():
        runs = [params.model_copy(update={section: getattr(params, section).model_copy(update=update)})
                for update in ({"compile": True}, {"compile": False}, {"learning_rate": 0.5})]
        assert fingerprint(runs[0]) == fingerprint(runs[1]) == fingerprint(params), section
        assert fingerprint(runs[2]) != fingerprint(params), section


def test_a_check_that_finds_nan_gives_the_step_up() -> None:
    step = CompiledStep("ppo.compile", "auto", "fp32")
    assert step.first_use(lambda: float("nan"), lambda: 1.0, lambda x: {"loss": x}, lambda: lambda: None) == 1.0
    assert step.compiled is False and step_metrics(step) == {"compiled": False, "distance": None}
