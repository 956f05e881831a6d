"""The checkpoint module on its own (fast): fingerprints, atomic save and pruning, RNG round trips, the disk-space
check, and a tampered optimizer file refused."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from rlhf.pipeline.errors import PipelineError
from rlhf.pipeline.params import defaults
from rlhf.train import checkpoint, rng

ROOT = Path(__file__).resolve().parents[1]


def test_fingerprint_follows_params_file_content_and_the_stages_code(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage's params and code as dvc.yaml lists them (a copy of the project standing for the code that runs)."""
    copy = tmp_path / "project"
    for name in ("stages", "rlhf"):
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "dvc.yaml", copy / "dvc.yaml")
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
