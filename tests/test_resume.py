"""Kill -9 (or Ctrl-C) a ppo, sft or reward run at random moments, rerun it, and get exactly what an uninterrupted run
gets: weights, rollout log, curves, metrics, and evaluate's metrics/eval.json (CPU, tiny models).

Also: a changed param ignores the old run's checkpoint, a completed run keeps only its last one (its rerun ends at
once), and a NaN stop leaves the previous run's outputs as they were and keeps the last good checkpoint (with its
copies of the rollout files), from which ``ppo.nan_policy: skip`` resumes.

The kill delays come from a generator seeded by the KILL_SEED environment variable (default 0); each test prints
the seed and its delays, so a failure can be replayed with the same ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import TINY, set_params
from helpers import leftovers, run, run_cli, snapshot, training_project
from safetensors.torch import load_file

from rlhf.models import scorers
from rlhf.pipeline.errors import TrainingError
from rlhf.pipeline.params import load_params
from stages import evaluate as evaluate_stage
from stages import ppo as ppo_stage

CHECKPOINTS = "data/checkpoints/ppo"
STEPS = 40  # steps are short next to the process's start-up, so it takes many for a kill to land mid-run
# the last chunk is one step: not a boundary; the policy written is the weights' average, which a resume must restore
RESUMABLE = TINY | {"ppo.steps": STEPS, "ppo.checkpoint_every": 3, "ppo.ema_decay": 0.9}
# the only values allowed to differ between runs: wall times and the machine use measured beside them
WALL_TIME = ("time/", "throughput/", "seconds", "system")


@pytest.fixture
def kill_delays() -> random.Random:
    """The generator of kill delays, seeded from KILL_SEED (printed, so a failing run can be replayed)."""
    seed = int(os.environ.get("KILL_SEED", "0"))
    print(f"KILL_SEED={seed}")
    return random.Random(seed)


def draw_delays(rng: random.Random, first: float, n: int, high: float) -> list[float]:
    delays = [first] + [round(rng.uniform(0.0, high), 3) for _ in range(n)]
    print(f"kill delays after a new checkpoint (s): {delays}")
    return delays


@pytest.fixture
def resumable_project(ppo_project: Path) -> Path:
    set_params(ppo_project, **RESUMABLE)
    return ppo_project


def newest_checkpoint(project: Path, stage: str = "ppo") -> str | None:
    folder = project / "data/checkpoints" / stage
    names = sorted(p.name for p in folder.glob("step-*")) if folder.is_dir() else []
    return names[-1] if names else None


def start(project: Path, stage: str) -> subprocess.Popen:
    """The stage in a subprocess that takes Ctrl-C as a terminal delivers it, even where the tests run in a shell's
    background job (which starts its children with SIGINT ignored, so Python would never raise KeyboardInterrupt)."""
    return subprocess.Popen([sys.executable, "-m", f"stages.{stage}"], cwd=project, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(project)},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def kill_after_progress(project: Path, delay: float, stage: str = "ppo", how: int = signal.SIGKILL) -> str | None:
    """Start the stage, wait for a checkpoint newer than the one it resumed from, then send it ``how`` (SIGKILL, or
    SIGINT: Ctrl-C) after a random delay (mid-step, mid-flush or mid-save). Returns the newest checkpoint left behind
    (None: the run finished first, a valid outcome: its outputs are complete, its last checkpoint kept)."""
    before = newest_checkpoint(project, stage)
    process = start(project, stage)
    deadline = time.monotonic() + 120
    while (newest_checkpoint(project, stage) in (None, before) and process.poll() is None
           and time.monotonic() < deadline):
        time.sleep(0.02)
    time.sleep(delay)
    if process.poll() is not None:
        assert process.returncode == 0, process.stderr.read()
        return None
    os.kill(process.pid, how)
    if process.wait() == 0:  # it finished between the poll and the signal
        return None
    left = newest_checkpoint(project, stage)
    if how == signal.SIGINT:  # one line, no traceback, naming the checkpoint a rerun resumes from
        stderr = process.stderr.read()
        assert process.returncode == 130 and "Traceback" not in stderr, stderr
        assert re.fullmatch(rf"interrupted( at step \d+)?; checkpoint data/checkpoints/{stage}/{left} kept; "
                            "rerun to resume", stderr.strip().splitlines()[-1]), stderr
    return left


def stop_mid_run(project: Path, stage: str = "ppo", how: int = signal.SIGKILL, tries: int = 3) -> str:
    """``kill_after_progress`` right after the first new checkpoint, again (on a fresh run) while the run finished
    before the signal landed; the checkpoint left behind."""
    for _ in range(tries):
        left = kill_after_progress(project, 0.0, stage, how)
        if left is not None:
            return left
        print("the run finished before the signal; again")
        shutil.rmtree(project / "data/checkpoints" / stage)  # its last one: the next run would end at once
    pytest.fail(f"{tries} runs of {stage} all finished before the signal landed")


def outputs(project: Path) -> dict[str, object]:
    """Everything the ppo stage writes, with wall times dropped."""
    policy = project / "models/policy"
    curves = {path.relative_to(project).as_posix(): path.read_text()
              for path in sorted((project / "metrics/ppo/plots/metrics").rglob("*.tsv"))
              if not path.relative_to(project / "metrics/ppo/plots/metrics").as_posix().startswith(WALL_TIME)}
    summary = json.loads((project / "metrics/ppo.json").read_text())["ppo"]
    value_head = policy / "value_head.safetensors"
    return {
        "weights": {k: v.tolist() for k, v in load_file(policy / "model.safetensors").items()},
        "value_head": {k: v.tolist() for k, v in load_file(value_head).items()} if value_head.exists() else None,
        "summary": {k: v for k, v in summary.items() if not k.startswith(WALL_TIME)},
        "curves": curves,
        "rollout_files": sorted(p.name for p in (project / "data/rollouts").iterdir()),
    }


@pytest.mark.slow
def test_killed_runs_resume_to_the_uninterrupted_result(resumable_project: Path, tmp_path: Path,
                                                        kill_delays: random.Random,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    reference = tmp_path / "uninterrupted"
    shutil.copytree(resumable_project, reference)
    result = run(reference)
    assert result.returncode == 0, result.stderr
    assert newest_checkpoint(reference) == f"step-{STEPS - 1:06d}", "a completed run keeps its last checkpoint"

    # the first stop right after a checkpoint appears, so that one lands mid-run (on a fresh run if the run won the
    # race): a Ctrl-C; then two kill -9 at random moments
    delays = draw_delays(kill_delays, 0.0, 2, 0.6)
    left = [stop_mid_run(resumable_project, how=signal.SIGINT)]
    left += [kill_after_progress(resumable_project, delay) for delay in delays[1:]]
    result = run(resumable_project)
    assert result.returncode == 0, result.stderr
    if left[-1] is not None:
        assert f"resuming after step {int(left[-1].removeprefix('step-'))}" in result.stderr

    rollouts = pd.read_parquet(resumable_project / "data/rollouts")
    assert rollouts.groupby("step").size().to_dict() == {step: 4 for step in range(STEPS)}  # each step once
    pd.testing.assert_frame_equal(rollouts, pd.read_parquet(reference / "data/rollouts"))
    resumed, uninterrupted = outputs(resumable_project), outputs(reference)
    for key in uninterrupted:
        assert resumed[key] == uninterrupted[key], key
    assert newest_checkpoint(resumable_project) == f"step-{STEPS - 1:06d}"

    # and so evaluate reports the same metrics for both policies
    for project in (resumable_project, reference):
        shutil.copy(project / "data/prompts/train.parquet", project / "data/prompts/eval.parquet")
        monkeypatch.chdir(project)
        evaluate_stage.main()
    resumed_eval, reference_eval = (json.loads((p / "metrics/eval.json").read_text())
                                    for p in (resumable_project, reference))
    for metrics in (resumed_eval, reference_eval):  # evaluate's own setup/steps/teardown times
        metrics.pop("evaluate")
    assert resumed_eval == reference_eval


class LengthScorer:
    """Response length / 10, and NaN on the ``nan_call``-th call (one call per PPO step)."""

    name = "length"

    def __init__(self, nan_call: int | None = None) -> None:
        self.calls, self.nan_call = 0, nan_call

    def __call__(self, queries: list[str], responses: list[str], response_ids: object = None) -> torch.Tensor:
        self.calls += 1
        scores = torch.tensor([len(r) / 10 for r in responses])
        if self.calls == self.nan_call:
            scores[0] = float("nan")
        return scores


def score_with(monkeypatch: pytest.MonkeyPatch, scorer: LengthScorer) -> None:
    """The ppo stage scores with ``scorer`` instead of the reward model."""
    monkeypatch.setattr(scorers, "make_reward_scorer", lambda *args: scorer)  # the stage imports it when it runs


@pytest.mark.slow
def test_a_changed_param_ignores_the_old_checkpoint(ppo_project: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A run stopped after its step-3 checkpoint (by a NaN score, in-process: the kill tests cover stops from
    outside), then rerun with another learning rate, starts afresh and removes that checkpoint."""
    set_params(ppo_project, **{"ppo.steps": 8, "ppo.checkpoint_every": 2})
    monkeypatch.chdir(ppo_project)
    score_with(monkeypatch, LengthScorer(nan_call=6))
    with pytest.raises(TrainingError):
        ppo_stage.main()
    assert newest_checkpoint(ppo_project) == "step-000003"

    set_params(ppo_project, **{"ppo.learning_rate": 1e-3, "ppo.steps": 4})
    caplog.set_level("INFO")
    score_with(monkeypatch, LengthScorer())
    ppo_stage.main()
    assert "another run's checkpoint" in caplog.text and "resuming" not in caplog.text
    assert sorted(pd.read_parquet("data/rollouts")["step"].unique()) == [0, 1, 2, 3]
    assert [p.name for p in Path(CHECKPOINTS).iterdir()] == ["step-000003"]  # the new run's last


@pytest.mark.slow
def test_a_nan_stop_keeps_the_outputs_and_the_last_checkpoint_and_skip_resumes_from_it(
        ppo_project: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    set_params(ppo_project, **{"ppo.steps": 8, "ppo.checkpoint_every": 2})
    monkeypatch.chdir(ppo_project)
    score_with(monkeypatch, LengthScorer())
    ppo_stage.main()
    previous = snapshot(ppo_project, "ppo")
    shutil.rmtree(CHECKPOINTS)  # the finished run's last one: the same run again would end at once

    score_with(monkeypatch, LengthScorer(nan_call=6))
    with pytest.raises(TrainingError, match=r"^step 5: score: the reward scorer returned NaN/inf"):
        ppo_stage.main()
    assert snapshot(ppo_project, "ppo") == previous and leftovers(ppo_project, "ppo") == []
    assert newest_checkpoint(ppo_project) == "step-000003"
    assert sorted(p.name for p in Path(CHECKPOINTS, "step-000003/files/rollouts").iterdir()) == [
        "steps-000000-000001.parquet", "steps-000002-000003.parquet"]

    set_params(ppo_project, **{"ppo.nan_policy": "skip"})
    caplog.set_level("INFO")
    score_with(monkeypatch, LengthScorer())
    ppo_stage.main()
    assert "resuming after step 3" in caplog.text
    assert sorted(pd.read_parquet("data/rollouts")["step"].unique()) == list(range(8))
    assert json.loads(Path("metrics/ppo.json").read_text())["ppo"]["skipped_batches"] == 0


@pytest.mark.slow
def test_a_run_stopped_compiled_resumes_eagerly_and_the_other_way(ppo_project: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """ppo.compile is left out of the checkpoint's fingerprint: an eager run stopped by a NaN score at step 3 resumes
    compiled after step 1, stopped again at step 4 it resumes eagerly after step 3, and finishes. torch.compile
    hands the functions back as they are: the run takes the compiled path (its layout, persistent gradients and
    first-use check), without the minute compiling takes on a CPU, which is not under test here."""
    set_params(ppo_project, **{"ppo.steps": 6, "ppo.checkpoint_every": 2})
    monkeypatch.chdir(ppo_project)
    monkeypatch.setattr(torch, "compile", lambda fn, **options: fn)
    caplog.set_level("INFO")
    for setting, nan_call, resumed in ((False, 4, None), (True, 3, 1), (False, None, 3)):
        set_params(ppo_project, **{"ppo.compile": setting})
        score_with(monkeypatch, LengthScorer(nan_call))
        caplog.clear()
        with pytest.raises(TrainingError) if nan_call else contextlib.nullcontext():
            ppo_stage.main()
        assert (f"resuming after step {resumed}" in caplog.text) is (resumed is not None), setting
        assert ("another run's checkpoint" in caplog.text) is False
        assert ("ppo.compile: the compiled step matches the eager step" in caplog.text) is setting
    assert sorted(pd.read_parquet("data/rollouts")["step"].unique()) == list(range(6))
    assert json.loads(Path("metrics/ppo.json").read_text())["ppo"]["compile"] == {"compiled": False, "distance": None}


# in-process runs stopped by a NaN score at step 4 and resumed from their step-3 checkpoint (the kill test above
# covers full fine-tuning with gae): GRPO (no value head in the checkpoint, 2 prompts x 2 samples a step, the KL loss
# term) and LoRA with gae (the checkpoint holds the adapters and the value head, not the frozen base)
RESUMED = {"critic-free": {"ppo.advantage_estimator": "grpo", "ppo.samples_per_prompt": 2, "ppo.kl_loss_coef": 0.04},
           "lora": {"model.lora.r": 4, "ppo.learning_rate": 1e-2}}


@pytest.mark.slow
@pytest.mark.parametrize("run", RESUMED)
def test_a_run_resumed_from_its_checkpoint_equals_an_uninterrupted_one(
        run: str, ppo_project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    set_params(ppo_project, **{"ppo.steps": 6, "ppo.checkpoint_every": 2, **RESUMED[run]})
    reference = tmp_path / "uninterrupted"
    shutil.copytree(ppo_project, reference)
    monkeypatch.chdir(reference)
    score_with(monkeypatch, LengthScorer())
    ppo_stage.main()

    monkeypatch.chdir(ppo_project)
    score_with(monkeypatch, LengthScorer(nan_call=5))
    with pytest.raises(TrainingError, match=r"^step 4: score"):
        ppo_stage.main()
    assert newest_checkpoint(ppo_project) == "step-000003"
    saved = load_file(ppo_project / CHECKPOINTS / "step-000003" / "model.safetensors")
    if run == "lora":
        assert saved and all(".lora_" in name or name.startswith("v_head.") for name in saved), sorted(saved)
    caplog.set_level("INFO")
    score_with(monkeypatch, LengthScorer())
    ppo_stage.main()
    assert "resuming after step 3" in caplog.text
    resumed, uninterrupted = outputs(ppo_project), outputs(reference)
    assert (uninterrupted["value_head"] is None) == (run == "critic-free")
    for key in uninterrupted:
        assert resumed[key] == uninterrupted[key], key
    if run == "lora":  # saved merged, as the initial policy was saved: the same names, moved weights
        initial = load_file(Path(load_params().model.policy) / "model.safetensors")
        assert resumed["weights"].keys() == initial.keys()
        assert any(resumed["weights"][name] != initial[name].tolist() for name in initial)


# each stage trains a tiny model for ~40 steps with a checkpoint every 5 (helpers.TRAINING): the sft run draws blocks
# from a generator, the reward run shuffles the pairs once per epoch (2 epochs), so both kinds of resumed data order
# are covered
OUTPUTS = {"sft": ["models/sft/model.safetensors", "metrics/sft/loss.csv", "metrics/sft.json"],
           "reward": ["models/reward/model.safetensors", "metrics/reward/scores.csv", "metrics/reward.json"]}


def stage_outputs(project: Path, stage: str) -> dict[str, object]:
    files = {}
    for name in OUTPUTS[stage]:
        path = project / name
        files[name] = ({k: v for k, v in json.loads(path.read_text())[stage].items() if not k.startswith(WALL_TIME)
                        and k != "tokens_per_s"} if path.suffix == ".json" else path.read_bytes())
    return files


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["sft", "reward"])
def test_a_killed_sft_or_reward_run_resumes_to_the_uninterrupted_result(
        stage: str, project: Path, imdb_dir: Path, tokenizer_dir: Path, tmp_path: Path,
        kill_delays: random.Random) -> None:
    training_project(project, stage, imdb_dir, tokenizer_dir)
    reference = tmp_path / "uninterrupted"
    shutil.copytree(project, reference)
    result = run_cli(reference, stage)
    assert result.returncode == 0, result.stderr

    # the first kill comes right after a checkpoint (on a fresh run if the run won the race), the second at random
    left = [stop_mid_run(project, stage)]
    left += [kill_after_progress(project, delay, stage) for delay in draw_delays(kill_delays, 0.0, 1, 0.3)[1:]]
    result = run_cli(project, stage)
    assert result.returncode == 0, result.stderr
    if left[-1] is not None:
        assert f"{stage}: resuming after step {int(left[-1].removeprefix('step-'))}" in result.stderr
    assert stage_outputs(project, stage) == stage_outputs(reference, stage)
    assert newest_checkpoint(project, stage) == newest_checkpoint(reference, stage)  # the last step's, kept


FAULT = Path(__file__).parent / "fault.py"
STEP = r"ppo_trainer\.py:PPOTrainer\.step$"  # one call per PPO step


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["weights", "copies", "copy-content"])
def test_a_damaged_checkpoint_is_set_aside_and_the_rerun_completes_whole(damage: str, ppo_project: Path) -> None:
    """Stopped after its step-3 checkpoint, whose weights are then truncated (or whose copies of the rollout log are
    deleted, or 64 bytes in the middle of one overwritten, its size kept: the resume published it, unreadable): the
    rerun says so in one line, starts over, and its rollout log has every step once, readable."""
    set_params(ppo_project, **{"ppo.steps": 8, "ppo.checkpoint_every": 2})
    result = run(ppo_project, sys.executable, str(FAULT), "ppo", "--where", STEP, "--at", "6", "--kind", "interrupt")
    assert result.returncode == 130, result.stderr
    kept = ppo_project / CHECKPOINTS / newest_checkpoint(ppo_project)
    if damage == "weights":
        os.truncate(kept / "model.safetensors", 1000)
    elif damage == "copies":
        shutil.rmtree(kept / "files")
    else:
        chunk = kept / "files/rollouts/steps-000000-000001.parquet"
        data = bytearray(chunk.read_bytes())
        middle = len(data) // 2
        data[middle:middle + 64] = bytes(64)
        chunk.write_bytes(bytes(data))
    result = run(ppo_project)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert f"removing {CHECKPOINTS}/{kept.name} (damaged: " in result.stderr
    assert "resuming" not in result.stderr
    rollouts = pd.read_parquet(ppo_project / "data/rollouts")
    assert rollouts.groupby("step").size().to_dict() == {step: 4 for step in range(8)}
