"""A failing stage is one line and changes nothing: it either completes and replaces all its outputs, or fails and
leaves every previous output as it was (checkpoints aside).

Faults go into the real code paths: a truncated or empty safetensors file, an output folder the OS refuses to write
to (``chattr +i`` when the tests run as root, whom chmod does not stop; chmod otherwise), and faults raised inside a
running stage by tests/fault.py, which counts the stage's function calls from outside its code (``sys.setprofile``) and
raises at the N-th: torch.OutOfMemoryError, OSError(ENOSPC) from the writers (safetensors, pyarrow), Ctrl-C, a bug.

The random-point test draws where (and what) to fail from a generator seeded by the FAULT_SEED environment variable
(default 0); it prints the seed and each point, so a failure can be replayed with the same ones.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from conftest import ROOT, build_tiny_classifier, set_params, write_prompts
from helpers import TRAINING, leftovers, run, run_cli, snapshot, training_project
from safetensors.torch import load_file, save_file

from rlhf.models.loading import load_causal_lm, load_sequence_classifier
from rlhf.models.scorers import ClassifierScorer
from rlhf.pipeline import cli
from rlhf.pipeline.errors import ModelError, PipelineError, TrainingError
from rlhf.pipeline.io import StagedOutputs, atomic_path, write_text
from rlhf.pipeline.params import defaults
from rlhf.pipeline.wiring import stages, wiring
from rlhf.train.ppo_trainer import PPOTrainer
from stages import ppo as ppo_stage
from stages import reward as reward_stage

FAULT = Path(__file__).parent / "fault.py"
STAGES = list(stages(ROOT / "dvc.yaml"))
TINY_RUN = {"prepare.eval_prompts": 20, "prepare.train_pairs": 30, "prepare.test_pairs": 10, "ppo.steps": 4,
            "ppo.batch_size": 4, "ppo.mini_batch_size": 2, "ppo.checkpoint_every": 2, "ppo.response_min_tokens": 3,
            "ppo.response_max_tokens": 6, "evaluate.batch_size": 4}


# --- a project ready to run each stage on tiny inputs ----------------------------------------------------------------


@pytest.fixture
def stage_project(project: Path, imdb_dir: Path, tokenizer_dir: Path, tiny_gpt2_dir: Path,
                  tiny_classifier_dir: Path) -> Callable[[str], Path]:
    """``stage_project(stage)``: the project with tiny inputs and params for any stage: the data, tokenizer, policy and
    reward model, prompts, the ppo stage's policy (evaluate's input) and, for a stage switched on only for the run
    (sft, reward), its training params and pairs."""

    def ready(stage: str) -> Path:
        write_prompts(project, tokenizer_dir)
        shutil.copy(project / "data/prompts/train.parquet", project / "data/prompts/eval.parquet")
        shutil.copytree(tiny_gpt2_dir, project / "models/policy")
        set_params(project, **{"data.source": str(imdb_dir), "model.tokenizer": str(tokenizer_dir),
                               "model.policy": str(tiny_gpt2_dir), "reward.model": str(tiny_classifier_dir),
                               **TINY_RUN})
        if stage in TRAINING:
            training_project(project, stage, imdb_dir, tokenizer_dir)
        return project

    return ready


def plant_outputs(project: Path, stage: str) -> dict[str, bytes]:
    """Stand-ins for a previous run's outputs of ``stage`` (a file, or a folder holding one); their snapshot."""
    for output in wiring(stage, project / "dvc.yaml").outputs:
        path = project / output
        path.parent.mkdir(parents=True, exist_ok=True)
        if output.suffix:
            path.write_text(f"previous {output}\n")
        else:
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            (path / "previous.txt").write_text(f"previous {output}\n")
    return snapshot(project, stage)


def run_with_fault(project: Path, stage: str, *args: str) -> subprocess.CompletedProcess:
    """``python tests/fault.py stage *args`` in ``project``."""
    return run(project, sys.executable, str(FAULT), stage, *args)


def last_line(result: subprocess.CompletedProcess) -> str:
    return result.stderr.strip().splitlines()[-1]


# --- one row of issue 17 each ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("truncate", "load", "what"), [
    (lambda size: size - 100, lambda path: load_causal_lm(str(path), defaults().model, what="model.policy"),
     "model.policy"),
    (lambda size: 0, lambda path: ClassifierScorer(str(path), defaults().model), "reward.model"),
], ids=["truncated-policy", "empty-reward-model"])
def test_a_truncated_or_empty_weights_file_is_named(truncate: Callable[[int], int], load: Callable[[Path], object],
                                                    what: str, tiny_gpt2_dir: Path, tiny_classifier_dir: Path,
                                                    tmp_path: Path) -> None:
    model = shutil.copytree(tiny_gpt2_dir if what == "model.policy" else tiny_classifier_dir, tmp_path / "model")
    weights = model / "model.safetensors"
    os.truncate(weights, truncate(weights.stat().st_size))
    with pytest.raises(ModelError, match=rf"^{what}: {re.escape(str(weights))} is truncated or corrupt \(\d+ bytes"):
        load(model)


def test_a_model_whose_weights_do_not_cover_it_or_made_for_another_task_is_refused(
        tiny_gpt2_dir: Path, tiny_classifier_dir: Path, tmp_path: Path) -> None:
    """transformers starts the weights a checkpoint lacks at random, with a warning only, and loads a classifier's
    backbone into an LM head: either trained a policy that was not the one named, without a word."""
    lacking = shutil.copytree(tiny_gpt2_dir, tmp_path / "lacking")
    tensors = load_file(lacking / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if "h.1.mlp.c_fc" not in k}, lacking / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ModelError, match=rf"^model.policy: {re.escape(str(lacking))}: its weights lack 2 of the "
                                         r"model's tensors \(transformer.h.1.mlp.c_fc.bias, \.\.\.\), which would "
                                         r"start random"):
        load_causal_lm(str(lacking), defaults().model)
    with pytest.raises(ModelError, match=rf"^model.policy: {re.escape(str(tiny_classifier_dir))}: a "
                                         r"GPT2ForSequenceClassification, not a causal LM$"):
        load_causal_lm(str(tiny_classifier_dir), defaults().model)


@contextlib.contextmanager
def transformers_log() -> Iterator[list[str]]:
    """What transformers logs inside the block (its own logger, which does not propagate to pytest's)."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def test_a_refused_model_load_is_our_line_alone(tiny_gpt2_dir: Path, tmp_path: Path) -> None:
    """transformers printed its multi-line load report (a table of the missing or mismatched tensors) before our
    line, which names the culprit again; a checkpoint whose tensors do not fit its config.json was its report and
    then a traceback ("For details look at the above report!")."""
    lacking = shutil.copytree(tiny_gpt2_dir, tmp_path / "lacking")
    tensors = load_file(lacking / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if "h.1.mlp.c_fc" not in k}, lacking / "model.safetensors",
              metadata={"format": "pt"})
    mismatched = shutil.copytree(tiny_gpt2_dir, tmp_path / "mismatched")
    config = json.loads((mismatched / "config.json").read_text())
    (mismatched / "config.json").write_text(json.dumps(config | {"n_inner": 2 * config["n_embd"]}))
    with transformers_log() as said:
        with pytest.raises(ModelError, match=r": its weights lack 2 of the model's tensors"):
            load_causal_lm(str(lacking), defaults().model)
        with pytest.raises(ModelError, match=rf"^model.policy: {re.escape(str(mismatched))}: its weights do not fit "
                                             r"its config: transformer.h.0.mlp.c_fc.bias is \(128,\) in the weights, "
                                             r"\(64,\) in the model \(6 such tensors\)"):
            load_causal_lm(str(mismatched), defaults().model)
    assert not [line for line in said if "LOAD REPORT" in line], said


def test_a_half_precision_checkpoint_loads_in_fp32(tiny_gpt2_dir: Path, tiny_classifier_dir: Path,
                                                   tmp_path: Path) -> None:
    """A policy saved in fp16 loaded in fp16 (transformers' dtype "auto") beside the fp32 value head: ppo failed in
    its first update with "mixed dtype"; a classifier so saved scored in fp16."""
    for source, load in ((tiny_gpt2_dir, load_causal_lm), (tiny_classifier_dir, load_sequence_classifier)):
        half = tmp_path / source.name
        load(str(source), defaults().model).half().save_pretrained(half)
        assert {p.dtype for p in load(str(half), defaults().model).parameters()} == {torch.float32}


def test_a_reward_models_new_head_loads_without_transformers_report_and_a_lacking_backbone_is_still_refused(
        tiny_gpt2_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The score head a reward model gets on a causal LM is new by design: transformers' load report listing it as
    missing was noise in every reward stage. The backbone's own missing tensors are still an error."""
    model = load_sequence_classifier(str(tiny_gpt2_dir), defaults().model, "reward.base", new_head=True, num_labels=1)
    assert model.score.out_features == 1 and "LOAD REPORT" not in caplog.text
    lacking = shutil.copytree(tiny_gpt2_dir, tmp_path / "lacking")
    tensors = load_file(lacking / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if "h.1.mlp.c_fc" not in k}, lacking / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ModelError, match=r": its weights lack 2 of the model's tensors"):
        load_sequence_classifier(str(lacking), defaults().model, "reward.base", new_head=True, num_labels=1)


def test_a_many_output_reward_base_fails_naming_it_before_anything_changes(
        stage_project: Callable[[str], Path], tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    project = stage_project("reward")
    three = build_tiny_classifier(project / "three-labels", tokenizer_dir, num_labels=3)
    set_params(project, **{"reward.base": str(three)})
    previous = plant_outputs(project, "reward")
    monkeypatch.chdir(project)
    with pytest.raises(ModelError, match=rf"^reward.base: {re.escape(str(three))}: a sequence classifier with 3 "
                                         r"outputs; reward.base must be 'sft', 'scratch', a causal LM"):
        reward_stage.main()
    assert snapshot(project, "reward") == previous and leftovers(project, "reward") == []


@contextlib.contextmanager
def unwritable(folder: Path) -> Iterator[None]:
    """``folder`` refuses new entries: ``chattr +i`` for root (immutable: root cannot create, rename or delete in it;
    needs CAP_LINUX_IMMUTABLE and a file system with attributes, as ext4), ``chmod 555`` for anyone else."""
    root = os.geteuid() == 0
    if root:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(folder)]).returncode != 0:
            pytest.skip("root without chattr +i here: no way to make a folder unwritable for root")
    else:
        folder.chmod(0o555)
    try:
        with pytest.raises(OSError):
            (folder / "probe").write_text("")
        yield
    finally:
        if root:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
        else:
            folder.chmod(0o755)


def test_an_unwritable_output_folder_stops_the_stage_before_models_load(stage_project: Callable[[str], Path],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    project = stage_project("ppo")
    previous = plant_outputs(project, "ppo")
    monkeypatch.chdir(project)
    with unwritable(project / "models"), pytest.raises(
            PipelineError, match=r"^models/policy: cannot write in models/ \(.+\); nothing was run$"):
        ppo_stage.main()
    assert snapshot(project, "ppo") == previous and leftovers(project, "ppo") == []
    assert not (project / "data/checkpoints").exists()  # the models never loaded


LOSS = r"^rlhf/train/sft\.py:train\.<locals>\.loss$"  # one call per micro-batch of the sft training loop


@pytest.mark.slow
@pytest.mark.parametrize(("stage", "where", "at", "kind", "line", "status"), [
    # out of GPU memory inside each stage's loop names the stage's param to lower (ppo's own test is test_guards')
    ("sft", LOSS, 3, "oom", "error: out of GPU memory in sft: lower sft.batch_size (and raise "
     "sft.gradient_accumulation_steps to keep the same batch)", 1),
    ("reward", r"^rlhf/train/reward_model\.py:scores$", 1, "oom",
     "error: out of GPU memory in reward: lower reward.batch_size or reward.max_length", 1),
    ("evaluate", r"^rlhf/models/rollout\.py:generate$", 1, "oom",
     "error: out of GPU memory in evaluate: lower evaluate.batch_size", 1),
    # a full disk in a writer of a checkpoint (step 1), of the model (the third safetensors file, after the last
    # step's checkpoint), of a rollout
    # chunk (mid-run), of the curves (a write's OSError names no file)
    ("ppo", r"safetensors/torch\.py:save_file$", 3, "disk-full", "error: disk full writing models/policy", 1),
    ("ppo", r"pyarrow/parquet/core\.py:write_table$", 1, "disk-full",
     "error: disk full writing data/rollouts/steps-000000-000001.parquet", 1),
    ("ppo", r"safetensors/torch\.py:save_file$", 1, "disk-full",
     "error: disk full writing data/checkpoints/ppo/step-000001", 1),
    ("ppo", r"dvclive/live\.py:Live\.next_step$", 1, "disk-full", "error: disk full writing metrics/ppo", 1),
    # Ctrl-C before and after the first checkpoint (a real SIGINT: test_resume's kill test)
    ("sft", LOSS, 3, "interrupt", "interrupted at step 2; nothing written", 130),
    ("ppo", r"^rlhf/train/ppo_trainer\.py:PPOTrainer\.step$", 4, "interrupt",
     "interrupted at step 3; checkpoint data/checkpoints/ppo/step-000001 kept; rerun to resume", 130),
], ids=["oom-sft", "oom-reward", "oom-evaluate", "disk-full-model", "disk-full-rollouts", "disk-full-checkpoint",
        "disk-full-curves", "interrupt-sft", "interrupt-ppo"])
def test_a_fault_inside_a_stage_is_one_line_and_changes_no_output(
        stage: str, where: str, at: int, kind: str, line: str, status: int,
        stage_project: Callable[[str], Path]) -> None:
    project = stage_project(stage)
    previous = plant_outputs(project, stage)
    result = run_with_fault(project, stage, "--where", where, "--at", str(at), "--kind", kind)
    assert "fault: " in result.stderr, f"the fault was never injected:\n{result.stderr}"
    assert (result.returncode, last_line(result)) == (status, line), result.stderr
    assert "Traceback" not in result.stderr
    assert snapshot(project, stage) == previous and leftovers(project, stage) == []


@pytest.mark.slow  # Dynamo traces the step before Inductor fails: seconds
def test_a_compiled_step_that_fails_under_true_is_one_line_and_changes_no_output(
        stage_project: Callable[[str], Path]) -> None:
    """Inductor, the real compiler, raises at its first compilation (sft's step: the smallest graph; the PPO update
    goes through the same check, tests/test_compiled.py): one line naming sft.compile and what to set, no traceback
    (nor one from the compiler's workers at exit), and no output changed."""
    project = stage_project("sft")
    set_params(project, **{"sft.compile": True})
    previous = plant_outputs(project, "sft")
    result = run_with_fault(project, "sft", "--where", r"torch/_inductor/compile_fx\.py:compile_fx$", "--at", "1")
    assert "fault: " in result.stderr, f"the fault was never injected:\n{result.stderr}"
    assert result.returncode == 1, result.stderr
    assert last_line(result) == ("error: sft.compile: true, but the compiled step failed (BackendCompilerFailed: "
                                 "backend='inductor' raised: RuntimeError: injected fault); set it to auto or false")
    assert "Traceback" not in result.stderr
    assert snapshot(project, "sft") == previous and leftovers(project, "sft") == []


# --- every stage, failed at a random point ---------------------------------------------------------------------------


@pytest.fixture
def fault_seed() -> int:
    seed = int(os.environ.get("FAULT_SEED", "0"))
    print(f"FAULT_SEED={seed}")
    return seed


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_failed_at_a_random_point_leaves_its_previous_outputs_and_a_rerun_completes(
        stage: str, stage_project: Callable[[str], Path], fault_seed: int, tmp_path: Path) -> None:
    project = stage_project(stage)
    counted = tmp_path / "calls"
    result = run_with_fault(project, stage, "--count", str(counted))  # a complete run: the previous outputs
    assert result.returncode == 0, result.stderr
    previous, calls = snapshot(project, stage), int(counted.read_text())
    shutil.rmtree(project / "data/checkpoints", ignore_errors=True)  # the faulted run trains as the counted one did

    rng = random.Random(f"{fault_seed}/{stage}")
    at, kind = rng.randint(1, calls), rng.choice(["error", "interrupt", "oom"])
    print(f"{stage}: {kind} at call {at} of {calls}")
    result = run_with_fault(project, stage, "--at", str(at), "--kind", kind)
    assert "fault: " in result.stderr and result.returncode != 0, result.stderr
    if kind == "interrupt":
        assert result.returncode == 130 and "Traceback" not in result.stderr, result.stderr
        assert re.fullmatch(r"interrupted( at step \d+)?; (checkpoint \S+ kept; rerun to resume|nothing written)",
                            last_line(result)), result.stderr
    assert snapshot(project, stage) == previous, "the failed run changed an output"
    assert leftovers(project, stage) == []

    result = run_cli(project, stage)
    assert result.returncode == 0, result.stderr
    assert set(snapshot(project, stage)) == set(previous) and leftovers(project, stage) == []


# --- the mechanism itself --------------------------------------------------------------------------------------------


def test_a_commit_failing_half_way_puts_every_previous_output_back(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Including an output that had no previous version, moved in before the failure: it goes too, or one run's output
    would stand beside another's."""
    monkeypatch.chdir(tmp_path)
    outputs = [Path("metrics/new.json"), Path("metrics/a.json"), Path("data/b")]
    Path("metrics").mkdir()
    Path("metrics/a.json").write_text("old a")
    Path("data/b").mkdir(parents=True)
    Path("data/b/x").write_text("old b")
    renames, real_replace = [], os.replace

    def replace_failing_at_the_fifth(src: object, dst: object) -> None:
        renames.append((src, dst))
        if len(renames) == 5:  # both previous outputs moved aside, the first two new ones moved in
            raise OSError("injected")
        real_replace(src, dst)

    with pytest.raises(OSError, match="injected"), StagedOutputs(outputs) as staged:
        write_text("new", staged[Path("metrics/new.json")])
        write_text("new a", staged[Path("metrics/a.json")])
        write_text("new b", staged[Path("data/b/x")])
        monkeypatch.setattr(os, "replace", replace_failing_at_the_fifth)
    monkeypatch.setattr(os, "replace", real_replace)
    assert len(renames) == 7  # the failed one, then the two previous outputs moved back
    assert Path("metrics/a.json").read_text() == "old a" and Path("data/b/x").read_text() == "old b"
    assert sorted(p.name for p in [*Path("metrics").iterdir(), *Path("data").iterdir()]) == ["a.json", "b"]


def test_too_little_disk_for_an_output_stops_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    policy = Path("models/policy")
    with pytest.raises(PipelineError, match=r"^models/policy: models has \d+ MiB free, the new output needs about "
                                            r"\d+ MiB "), StagedOutputs([policy]) as outputs:
        outputs.check_free_space(policy, shutil.disk_usage(tmp_path).free + 2**30)


def test_written_files_get_the_users_umask(tiny_gpt2_dir: Path, tmp_path: Path) -> None:
    """transformers writes model.safetensors 0600 through a temporary file of its own; ours follow the umask, as it
    is when they are written (one set after the pipeline's modules were imported, here)."""
    lm = load_causal_lm(str(tiny_gpt2_dir), defaults().model)
    umask, before = 0o027, os.umask(0o027)
    try:
        with atomic_path(tmp_path / "model") as tmp:
            lm.save_pretrained(tmp)
    finally:
        os.umask(before)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [tmp_path / "model", *(tmp_path / "model").iterdir()]}
    assert modes == {"model": 0o777 & ~umask} | {name: 0o666 & ~umask for name in modes if name != "model"}
    assert "model.safetensors" in modes


# --- no run's outputs mix with another's, whatever is killed when (issue 33) ----------------------------------------


@pytest.fixture(scope="session")
def counts() -> dict[tuple[str, str], int]:
    """``count_calls``' answers, kept for the session: a count is the same for every test that readies the stage
    alike, and each costs a whole run of it."""
    return {}


def count_calls(project: Path, stage: str, where: str, tmp_path: Path, counts: dict[tuple[str, str], int]) -> int:
    """The calls matching ``where`` a complete run of ``stage`` makes (in a copy of ``project``, readied by
    ``stage_project`` with its outputs planted)."""
    if (stage, where) not in counts:
        copy = shutil.copytree(project, tmp_path / "count", symlinks=True)
        counted = tmp_path / "calls"
        assert run_with_fault(copy, stage, "--where", where, "--count", str(counted)).returncode == 0
        counts[stage, where] = int(counted.read_text())
    return counts[stage, where]


def states(project: Path, stage: str, old: dict[str, bytes]) -> dict[str, str]:
    """Each output of ``stage``: 'old' (as ``old`` has it), 'new', or 'missing'."""
    found = snapshot(project, stage)
    result = {}
    for output in wiring(stage, project / "dvc.yaml").outputs:
        mine = {name: data for name, data in found.items() if Path(name) == output or output in Path(name).parents}
        was = {name: data for name, data in old.items() if Path(name) == output or output in Path(name).parents}
        result[str(output)] = "missing" if not mine else "old" if mine == was else "new"
    return result


REPLACE = r"^c:posix\.replace$"  # every os.replace: the final replacement's renames are a run's last 8


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "before_end"), [("kill", 6), ("kill", 3), ("kill", 0), ("sigterm", 2)],
                         ids=["kill-setting-aside", "kill-moving-in", "kill-last-rename", "sigterm-moving-in"])
def test_a_stop_while_the_outputs_go_in_leaves_one_runs_outputs_and_the_rerun_ends_at_once(
        kind: str, before_end: int, stage_project: Callable[[str], Path], tmp_path: Path,
        counts: dict[tuple[str, str], int]) -> None:
    """kill -9 or SIGTERM at a rename of ppo's final replacement (4 previous outputs set aside, then 4 new ones moved
    in): never two runs' outputs side by side (a kill leaves some missing, a stop puts the previous ones back), and
    the rerun resumes after the last step from the checkpoint the run kept, training nothing."""
    project = stage_project("ppo")
    old = plant_outputs(project, "ppo")
    total = count_calls(project, "ppo", REPLACE, tmp_path, counts)
    result = run_with_fault(project, "ppo", "--where", REPLACE, "--at", str(total - before_end), "--kind", kind)
    if kind == "kill":
        assert result.returncode == -signal.SIGKILL, result.stderr
        assert {"old", "new"} - set(states(project, "ppo", old).values()), states(project, "ppo", old)
    else:
        assert (result.returncode, last_line(result)) == (143, "stopped by SIGTERM; checkpoint "
                                                               "data/checkpoints/ppo/step-000003 kept; rerun to "
                                                               "resume"), result.stderr
        assert set(states(project, "ppo", old).values()) == {"old"} and leftovers(project, "ppo") == []
    result = run_with_fault(project, "ppo", "--where", r"ppo_trainer\.py:PPOTrainer\.step$", "--at", "1",
                            "--kind", "error")  # a step would fail it
    assert result.returncode == 0 and "ppo: resuming after step 3" in result.stderr, result.stderr
    assert set(states(project, "ppo", old).values()) == {"new"} and leftovers(project, "ppo") == []


def test_a_stage_that_leaves_an_output_unwritten_replaces_none(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Replacing a previous output by nothing would pass for a result: a bug, and every previous output stays."""
    monkeypatch.chdir(tmp_path)
    Path("metrics").mkdir()
    Path("metrics/a.json").write_text("old a")
    Path("metrics/b.json").write_text("old b")
    outputs = [Path("metrics/a.json"), Path("metrics/b.json")]
    with pytest.raises(RuntimeError, match=r"without writing metrics/b\.json; no output was replaced"), \
            StagedOutputs(outputs, "demo") as staged:
        write_text("new a", staged[Path("metrics/a.json")])
    assert (Path("metrics/a.json").read_text(), Path("metrics/b.json").read_text()) == ("old a", "old b")
    assert sorted(p.name for p in Path("metrics").iterdir()) == ["a.json", "b.json"]


# --- a run that changed nothing, or whose params changed under it, is no result (issue 33) -------------------------


def nan_classifier(tiny_classifier_dir: Path, folder: Path) -> Path:
    """A real classifier whose score head is NaN: every score it gives is NaN."""
    shutil.copytree(tiny_classifier_dir, folder)
    tensors = load_file(folder / "model.safetensors")
    tensors = {key: torch.full_like(value, float("nan")) if key.startswith("score") else value
               for key, value in tensors.items()}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.slow
@pytest.mark.parametrize(("steps", "under_dvc"), [(4, False), (40, False), (40, True)],
                         ids=["fewer-steps-than-the-limit", "by-hand", "under-dvc"])
def test_a_run_that_skips_every_batch_stops_early_and_changes_nothing(
        steps: int, under_dvc: bool, stage_project: Callable[[str], Path], tiny_classifier_dir: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A reward that is NaN from step 0 under ppo.nan_policy: skip: the run stops once its first 10 steps (all of
    them when fewer) are skipped, not after sampling and scoring every step, and its line says what became of the
    previous outputs: kept, or under dvc, deleted by DVC before the stage ran (``dvc checkout`` brings them back)."""
    project = stage_project("ppo")
    set_params(project, **{"reward.model": str(nan_classifier(tiny_classifier_dir, project / "nan-clf")),
                           "ppo.nan_policy": "skip", "ppo.steps": steps, "ppo.checkpoint_every": 0})
    previous = plant_outputs(project, "ppo")
    monkeypatch.chdir(project)
    if under_dvc:
        monkeypatch.setenv("DVC_STAGE", "ppo")
    steps_taken = []
    real = PPOTrainer.step
    monkeypatch.setattr(PPOTrainer, "step", lambda self, *args: steps_taken.append(args[-1]) or real(self, *args))
    outputs = (" (dvc checkout ppo brings back the outputs DVC removed before the run)" if under_dvc
               else "; the previous outputs are kept")
    with pytest.raises(TrainingError) as error:
        ppo_stage.main()
    line = f"error: {cli.one_line(error.value, 'ppo', None)}{cli.under_dvc('ppo')}"  # as the stage prints it
    assert re.fullmatch(rf"error: steps 0-{min(steps, 10) - 1} were all skipped \(ppo.nan_policy: skip; the reward "
                        rf"scorer returned NaN/inf in every batch.*\): nothing was trained{re.escape(outputs)}", line)
    assert line.count("dvc checkout") == under_dvc
    assert steps_taken == list(range(min(steps, 10)))
    assert snapshot(project, "ppo") == previous and leftovers(project, "ppo") == []


@pytest.mark.slow
def test_params_changed_while_a_stage_runs_keep_its_outputs_from_being_replaced(
        stage_project: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """What a second ``dvc exp run`` in the workspace (or an edit) does: params.yaml changes mid-run. DVC would record
    the new values beside outputs trained with the old: the stage refuses to replace them. With checkpoints the run
    stops at its next one (the test below); without, this check before the outputs go in is the one that holds."""
    project = stage_project("ppo")
    set_params(project, **{"ppo.checkpoint_every": 0})
    previous = plant_outputs(project, "ppo")
    monkeypatch.chdir(project)
    real = PPOTrainer.step

    def step_then_edit(self: object, *args: object, **kwargs: object) -> object:
        if args[-1] == 2:  # the step after the first checkpoint: another process writes params.yaml
            set_params(project, **{"ppo.learning_rate": 2e-5})
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PPOTrainer, "step", step_then_edit)
    with pytest.raises(PipelineError, match=r"^params.yaml changed while ppo ran \(ppo.learning_rate: 1\.41e-05 -> "
                                            r"2e-05\): its outputs were not replaced.*dvc exp run --queue\)$"):
        ppo_stage.main()
    assert snapshot(project, "ppo") == previous and leftovers(project, "ppo") == []
    assert not list((project / "data/checkpoints/ppo").glob("step-*"))


@pytest.mark.slow
def test_params_changed_while_ppo_runs_stop_it_at_its_next_checkpoint(
        stage_project: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """params.yaml edited at step 2 of 8: the run stops after its step-3 checkpoint, which it keeps, instead of
    training all 8 steps with the old value and only then refusing to replace its outputs."""
    project = stage_project("ppo")
    set_params(project, **{"ppo.steps": 8})  # a checkpoint every 2 steps
    previous = plant_outputs(project, "ppo")
    monkeypatch.chdir(project)
    real, steps = PPOTrainer.step, []

    def step_then_edit(self: object, *args: object) -> object:
        steps.append(args[-1])
        if args[-1] == 2:
            set_params(project, **{"ppo.learning_rate": 2e-5})
        return real(self, *args)

    monkeypatch.setattr(PPOTrainer, "step", step_then_edit)
    with pytest.raises(PipelineError, match=r"^params.yaml changed while ppo ran \(ppo.learning_rate: 1\.41e-05 -> "
                                            r"2e-05\): stopped after step 3, .*; checkpoint "
                                            r"data/checkpoints/ppo/step-000003 kept: restore the params and rerun"):
        ppo_stage.main()
    assert steps == [0, 1, 2, 3]
    assert snapshot(project, "ppo") == previous and leftovers(project, "ppo") == []
    assert [p.name for p in (project / "data/checkpoints/ppo").glob("step-*")] == ["step-000003"]


@pytest.mark.parametrize("how", ["a file", "immutable"])
def test_a_checkpoints_folder_that_cannot_hold_the_lock_is_one_line(how: str, stage_project: Callable[[str], Path],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    project = stage_project("ppo")
    previous = plant_outputs(project, "ppo")
    folder = project / "data/checkpoints"
    monkeypatch.chdir(project)
    if how == "a file":
        folder.write_text("not a folder\n")
        with pytest.raises(PipelineError, match=r"^data/checkpoints: data/checkpoints is a file, not a folder"):
            ppo_stage.main()
    else:
        folder.mkdir()
        with unwritable(folder), pytest.raises(PipelineError, match=r"^data/checkpoints: cannot write in "
                                                                    r"data/checkpoints/ \(.+\); nothing was run$"):
            ppo_stage.main()
    assert snapshot(project, "ppo") == previous
