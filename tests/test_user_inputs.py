"""What a user types or does to a run (arguments, signals, a second run, an unmovable output, odd models and data
files) gets one line before any work, and no finished run is lost (issue 25).

Stage processes share one tiny ppo project (module scope); each test leaves it as it found it. The tests that run
stages (all that use that project) are marked slow.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import ROOT, TINY, build_tiny_classifier, build_tiny_gpt2, error_line, set_params, write_prompts
from helpers import leftovers, run, snapshot

from rlhf.models.loading import initial_tokenizer, load_tokenizer
from rlhf.models.scorers import ClassifierScorer
from rlhf.pipeline.cli import STOP_SIGNALS, kept, stop, stop_signals
from rlhf.pipeline.errors import ModelError, ParamsError, PipelineError, Stopped
from rlhf.pipeline.params import defaults, initial_policy, load_params
from rlhf.pipeline.wiring import wiring
from rlhf.train import checkpoint

PPO_CHECKPOINTS = Path("data/checkpoints/ppo")


@pytest.fixture(scope="module")
def ppo_dir(tmp_path_factory: pytest.TempPathFactory, project_template: Path, tiny_gpt2_dir: Path,
            tiny_classifier_dir: Path, tokenizer_dir: Path) -> Path:
    """A project that can run the tiny ppo stage directly, with a finished run's outputs."""
    root = Path(shutil.copytree(project_template, tmp_path_factory.mktemp("inputs") / "project", symlinks=True))
    write_prompts(root, tokenizer_dir)
    set_params(root, **{"model.policy": str(tiny_gpt2_dir), "reward.model": str(tiny_classifier_dir), **TINY})
    result = run(root)
    assert result.returncode == 0, result.stderr
    shutil.rmtree(root / PPO_CHECKPOINTS)  # its last one: a run of other params would find it there at first
    return root


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    """stderr without the progress bars and the stage's own log lines (``ppo: ...``)."""
    return [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("ppo")]


def start(project: Path, *command: str) -> subprocess.Popen:
    return subprocess.Popen(list(command or (sys.executable, "-m", "stages.ppo")), cwd=project, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(project)})


def wait_for_checkpoint(project: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not checkpoint.checkpoints(project / PPO_CHECKPOINTS):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.1)


# --- arguments -------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_stage_refuses_an_argument_it_would_ignore(ppo_dir: Path) -> None:
    before = snapshot(ppo_dir, "ppo")
    result = run(ppo_dir, sys.executable, "-m", "stages.ppo", "--steps", "10")
    error_line(result, "python -m stages.ppo takes no arguments but -h (got --steps 10)", "dvc exp run -S", status=2,
               alone=True)
    assert snapshot(ppo_dir, "ppo") == before


@pytest.mark.slow
def test_a_stage_run_as_a_file_is_refused(ppo_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture) -> None:
    """``python stages/ppo.py --steps 10`` ran a whole training that ignored its argument, without the start-up the
    stages package gives ``-m`` (DVC's workspace lock, the stop signals while importing)."""
    monkeypatch.chdir(ppo_dir)
    monkeypatch.setattr(sys, "argv", ["stages/ppo.py", "--steps", "10"])
    before = snapshot(ppo_dir, "ppo")
    with pytest.raises(SystemExit) as exited:
        runpy.run_path("stages/ppo.py", run_name="__main__")
    assert exited.value.code == 2 and snapshot(ppo_dir, "ppo") == before
    err = capsys.readouterr().err
    assert err.startswith("error: run a stage as python -m stages.ppo from the project root") and err.count("\n") == 1


def preset_project(tmp_path: Path) -> Path:
    shutil.copy2(ROOT / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "tiny.yaml").write_text("ppo:\n  steps: 80\n")
    (tmp_path / "presets" / "local.yaml").write_text("data:\n  source: data/raw/imdb\n")
    return tmp_path


def recipe(project: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.recipe", *args], cwd=project, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_recipe_applies_the_users_settings_over_the_preset_and_validates_them(tmp_path: Path) -> None:
    project = preset_project(tmp_path)
    result = recipe(project, "tiny", "-S", "ppo.steps=10", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "dvc exp run -S ppo.steps=10"

    result = recipe(project, "tiny", "-S", "ppo.cliprange=abc", "--dry-run")
    assert result.returncode == 1
    assert result.stderr.strip().startswith("error: params.yaml: ppo.cliprange: ")

    # no default points at a folder only the project's own machines have: a missing local input names the flag
    error_line(recipe(project, "local", "--dry-run"), "--imdb", "data/raw/imdb, which is missing", alone=True)


@pytest.mark.slow
def test_the_frontier_refuses_a_bad_setting_before_copying_anything(project: Path, imdb_dir: Path) -> None:
    (project / "presets").mkdir()
    (project / "presets" / "local.yaml").write_text("data:\n  source: data/raw/imdb\n")
    subprocess.run(["git", "add", "-A"], cwd=project, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "preset"], cwd=project,
                   check=True)
    result = subprocess.run([sys.executable, "-m", "tools.frontier", "local", "--imdb", str(imdb_dir), "--series",
                             "s", "--set", "ppo.learning_rate=abc"], cwd=project, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(project),
                                 "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error: params.yaml: ppo.learning_rate: ")
    assert not (project / "data" / "raw" / "imdb").exists()


# --- signals, a second run -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("signum", "line"), [(signal.SIGINT, "interrupted"), (signal.SIGHUP, "stopped by SIGHUP")],
                         ids=["ctrl-c", "sighup"])
@pytest.mark.slow
def test_a_stop_while_a_stage_imports_is_one_line_and_its_status(signum: int, line: str, ppo_dir: Path) -> None:
    process = start(ppo_dir)
    time.sleep(0.5)  # python is up, torch is being imported
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signum, stderr
    # before the runner is up, or inside it while the stage's own imports (torch) load
    assert re.fullmatch(rf"{line}( while starting; nothing was run|; nothing written)", stderr.strip()), stderr


def test_a_stop_in_a_queued_run_s_temporary_workspace_promises_no_resume(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``dvc queue kill`` of a queued run (tried: its stage said "checkpoint ... kept; rerun to resume"): DVC deletes
    the run's copy of the workspace under .dvc/tmp/exps/, its checkpoints with it."""
    for root, says in ((tmp_path, "; checkpoint data/checkpoints/ppo/step-000004 kept; rerun to resume"),
                       (tmp_path / ".dvc/tmp/exps/tmpab12cd", "; its checkpoint goes with DVC's temporary workspace")):
        (root / "data/checkpoints/ppo/step-000004").mkdir(parents=True)
        monkeypatch.chdir(root)
        assert kept("ppo", 5).startswith(" at step 5" + says)


@pytest.mark.slow
def test_a_closed_terminal_keeps_the_checkpoint(ppo_dir: Path) -> None:
    """SIGHUP (the terminal closed) ended a stage without a word: it stops it as SIGTERM does, in one line, keeping
    its checkpoint."""
    signum = signal.SIGHUP
    before = snapshot(ppo_dir, "ppo")
    set_params(ppo_dir, **{"ppo.steps": 5000})  # never finishes: the signal stops it
    try:
        process = start(ppo_dir)
        wait_for_checkpoint(ppo_dir, process)
        process.send_signal(signum)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 128 + signum, stderr
        kept = checkpoint.checkpoints(ppo_dir / PPO_CHECKPOINTS)
        assert re.fullmatch(rf"stopped by {signal.Signals(signum).name} at step \d+; checkpoint "
                            rf"{re.escape(str(PPO_CHECKPOINTS / kept[-1].name))} kept; rerun to resume",
                            stderr.strip().splitlines()[-1]), stderr
        assert "Traceback" not in stderr and snapshot(ppo_dir, "ppo") == before
    finally:
        set_params(ppo_dir, **{"ppo.steps": TINY["ppo.steps"]})
        shutil.rmtree(ppo_dir / PPO_CHECKPOINTS, ignore_errors=True)


@pytest.mark.slow
def test_a_stop_after_a_stage_is_done_leaves_it_done(ppo_dir: Path) -> None:
    """A stage's exit takes seconds once torch is loaded, and Python puts the default handlers back for it: a SIGTERM
    after its last line killed a finished stage (status -15), so DVC recorded nothing."""
    process = start(ppo_dir, sys.executable, "-m", "stages.dpo")  # method ppo: dpo writes its markers at once
    for line in process.stderr:
        if line.startswith("dpo: done in"):
            process.send_signal(signal.SIGTERM)
            break
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr


@pytest.fixture
def stop_handler() -> Iterator[None]:
    """The stage's own stop handler on the stop signals, as its main sets it; pytest's handlers (SIGALRM's too, which
    a stop inside an import arms) back afterwards."""
    previous = {signum: signal.getsignal(signum) for signum in (*STOP_SIGNALS, signal.SIGALRM)}
    stop_signals(stop)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)  # a re-raise still armed would meet SIGALRM's default: the end of pytest
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def test_a_second_stop_while_the_first_unwinds_adds_nothing(stop_handler: None) -> None:
    """Ctrl-C pressed twice: the second, raised while the first unwound, broke off the cleanup (staging left behind,
    the step lost from the line) or printed a traceback. The stage's own handler, sent real signals."""
    with pytest.raises(Stopped) as first:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # while the first unwinds: its cleanup must go on
    except KeyboardInterrupt:
        pytest.fail("a second stop signal raised while the first unwound")
    assert first.value.signum == signal.SIGINT


def test_a_stop_inside_an_import_is_raised_once_the_import_is_done(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   stop_handler: None) -> None:
    """SIGHUP while a stage imported torch: a library's catch-all around an optional import swallowed the stop, and the
    half-imported module it left failed what followed with a traceback (exit status 1, not 129), or torch's import
    aborted (SIGABRT). A module here stands for that library, sent a real signal."""
    (tmp_path / "swallows_a_stop.py").write_text(
        "import os, signal, time\n"
        "swallowed = False\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGHUP)\n"
        "    time.sleep(2)\n"
        "except BaseException:\n"
        "    swallowed = True\n"
        "done = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(Stopped) as stopped:
        import swallows_a_stop  # noqa: F401
        time.sleep(5)
    assert stopped.value.signum == signal.SIGHUP
    module = sys.modules.pop("swallows_a_stop")
    assert module.done and not module.swallowed


@pytest.mark.slow
def test_sigterm_keeps_the_checkpoint_a_second_run_is_refused_and_ctrl_c_repeated_is_one_line(ppo_dir: Path) -> None:
    before = snapshot(ppo_dir, "ppo")
    set_params(ppo_dir, **{"ppo.steps": 5000})  # never finishes: every process here is stopped
    try:
        first = start(ppo_dir)
        wait_for_checkpoint(ppo_dir, first)
        first.send_signal(signal.SIGTERM)
        _, stderr = first.communicate(timeout=60)
        assert first.returncode == 128 + signal.SIGTERM
        lines = [line for line in stderr.splitlines() if line.startswith("stopped")]
        assert len(lines) == 1 and lines[0].endswith("kept; rerun to resume"), stderr
        assert "Traceback" not in stderr
        kept = checkpoint.checkpoints(ppo_dir / PPO_CHECKPOINTS)
        assert kept and lines[0].startswith("stopped by SIGTERM at step ")

        resumed = start(ppo_dir)
        lock = ppo_dir / "data/checkpoints/.ppo.lock"
        while lock.read_text().strip() != str(resumed.pid):  # it holds the lock from before any model loads
            assert resumed.poll() is None, resumed.communicate()
            time.sleep(0.1)
        error_line(run(ppo_dir), "ppo", f"another run of this stage is under way in this workspace (pid {resumed.pid}")

        newest = kept[-1].name
        deadline = time.monotonic() + 120
        while checkpoint.checkpoints(ppo_dir / PPO_CHECKPOINTS)[-1].name == newest:
            assert resumed.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        for _ in range(3):  # Ctrl-C pressed several times fast
            resumed.send_signal(signal.SIGINT)
            time.sleep(0.05)
        _, stderr = resumed.communicate(timeout=60)
        assert resumed.returncode == 130
        assert "Traceback" not in stderr and "resuming after step" in stderr
        stops = [line for line in stderr.splitlines() if line.startswith("interrupted")]
        assert len(stops) == 1 and stops[0].startswith("interrupted at step ")
        assert snapshot(ppo_dir, "ppo") == before and leftovers(ppo_dir, "ppo") == []
    finally:
        set_params(ppo_dir, **{"ppo.steps": TINY["ppo.steps"]})
        shutil.rmtree(ppo_dir / PPO_CHECKPOINTS, ignore_errors=True)


# --- a finished run is never thrown away -----------------------------------------------------------------------------


@pytest.mark.slow
def test_an_unmovable_output_is_refused_before_any_model_loads(ppo_dir: Path) -> None:
    if shutil.which("chattr") is None or os.geteuid() != 0:
        pytest.skip("needs chattr and root")
    policy = ppo_dir / "models/policy"
    if subprocess.run(["chattr", "+i", str(policy)], capture_output=True).returncode != 0:
        pytest.skip("this file system has no immutable flag")
    try:
        result = run(ppo_dir)
    finally:
        subprocess.run(["chattr", "-i", str(policy)], check=True)
    error_line(result, "models/policy", "cannot be replaced")


@pytest.mark.slow
def test_a_finished_run_keeps_its_last_checkpoint_and_its_rerun_ends_at_once(
        ppo_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A failure while a finished run's outputs go in (a full disk, raised at the first line of
    ``StagedOutputs.commit`` as tests/fault.py would, without its tracing's cost) leaves the previous outputs and the
    checkpoint of the run's last step; the rerun resumes after that step and writes the outputs without training."""
    from rlhf.pipeline.io import StagedOutputs
    from rlhf.train.ppo_trainer import PPOTrainer
    from stages import ppo as ppo_stage

    def disk_full(self: StagedOutputs) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def no_step(self: PPOTrainer, *args: object) -> None:
        raise AssertionError("a step was trained again")

    before = snapshot(ppo_dir, "ppo")
    monkeypatch.chdir(ppo_dir)
    commit = StagedOutputs.commit
    monkeypatch.setattr(StagedOutputs, "commit", disk_full)
    try:
        with pytest.raises(OSError, match="No space left on device"):
            ppo_stage.main()
        assert snapshot(ppo_dir, "ppo") == before
        assert [p.name for p in checkpoint.checkpoints(ppo_dir / PPO_CHECKPOINTS)] == ["step-000002"]
        monkeypatch.setattr(StagedOutputs, "commit", commit)
        monkeypatch.setattr(PPOTrainer, "step", no_step)
        caplog.set_level("INFO")
        ppo_stage.main()
        assert "resuming after step 2" in caplog.text
        after = snapshot(ppo_dir, "ppo")  # the same run: its weights and rollouts, to the byte
        assert {name: data for name, data in after.items() if name.startswith(("models/", "data/"))} == {
            name: data for name, data in before.items() if name.startswith(("models/", "data/"))}
    finally:
        shutil.rmtree(ppo_dir / PPO_CHECKPOINTS, ignore_errors=True)


def test_free_space_asks_for_one_more_checkpoint_and_advice_that_keeps_the_run(tmp_path: Path) -> None:
    folder = tmp_path / "ppo"
    kept = folder / "step-000009"
    kept.mkdir(parents=True)
    (kept / "state.json").write_text('{"fingerprint": "run-a", "step": 9}')
    size = 2**26
    with open(kept / "model.safetensors", "wb") as f:  # sparse: its size counts, no disk is used
        f.truncate(size)
    free = shutil.disk_usage(tmp_path).free
    needed = (free + size // 2) // 2  # two exceed the free space by size/2; one more fits with size/2 to spare
    checkpoint.check_room_for_checkpoints(folder, needed, "ppo.checkpoint_every", "run-a")

    with pytest.raises(PipelineError) as own:
        checkpoint.check_room_for_checkpoints(folder, 2**62, "ppo.checkpoint_every", "run-a")
    assert f"free space to resume from {kept};" in str(own.value) and ": 0" not in str(own.value)
    with pytest.raises(PipelineError, match=r"or set ppo.checkpoint_every: 0 to train without them"):
        checkpoint.check_room_for_checkpoints(folder, 2**62, "ppo.checkpoint_every", "run-b")


# --- models and data checked before the expensive work ---------------------------------------------------------------


@pytest.mark.slow
def test_a_model_that_cannot_score_is_refused_from_its_config(ppo_dir: Path, tiny_gpt2_dir: Path, tmp_path: Path,
                                                              tokenizer_dir: Path,
                                                              capfd: pytest.CaptureFixture) -> None:
    three = build_tiny_classifier(tmp_path / "three", tokenizer_dir, num_labels=3)
    logging.getLogger("transformers").setLevel(logging.INFO)
    for path, what, message in (
            (tiny_gpt2_dir, "evaluate.judges[0]", "a GPT2LMHeadModel, not a sequence classifier"),
            (three, "reward.model", "3 outputs labelled LABEL_0, LABEL_1, LABEL_2, none of them "
                                    "reward.positive_label='POSITIVE'")):
        with pytest.raises(ModelError, match=message):
            ClassifierScorer(str(path), defaults().model, what=what)
    captured = capfd.readouterr()
    assert "newly initialized" not in captured.err + captured.out, "weights were loaded before the check"

    # in the stage, before the policy loads: nothing but the one line (a causal LM; a classifier whose labels are
    # pos/neg, which read at index 1 by default trained towards whatever that label was)
    posneg = build_tiny_classifier(tmp_path / "posneg", tokenizer_dir)
    config = json.loads((posneg / "config.json").read_text())
    config |= {"id2label": {"0": "pos", "1": "neg"}, "label2id": {"pos": 0, "neg": 1}}
    (posneg / "config.json").write_text(json.dumps(config))
    results = []
    try:
        for model in (tiny_gpt2_dir, posneg):
            set_params(ppo_dir, **{"reward.model": str(model)})
            results.append(run(ppo_dir))
    finally:
        set_params(ppo_dir, **{"reward.model": str(build_tiny_classifier(tmp_path / "clf", tokenizer_dir))})
    error_line(results[0], f"reward.model: {tiny_gpt2_dir}", "a GPT2LMHeadModel, not a sequence classifier")
    error_line(results[1], "reward.model", "2 outputs labelled pos, neg, none of them reward.positive_label")
    assert [len(error_lines(result)) for result in results] == [1, 1]


def test_an_empty_tokenizer_folder_is_named_whole_and_never_ignored(tmp_path: Path, tokenizer_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelError) as error:
        load_tokenizer(str(empty), defaults().model)
    assert "\n" not in str(error.value) and not str(error.value).rstrip().endswith(":")

    # ppo with sft.enabled reads models/sft's tokenizer: a model.tokenizer beside it must be that one
    monkeypatch.chdir(tmp_path)
    shutil.copy2(ROOT / "params.yaml", "params.yaml")
    build_tiny_gpt2(tmp_path / "models/sft", tokenizer_dir)
    set_params(tmp_path, **{"sft.enabled": True, "model.tokenizer": str(empty)})
    with pytest.raises(ModelError, match=rf"^model.tokenizer: cannot load a tokenizer from '{empty}'"):
        initial_tokenizer(initial_policy(load_params()), load_params().model)
    set_params(tmp_path, **{"model.tokenizer": str(tokenizer_dir)})
    assert initial_policy(load_params()).path == "models/sft"
    initial_tokenizer(initial_policy(load_params()), load_params().model)  # the very tokenizer sft saved: accepted


def test_pairs_files_and_splits_are_named_before_any_review_is_read(tmp_path: Path, tokenizer_dir: Path,
                                                                     imdb_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    from rlhf.pipeline.io import StagedOutputs
    from stages import prepare

    monkeypatch.chdir(tmp_path)
    shutil.copy2(ROOT / "params.yaml", "params.yaml")
    set_params(tmp_path, **{"sft.splits": ["train", "bogus"]})
    with pytest.raises(ParamsError, match=r"^params.yaml: sft.splits: unknown split 'bogus'"):
        load_params()
    set_params(tmp_path, **{"sft.splits": ["train"]})

    pd.DataFrame({"chosen": ["good"] * 50}).to_parquet("pairs.parquet")
    (tmp_path / "not-imdb").mkdir()  # no split files in it
    set_params(tmp_path, **{"data.source": str(tmp_path / "not-imdb"), "model.tokenizer": str(tokenizer_dir),
                            "prepare.pairs_source": "pairs.parquet", "prepare.train_pairs": 256})
    with pytest.raises(PipelineError, match=r"^pairs.parquet: missing column 'rejected'"), \
            StagedOutputs(wiring("prepare", ROOT / "dvc.yaml").outputs) as outputs:
        prepare.prepare(load_params(), outputs)  # the data source is missing too: the pairs file is read first

    # a pair that prefers a text to itself: the reward model trained to accuracy 0.000 without a word
    pd.DataFrame({"chosen": ["good"] * 50, "rejected": ["bad"] * 49 + ["good"]}).to_parquet("pairs.parquet")
    with pytest.raises(PipelineError, match=r"^pairs.parquet: row 49: chosen equals rejected \(1 of 50 pairs\): a "
                                            r"pair must hold two different texts$"), \
            StagedOutputs(wiring("prepare", ROOT / "dvc.yaml").outputs) as outputs:
        prepare.prepare(load_params(), outputs)

    pd.DataFrame({"chosen": ["good"] * 50, "rejected": ["bad"] * 50}).to_parquet("pairs.parquet")
    set_params(tmp_path, **{"data.source": str(imdb_dir), "prepare.train_prompts": 8, "prepare.eval_prompts": 8})
    with caplog.at_level(logging.INFO), StagedOutputs(wiring("prepare", ROOT / "dvc.yaml").outputs) as outputs:
        prepare.prepare(load_params(), outputs)
    assert "45 train / 5 test pairs from prepare.pairs_source pairs.parquet (prepare.train_pairs" in caplog.text


@pytest.mark.slow
def test_evaluate_names_the_reference_model_when_its_positions_are_too_few(
        ppo_dir: Path, tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlhf.pipeline.io import StagedOutputs
    from rlhf.pipeline.paths import EVAL_PROMPTS, TRAIN_PROMPTS
    from stages import evaluate

    short = build_tiny_gpt2(tmp_path / "short", tokenizer_dir, n_positions=16)
    monkeypatch.chdir(ppo_dir)
    (tmp_path / "params.yaml").write_bytes(Path("params.yaml").read_bytes())
    shutil.copy2(TRAIN_PROMPTS, EVAL_PROMPTS)  # prompts of more than 16 - 13 tokens
    set_params(ppo_dir, **{"model.policy": str(short), "ppo.response_max_tokens": 13})
    try:
        with pytest.raises(PipelineError, match=r"exceed the 16 positions of the reference model \(model.policy\)$"), \
                StagedOutputs(wiring("evaluate", ROOT / "dvc.yaml").outputs) as outputs:
            evaluate.evaluate(load_params(), outputs)
    finally:
        Path("params.yaml").write_bytes((tmp_path / "params.yaml").read_bytes())
        EVAL_PROMPTS.unlink()


# --- numbers ---------------------------------------------------------------------------------------------------------


def test_a_nan_loss_stops_whatever_nan_policy_says_and_does_not_advise_it(tiny_gpt2_dir: Path) -> None:
    from helpers import batch, make_trainer

    trainer = make_trainer(tiny_gpt2_dir, nan_policy="skip", ppo_epochs=1)
    with torch.no_grad():
        trainer.policy.v_head.weight.fill_(float("nan"))
    with pytest.raises(PipelineError, match=r"^step 3: loss/total: the PPO loss is NaN/inf") as error:
        trainer.step(*batch(trainer), step=3)
    assert "nan_policy: skip" not in str(error.value) and "whatever ppo.nan_policy says" in str(error.value)
