"""What DVC leaves to the stage it runs, tried through real ``dvc`` commands (issues 33, 54).

- DVC releases its repository lock while a stage's command runs, so a second ``dvc exp run`` in the same workspace
  writes its ``-S`` values into params.yaml under the running stage (and then fails on DVC's lock of the stage's
  outputs): the running stage sees the change and records nothing.
- ``kill <pid of dvc>`` leaves the stage running on its own: it stops right after its next checkpoint, and the next
  ``dvc repro`` resumes from it instead of starting over.
- A stage killed after its outputs went in but before DVC recorded it: the next ``dvc repro`` removes them and reruns
  it, which ends at once from the checkpoint of the run's last step.
- A tool that runs ``dvc exp run`` (tools.recipe), stopped by Ctrl-C or by a SIGTERM of its own, stops dvc's stage
  and waits for dvc, which releases its locks.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import dvc, project_env, set_params

CHECKPOINTS = Path("data/checkpoints/ppo")
FINISHED = ("models/policy/model.safetensors", "data/rollouts/steps-000000-000001.parquet",
            "data/rollouts/steps-000002-000002.parquet")


def committed(project: Path, **updates: object) -> Path:
    """The ppo project with ``updates`` committed, for DVC to run ppo alone (``-s``); sft, reward and the optimum are
    off, so their outputs are their markers."""
    set_params(project, **updates)
    for output in ("models/sft", "models/reward"):
        (project / output).mkdir(parents=True)
        (project / output / "DISABLED").write_text(f"{output} is off\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", "add", "-A"], cwd=project, check=True, env=env)
    subprocess.run(["git", "commit", "-qm", "tiny ppo"], cwd=project, check=True, env=env)
    (project / "data/optimum").mkdir(parents=True)  # a DVC output, which git must not track (models/ it ignores)
    (project / "data/optimum/DISABLED").write_text("optimum is off\n")
    return project


@pytest.fixture
def long_ppo(ppo_project: Path) -> Path:
    """40 steps (a checkpoint every 4): long enough to act on while it runs."""
    return committed(ppo_project, **{"ppo.steps": 40, "ppo.checkpoint_every": 4})


def start(project: Path, module: str, *args: str, shell: str | None = None) -> subprocess.Popen:
    """``python -m <module> <args>`` (dvc, a tool) running in ``project``, in a process group of its own (which a
    test signals as a terminal signals its foreground group); ``shell``: the SHELL DVC runs stage commands with."""
    env = project_env(project) | ({"SHELL": shell} if shell else {})
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=project, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def wait_for_checkpoint(project: Path, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not list((project / CHECKPOINTS).glob("step-*")):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.1)


# tests/fault.py's stop: the stage stops itself (SIGSTOP) as it checks for a reason to stop after its first checkpoint
STOP_AT_FIRST_CHECK = "--kind stop --where checkpoint.py:stop_reason$ --at 1"


def ppo_under_fault(project: Path, fault: str) -> str:
    """Make ppo's command in ``project``'s dvc.yaml tests/fault.py's ``fault`` around the stage; the dvc.yaml as it
    was (to write back for a rerun that runs the stage itself)."""
    shutil.copy(Path(__file__).parent / "fault.py", project / "fault.py")
    wired = (project / "dvc.yaml").read_text()
    (project / "dvc.yaml").write_text(wired.replace("cmd: python -m stages.ppo", f"cmd: python fault.py ppo {fault}"))
    return wired


def wait_for_stopped_stage(project: Path, process: subprocess.Popen, timeout: float = 300) -> psutil.Process:
    """The stage process that ``process`` (dvc) started, once it has stopped itself (tests/fault.py's ``stop``)."""
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, process.communicate()
        for child in psutil.Process(process.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "fault.py" in " ".join(child.cmdline()) and child.status() == psutil.STATUS_STOPPED:
                    return child
        assert time.monotonic() < deadline, "the stage never stopped at its first checkpoint"
        time.sleep(0.1)


def locked_learning_rate(project: Path) -> float:
    """ppo.learning_rate as dvc.lock records it for the ppo stage."""
    ppo = (project / "dvc.lock").read_text().split("\n  ppo:\n")[1].split("\n  sample_pairs:\n")[0]
    return float(re.search(r"learning_rate: ([0-9.e+-]+)", ppo).group(1))


@pytest.mark.slow
def test_a_second_exp_run_in_the_workspace_leaves_no_run_recorded_with_its_params(long_ppo: Path,
                                                                                 tmp_path: Path) -> None:
    """While DVC runs ppo (its repository lock released), ``dvc exp run -S`` writes its value into params.yaml and
    fails on DVC's lock of ppo's outputs; the first run, its params changed under it, records nothing; with them
    restored, ``dvc repro`` ends the run at once from its last checkpoint and records it with its own params. The
    stage stops itself at its first checkpoint's check (tests/fault.py) until the second run has failed: on a busy
    machine it could otherwise finish first."""
    inputs = ("data/prompts", "data/optimum", "models/sft", "models/reward")
    for name in inputs:
        shutil.copytree(long_ppo / name, tmp_path / name)
    set_params(long_ppo, **{"ppo.learning_rate": 1e-4})
    wired = ppo_under_fault(long_ppo, STOP_AT_FIRST_CHECK)
    first = start(long_ppo, "dvc", "repro", "-s", "ppo")
    stage = wait_for_stopped_stage(long_ppo, first)
    second = dvc(long_ppo, "exp", "run", "-s", "ppo", "-S", "ppo.learning_rate=2e-4", check=False)
    assert second.returncode != 0 and "is busy, it is being blocked by" in second.stderr, second.stderr
    assert "learning_rate: 0.0002" in (long_ppo / "params.yaml").read_text()
    (long_ppo / "dvc.yaml").write_text(wired)  # the rerun runs the stage itself
    stage.resume()
    _, stderr = first.communicate(timeout=600)
    assert first.returncode != 0 and "Traceback" not in stderr
    changed = [line for line in stderr.splitlines() if line.startswith("error: params.yaml changed while ppo ran")]
    assert len(changed) == 1 and "(ppo.learning_rate: 0.0001 -> 0.0002)" in changed[0], stderr
    assert changed[0].endswith("(dvc checkout ppo brings back the outputs DVC removed before the run)")
    assert not (long_ppo / "dvc.lock").exists()
    kept = sorted(p.name for p in (long_ppo / CHECKPOINTS).glob("step-*"))  # the one it stopped at
    assert kept and f"checkpoint {CHECKPOINTS / kept[-1]} kept" in changed[0], changed[0]

    set_params(long_ppo, **{"ppo.learning_rate": 1e-4})
    for name in inputs:  # the second's checkout removed them, DVC having no record of them in this test project
        shutil.rmtree(long_ppo / name, ignore_errors=True)  # (where their stages ran, it checks them out)
        shutil.copytree(tmp_path / name, long_ppo / name)
    rerun = dvc(long_ppo, "repro", "-s", "ppo")
    assert f"resuming after step {int(kept[-1].removeprefix('step-'))}" in rerun.stderr + rerun.stdout
    assert locked_learning_rate(long_ppo) == 1e-4


@pytest.mark.slow
def test_a_stage_whose_dvc_was_killed_stops_at_its_next_checkpoint_and_the_rerun_resumes(long_ppo: Path) -> None:
    """The stage stops itself (SIGSTOP, through tests/fault.py) as it checks for a reason to stop after its first
    checkpoint; dvc is killed then, and the stage continued: however fast it trains, it is still running when dvc
    goes."""
    set_params(long_ppo, **{"ppo.learning_rate": 2e-5})
    wired = ppo_under_fault(long_ppo, STOP_AT_FIRST_CHECK)
    repro = start(long_ppo, "dvc", "repro", "-s", "ppo")
    stage = wait_for_stopped_stage(long_ppo, repro)
    os.kill(repro.pid, signal.SIGTERM)  # dvc alone, as `kill <pid>` does: its stage is not in the signal's way
    repro.wait(timeout=600)
    (long_ppo / "dvc.yaml").write_text(wired)  # the rerun runs the stage itself
    stage.resume()
    _, stderr = repro.communicate(timeout=600)  # the stage holds dvc's pipes: this returns once it has exited too
    stopped = [line for line in stderr.splitlines() if "has exited, so it would never record this run" in line]
    assert len(stopped) == 1 and stopped[0].startswith("error: stopped after step "), stderr
    assert "Traceback" not in stderr
    kept = sorted(p.name for p in (long_ppo / CHECKPOINTS).glob("step-*"))
    assert kept and f"checkpoint {CHECKPOINTS / kept[-1]} kept" in stopped[0]
    rerun = dvc(long_ppo, "repro", "-s", "ppo")
    assert f"resuming after step {int(kept[-1].removeprefix('step-'))}" in rerun.stderr + rerun.stdout


@pytest.mark.slow
def test_a_finished_run_dvc_never_recorded_ends_at_once_on_the_next_repro(ppo_project: Path) -> None:
    """ppo killed after its outputs went in, before DVC recorded it (SIGKILL at the first call after its main, through
    tests/fault.py as the stage's command): DVC records nothing, and the next ``dvc repro`` removes the outputs and
    reruns it, which resumes after the last step and writes the same weights and rollouts without training."""
    committed(ppo_project)
    after_main = r"^c:_signal\.signal$ --at 4"  # run_stage: 3 stop signals handled before main, ignored after
    wired = ppo_under_fault(ppo_project, f"--kind kill --where {after_main}")
    killed = dvc(ppo_project, "repro", "-s", "ppo", check=False)
    assert killed.returncode != 0 and "fault: kill at call 4" in killed.stderr, killed.stderr
    assert not (ppo_project / "dvc.lock").exists()
    finished = {path: (ppo_project / path).read_bytes() for path in FINISHED}
    (ppo_project / "dvc.yaml").write_text(wired)
    rerun = dvc(ppo_project, "repro", "-s", "ppo")
    assert "resuming after step 2" in rerun.stderr + rerun.stdout
    assert {path: (ppo_project / path).read_bytes() for path in FINISHED} == finished
    assert "models/policy" in (ppo_project / "dvc.lock").read_text()


def processes_in(folder: Path) -> list[str]:
    """The command lines of the processes whose working directory is ``folder``."""
    found = []
    for process in psutil.process_iter(["cwd", "cmdline"]):
        if process.info["cwd"] == str(folder):
            found.append(" ".join(process.info["cmdline"] or []))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm-to-the-tool"])
def test_a_stopped_recipe_stops_dvcs_stage_and_leaves_no_lock(stop: str, ppo_project: Path, imdb_dir: Path,
                                                               tokenizer_dir: Path) -> None:
    """Ctrl-C reaches the tool, dvc and the stage; a SIGTERM sent to the tool alone reaches neither. Either way the
    stage stops with its checkpoint and its line, dvc ends as a stopped ``dvc exp run`` does, its locks released, and
    nothing runs on (subprocess.run killed dvc a quarter of a second after the stop: its locks stayed held, and after
    a SIGTERM its stage trained on). The recipe runs the pipeline up to ppo: dvc exp run first checks out what the
    commit records, which here is nothing. DVC runs the stage under /bin/sh, which on Debian is dash: it waits for
    its command where bash execs it, so a signal sent to it would end it, and DVC's report, before the stage's line."""
    (ppo_project / "presets").mkdir()
    (ppo_project / "presets/long.yaml").write_text("ppo:\n  steps: 40\n  checkpoint_every: 4\n")
    committed(ppo_project, **{"data.source": str(imdb_dir), "model.tokenizer": str(tokenizer_dir),
                              "prepare.eval_prompts": 8, "prepare.train_pairs": 8, "prepare.test_pairs": 4})
    recipe = start(ppo_project, "tools.recipe", "long", "ppo", shell="/bin/sh")
    wait_for_checkpoint(ppo_project, recipe)
    if stop == "ctrl-c":  # the terminal signals its foreground process group
        os.killpg(recipe.pid, signal.SIGINT)
    else:
        os.kill(recipe.pid, signal.SIGTERM)
    signum = signal.SIGINT if stop == "ctrl-c" else signal.SIGTERM
    _, stderr = recipe.communicate(timeout=300)
    lines = stderr.strip().splitlines()
    assert recipe.returncode == 128 + signum and "Traceback" not in stderr, stderr
    said = "interrupted" if stop == "ctrl-c" else "stopped by SIGTERM"
    stage = [line for line in lines if line.startswith(f"{said} at step ")]
    assert len(stage) == 1 and "; checkpoint data/checkpoints/ppo/step-" in stage[0], stderr
    # the stage exits 128 + signum and its shell with it; Ctrl-C also reaches the shell, which may die of it (-signum)
    failed = "ERROR: failed to reproduce 'ppo': failed to run: python -m stages.ppo, exited with "
    codes = (128 + signum, -signum) if stop == "ctrl-c" else (128 + signum,)
    assert lines[-1] == said and lines[-2] in [f"{failed}{code}" for code in codes], stderr
    rwlock = ppo_project / ".dvc/tmp/rwlock"
    assert not rwlock.exists() or json.loads(rwlock.read_text() or "{}") in ({}, {"read": {}, "write": {}})
    assert processes_in(ppo_project) == []
