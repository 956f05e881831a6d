"""What DVC leaves to the stage it runs, tried through real ``dvc`` commands (issue 33).

- DVC releases its repository lock while a stage's command runs, so a second ``dvc exp run`` in the same workspace
  would rewrite params.yaml under the running stage: it is refused before it changes anything, and the first run's
  experiment is recorded with its own params.
- ``kill <pid of dvc>`` leaves the stage running on its own: it stops right after its next checkpoint, and the next
  ``dvc repro`` resumes from it instead of starting over.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import dvc, set_params
from helpers import run_cli

CHECKPOINTS = Path("data/checkpoints/ppo")


@pytest.fixture
def long_ppo(ppo_project: Path) -> Path:
    """The ppo project committed with 40 steps (a checkpoint every 4): long enough to act on while it runs. DVC
    runs ppo alone (``-s``); sft and reward are off, so their outputs are their markers."""
    set_params(ppo_project, **{"ppo.steps": 40, "ppo.checkpoint_every": 4})
    for model in ("sft", "reward"):
        (ppo_project / "models" / model).mkdir(parents=True)
        (ppo_project / "models" / model / "DISABLED").write_text(f"{model} is off\n")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", "add", "-A"], cwd=ppo_project, check=True, env=env)
    subprocess.run(["git", "commit", "-qm", "tiny ppo"], cwd=ppo_project, check=True, env=env)
    return ppo_project


def start_dvc(project: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(project), "DVC_NO_ANALYTICS": "1"}
    return subprocess.Popen([sys.executable, "-m", "dvc", *args], cwd=project, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for_checkpoint(project: Path, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not list((project / CHECKPOINTS).glob("step-*")):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.1)


def locked_learning_rate(project: Path) -> float:
    """ppo.learning_rate as dvc.lock records it for the ppo stage."""
    ppo = (project / "dvc.lock").read_text().split("\n  ppo:\n")[1].split("\n  sample_pairs:\n")[0]
    return float(re.search(r"learning_rate: ([0-9.e+-]+)", ppo).group(1))


@pytest.mark.slow
def test_a_second_exp_run_in_the_workspace_is_refused_before_it_rewrites_params(long_ppo: Path) -> None:
    """While DVC runs ppo (with its repository lock released), ``dvc exp run -S`` is refused by DVC itself before it
    stashes the workspace or writes its value; the running stage is recorded with its own params."""
    set_params(long_ppo, **{"ppo.learning_rate": 1e-4})
    first = start_dvc(long_ppo, "repro", "-s", "ppo")
    wait_for_checkpoint(long_ppo, first)
    second = dvc(long_ppo, "exp", "run", "-s", "ppo", "-S", "ppo.learning_rate=2e-4", check=False)
    assert second.returncode != 0
    assert re.search(r"'workspace' is busy, it is being blocked by:\s+\(PID \d+\): python -m stages.ppo",
                     second.stderr), second.stderr
    assert "learning_rate: 0.0001" in (long_ppo / "params.yaml").read_text()  # untouched by the second
    out, err = first.communicate(timeout=600)
    assert first.returncode == 0, out + err
    assert locked_learning_rate(long_ppo) == 1e-4


@pytest.mark.slow
def test_a_stage_whose_dvc_was_killed_stops_at_its_next_checkpoint_and_the_rerun_resumes(long_ppo: Path) -> None:
    set_params(long_ppo, **{"ppo.learning_rate": 2e-5})
    repro = start_dvc(long_ppo, "repro", "-s", "ppo")
    wait_for_checkpoint(long_ppo, repro)
    os.kill(repro.pid, signal.SIGTERM)  # dvc alone, as `kill <pid>` does: its stage is not in the signal's way
    _, stderr = repro.communicate(timeout=600)  # the stage holds dvc's pipes: this returns once it has exited too
    stopped = [line for line in stderr.splitlines() if "has exited, so it would never record this run" in line]
    assert len(stopped) == 1 and stopped[0].startswith("error: stopped after step "), stderr
    assert "Traceback" not in stderr
    kept = sorted(p.name for p in (long_ppo / CHECKPOINTS).glob("step-*"))
    assert kept and f"checkpoint {CHECKPOINTS / kept[-1]} kept" in stopped[0]
    rerun = dvc(long_ppo, "repro", "-s", "ppo")
    assert f"resuming after step {int(kept[-1].removeprefix('step-'))}" in rerun.stderr + rerun.stdout


def test_a_stage_that_cannot_take_dvcs_lock_is_one_line(project: Path) -> None:
    """A read-only project, or a .dvc/tmp the user cannot write (here a file), was a traceback from taking the lock."""
    shutil.rmtree(project / ".dvc/tmp", ignore_errors=True)
    (project / ".dvc/tmp").write_text("")
    result = run_cli(project, "evaluate")
    assert (result.returncode, result.stderr) == (1, "error: .dvc/tmp/exps: cannot take DVC's experiments lock there "
                                                     "(Not a directory); nothing was run\n")
