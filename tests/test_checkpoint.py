"""The checkpoint module on its own (fast): fingerprints, atomic save and pruning, RNG round trips, the disk-space
check, and a tampered optimizer file refused."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT

from rlhf.pipeline.errors import PipelineError
from rlhf.pipeline.params import defaults
from rlhf.train import checkpoint, rng


def test_fingerprint_follows_params_file_content_and_the_stages_code(project: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage's params and code as dvc.yaml lists them (a copy of the project standing for the code that runs)."""
    copy = project
    monkeypatch.chdir(copy)
    monkeypatch.setattr(checkpoint, "ROOT", copy)
    data = tmp_path / "prompts.parquet"
    data.write_bytes(b"one")
    params = defaults()
    faster = params.model_copy(update={"ppo": params.ppo.model_copy(update={"learning_rate": 2e-5})})
    base = checkpoint.fingerprint("ppo", params, [data])
    assert checkpoint.fingerprint("ppo", params, [data]) == base
    assert checkpoint.fingerprint("ppo", faster, [data]) != base
    assert checkpoint.fingerprint("ppo", faster, [data], exclude=("ppo.learning_rate",)) == checkpoint.fingerprint(
        "ppo", params, [data], exclude=("ppo.learning_rate",))
    assert checkpoint.fingerprint("sft", faster, [data]) == checkpoint.fingerprint("sft", params, [data])  # not read
    data.write_bytes(b"two")
    assert checkpoint.fingerprint("ppo", params, [data]) != base
    data.write_bytes(b"one")
    # the PPO math changes: the ppo run's fingerprint changes, sft's does not
    sft = checkpoint.fingerprint("sft", params, [data])
    assert checkpoint.fingerprint("ppo", params, [data]) == base
    with open(copy / "rlhf/rl/ppo.py", "a") as f:
        f.write("\n# changed\n")
    assert checkpoint.fingerprint("ppo", params, [data]) != base
    assert checkpoint.fingerprint("sft", params, [data]) == sft
    # so does an edited reward function (rewards/ is among ppo's deps)
    changed = checkpoint.fingerprint("ppo", params, [data])
    with open(copy / "rewards/text.py", "a") as f:
        f.write("\n# changed\n")
    assert checkpoint.fingerprint("ppo", params, [data]) != changed


def test_fingerprint_of_a_folder_ignores_bytecode(tmp_path: Path) -> None:
    (tmp_path / "code").mkdir()
    (tmp_path / "code/a.py").write_text("x = 1\n")
    before = checkpoint.hash_paths([tmp_path / "code"])
    (tmp_path / "code/__pycache__").mkdir()
    (tmp_path / "code/__pycache__/a.pyc").write_bytes(b"\0")
    assert checkpoint.hash_paths([tmp_path / "code"]) == before
    (tmp_path / "code/a.py").write_text("x = 2\n")
    assert checkpoint.hash_paths([tmp_path / "code"]) != before


def save(folder: Path, step: int, key: str, model: torch.nn.Module) -> Path:
    optimizer = torch.optim.AdamW(model.parameters())
    return checkpoint.save(folder, step, model, optimizer.state_dict(), {"fingerprint": key}, {})


def test_save_keeps_only_the_newest_and_find_prunes_other_runs(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.Linear(3, 2)
    folder = tmp_path / "ppo"
    save(folder, 1, "run-a", model)
    save(folder, 3, "run-a", model)
    assert [p.name for p in checkpoint.checkpoints(folder)] == ["step-000003"]
    (folder / ".step-000005.tmp").mkdir()  # a save killed before its rename
    found = checkpoint.find(folder, "run-a")
    assert found.step == 3 and not (folder / ".step-000005.tmp").exists()
    caplog.set_level("INFO")
    assert checkpoint.find(folder, "run-b") is None
    assert "another run's checkpoint" in caplog.text and checkpoint.checkpoints(folder) == []


def test_weights_round_trip_exactly_with_tied_weights(tmp_path: Path, tiny_gpt2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir)
    with torch.no_grad():
        lm.transformer.wte.weight.add_(0.125)  # the LM head is tied to it
    found = loaded(save(tmp_path, 0, "k", lm))
    fresh = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir)
    checkpoint.load_weights(found, fresh)
    assert all(torch.equal(a, b) for a, b in zip(lm.state_dict().values(), fresh.state_dict().values(), strict=True))
    assert fresh.lm_head.weight.data_ptr() == fresh.transformer.wte.weight.data_ptr()


def loaded(path: Path) -> checkpoint.Checkpoint:
    return checkpoint.Checkpoint(path, int(path.name.removeprefix("step-")), checkpoint.read_state(path))


class Exploit:
    def __reduce__(self) -> tuple:
        return (print, ("pwned",))


def test_an_optimizer_file_that_pickles_code_is_refused(tmp_path: Path) -> None:
    path = save(tmp_path, 0, "k", torch.nn.Linear(2, 2))
    torch.save({"state": Exploit()}, path / checkpoint.OPTIMIZER_FILE)
    with pytest.raises(PipelineError, match=r"optimizer.pt: refused: it pickles objects other than tensors"):
        checkpoint.load_optimizer_state(loaded(path))


def test_rng_states_round_trip_through_json() -> None:
    generator = torch.Generator().manual_seed(5)
    states = json.loads(json.dumps(rng.rng_states({"g": generator})))
    expected = (random.random(), np.random.rand(), torch.rand(1).item(), torch.rand(1, generator=generator).item())
    random.seed(1), np.random.seed(1), torch.manual_seed(1), generator.manual_seed(1)
    rng.set_rng_states(states, {"g": generator})
    assert (random.random(), np.random.rand(), torch.rand(1).item(),
            torch.rand(1, generator=generator).item()) == expected


def test_too_little_disk_space_names_the_param_and_folder(tmp_path: Path) -> None:
    model = torch.nn.Linear(10, 10)  # 110 weights: 440 bytes, plus two fp32 Adam moments
    assert checkpoint.checkpoint_bytes(model) == 3 * 440
    needed = checkpoint.checkpoint_bytes(model)
    checkpoint.check_room_for_checkpoints(tmp_path, needed, "ppo.checkpoint_every", "run-a")
    with pytest.raises(PipelineError, match=rf"^ppo.checkpoint_every: {tmp_path} has \d+ MiB free, checkpoints "
                                            r"need about \d+ MiB"):
        checkpoint.check_room_for_checkpoints(tmp_path, 2**62, "ppo.checkpoint_every", "run-a")


def edit_state(path: Path, change: Callable[[dict], object]) -> None:
    state = json.loads((path / checkpoint.STATE_FILE).read_text())
    change(state)
    (path / checkpoint.STATE_FILE).write_text(json.dumps(state))


def half_deleted(path: Path) -> None:
    """What a kill inside a file-by-file deletion could leave: state.json (the right fingerprint) without weights."""
    (path / checkpoint.WEIGHTS_FILE).unlink()
    (path / checkpoint.OPTIMIZER_FILE).unlink()


def stray_file(path: Path) -> None:
    shutil.rmtree(path)
    path.write_text("not a checkpoint\n")


def overwrite(file: Path, at: int, n: int = 64) -> None:
    """Flip ``n`` bytes of ``file`` from offset ``at`` (negative: from its end); its size stays."""
    data = bytearray(file.read_bytes())
    start = at % len(data)
    data[start:start + n] = bytes(b ^ 0xFF for b in data[start:start + n])
    file.write_bytes(bytes(data))


def same_size_copy(path: Path) -> None:
    """The issue's damage: 64 bytes in the middle of a rollout chunk's copy, its size kept."""
    copy = path / checkpoint.FILES_DIR / "rollouts/steps-0.parquet"
    overwrite(copy, copy.stat().st_size // 2)


DAMAGES = {
    "weights-truncated": lambda path: os.truncate(path / checkpoint.WEIGHTS_FILE, 40),
    "optimizer-truncated": lambda path: os.truncate(path / checkpoint.OPTIMIZER_FILE, 100),
    "key-missing": lambda path: edit_state(path, lambda state: state.pop("data")),
    "half-deleted": half_deleted,
    "copies-gone": lambda path: shutil.rmtree(path / checkpoint.FILES_DIR),
    "copy-truncated": lambda path: os.truncate(path / checkpoint.FILES_DIR / "rollouts/steps-0.parquet", 10),
    "copy-overwritten": same_size_copy,
    "weights-overwritten": lambda path: overwrite(path / checkpoint.WEIGHTS_FILE, -8, 8),  # a tensor's bytes
    "optimizer-overwritten": lambda path: overwrite(path / checkpoint.OPTIMIZER_FILE, -200, 8),
    "manifest-edited": lambda path: edit_state(path, lambda state: state.update(manifest=[])),
    "step-past-the-end": lambda path: edit_state(path, lambda state: state.update(step=99)),
    "a-stray-file": stray_file,
}


@pytest.mark.parametrize("damage", DAMAGES.values(), ids=DAMAGES.keys())
def test_a_damaged_checkpoint_is_set_aside_and_the_newest_whole_one_used(damage: Callable[[Path], None],
                                                                         tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint is checked before use against what its state.json (written last) says was saved; a damaged one
    is removed with one log line, and the run resumes from its newest whole checkpoint (here an older one)."""
    model, folder, copies = torch.nn.Linear(3, 2), tmp_path / "ppo", tmp_path / "staged"
    (copies / "rollouts").mkdir(parents=True)
    (copies / "rollouts/steps-0.parquet").write_bytes(b"PAR1" * 100)
    state = {"fingerprint": "run-a", "data": {"drawn": 3}}
    older = checkpoint.save(folder, 1, model, {}, state, {"rollouts": copies / "rollouts"})
    shutil.copytree(older, tmp_path / "older")
    newest = checkpoint.save(folder, 3, model, {}, state, {"rollouts": copies / "rollouts"})
    shutil.copytree(tmp_path / "older", older)  # an older whole checkpoint of the same run, beside the newest
    damage(newest)
    caplog.set_level("INFO")
    found = checkpoint.find(folder, "run-a", required=("data",), steps=10)
    assert found is not None and found.path == older
    assert f"removing {newest} (" in caplog.text and not os.path.lexists(newest)
    assert sorted(p.name for p in folder.iterdir()) == ["step-000001"]  # nothing half removed left behind


def test_a_resume_restores_the_files_saved_and_nothing_else(tmp_path: Path) -> None:
    """What ``find`` checked is what goes back into the staging: a file put beside the copies since is left out."""
    staged = tmp_path / "staged"
    (staged / "curves/plots").mkdir(parents=True)
    (staged / "curves/plots/reward.tsv").write_text("step\treward\n0\t1.5\n")
    path = checkpoint.save(tmp_path / "ppo", 0, torch.nn.Linear(2, 2), {}, {"fingerprint": "run-a"},
                           {"curves": staged / "curves", "rollouts": staged / "rollouts"})
    (path / checkpoint.FILES_DIR / "curves/plots/stray.tsv").write_text("not saved\n")
    shutil.rmtree(staged)
    checkpoint.restore_files(checkpoint.find(tmp_path / "ppo", "run-a"),
                             {"curves": staged / "curves", "rollouts": staged / "rollouts"})
    assert [p.relative_to(staged).as_posix() for p in sorted(staged.rglob("*"))] == [
        "curves", "curves/plots", "curves/plots/reward.tsv"]


def test_a_removed_checkpoint_vanishes_in_one_step(tmp_path: Path) -> None:
    """An old checkpoint goes by one rename to a hidden name first (a kill during the deletion leaves no visible half
    of it), and the next find clears what such a kill left."""
    model, folder = torch.nn.Linear(3, 2), tmp_path / "ppo"
    first = checkpoint.save(folder, 1, model, {}, {"fingerprint": "run-a"}, {})
    renames = []
    real = os.replace
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "replace", lambda src, dst: (renames.append((Path(src), Path(dst))), real(src, dst)))
        checkpoint.save(folder, 3, model, {}, {"fingerprint": "run-a"}, {})
    assert renames[-1] == (first, folder / ".step-000001.removed")
    (folder / ".step-000002.removed").mkdir()  # a kill during a deletion
    assert checkpoint.find(folder, "run-a").step == 3 and not (folder / ".step-000002.removed").exists()


STAGE = """
import sys, time
from pathlib import Path
from rlhf.train import checkpoint
checkpoint.find(Path("checkpoints"), "run")  # as a stage does before its step 0
Path("ready").touch()
while not Path("go").exists():
    time.sleep(0.02)
if "--clock-update" in sys.argv:  # the kernel's boot time in wall-clock seconds, a second later after a clock update
    import psutil._pslinux as linux
    boot_time = linux.boot_time
    linux.boot_time = lambda: boot_time() + 1
print(checkpoint.dvc_gone())
"""


def run_under_fake_dvc(tmp_path: Path, *stage_args: str, kill_dvc: bool) -> tuple[str, int]:
    """STAGE run by a script named dvc (how checkpoint._is_dvc knows a dvc process), that dvc killed once the stage
    has looked it up or left running: what the stage's dvc_gone printed, and the fake dvc's pid."""
    fake_dvc = tmp_path / "dvc"
    fake_dvc.write_text(f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {STAGE!r}, "
                        f"*{list(stage_args)!r}], stdout=open('out', 'w'))\ntime.sleep(600)\n")
    env = {**os.environ, "DVC_STAGE": "ppo", "PYTHONPATH": str(ROOT)}
    dvc = subprocess.Popen([sys.executable, str(fake_dvc)], cwd=tmp_path, env=env)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists():
            assert dvc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        if kill_dvc:
            dvc.kill()
            dvc.wait()
        (tmp_path / "go").touch()
        deadline = time.monotonic() + 60
        while not (tmp_path / "out").read_text().strip():
            assert time.monotonic() < deadline, "the stage never answered"
            time.sleep(0.05)
    finally:
        dvc.kill()
        dvc.wait()
    return (tmp_path / "out").read_text().strip(), dvc.pid


def test_a_dvc_killed_before_the_first_checkpoint_is_still_seen_to_have_exited(tmp_path: Path) -> None:
    """The dvc that ran the stage is found when the run looks for its checkpoint: looked up only at the first
    checkpoint, a dvc killed before it was no longer among the re-parented stage's ancestors, and the stage ran on."""
    printed, pid = run_under_fake_dvc(tmp_path, kill_dvc=True)
    assert printed == str(pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="emulates Linux's boot time moving")
def test_a_clock_update_is_not_taken_for_dvc_exiting(tmp_path: Path) -> None:
    """A clock update moves the boot time in wall-clock seconds, and with it every process's wall-clock start: a
    running dvc compared by that start was taken for another process, and a long PPO run stopped at a checkpoint."""
    assert run_under_fake_dvc(tmp_path, "--clock-update", kill_dvc=False)[0] == "None"
