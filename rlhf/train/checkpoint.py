"""Resumable training checkpoints, kept outside DVC's outputs so that rerunning a killed stage resumes it.

DVC deletes a stage's outputs before it runs, so checkpoints live in ``data/checkpoints/<stage>/`` (git-ignored, not a
DVC output). Each is a folder ``step-NNNNNN`` written to a temporary sibling and renamed into place (io.atomic_path),
so a kill at any moment leaves the previous checkpoint or the new one, never half of one; an old one goes by one rename
first (``discard``). Its ``state.json``, written last, carries a fingerprint of everything that determines the run
(params, input files, code, library versions, process count) and the size and hash of every file saved; a checkpoint
with another fingerprint belongs to another run, and one whose files are not what was saved (``damage``: a kill, a
full disk, a bad sector, a hand) is damaged: either is removed with a log line, and the run resumes from its newest
whole checkpoint or starts over: a damaged copy of a rollout chunk is found before it is published. A run saves one
after its last step too and keeps it: rerun (a finished run whose outputs DVC never recorded, a kill while they went
in), it ends at once; a later run with other params removes it. A stage whose dvc was killed stops right after its
next checkpoint (``stop_if_dvc_gone``).

Layout of a checkpoint:
    model.safetensors   the trained weights of the module (``trained_weights``: policy, and value head and critic
                        where trained; under LoRA the adapters, not the frozen base, which is the run's input)
    optimizer.pt        the optimizer's state (torch.save, loaded weights_only); ppo.shard: both as DCP's shards
    state.json          step, fingerprint, the trainer's scalars, every RNG state (tensors as base64), the manifest
    files/<name>/       copies of the staged outputs written so far (rollout log chunks, curves), restored on resume
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import pickle
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch
import xxhash
from safetensors.torch import load_file, save_file

from rlhf.pipeline.errors import PipelineError
from rlhf.pipeline.io import atomic_path, check_writable, remove, require_free_space
from rlhf.pipeline.params import Params, changed_since_read, expand, stage_values
from rlhf.pipeline.paths import CHECKPOINT_PREFIX, checkpoint_dir, checkpoints
from rlhf.pipeline.wiring import wiring

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
FILES_DIR = "files"
MANIFEST = "manifest"  # state.json's {file: {"size": bytes, HASH: hex}} of everything saved before it
# a 128-bit hash of each file's content against damage, not against a hand that could rewrite state.json as well:
# xxh3 reads a checkpoint several times faster than sha256 (gigabytes of weights and optimizer state per save)
HASH = "xxh3_128"
CODE = ("stages/", "rlhf/", "rewards")  # the dvc.yaml deps that are the project's code (with any .py file listed)
ROOT = Path(__file__).resolve().parents[2]  # the project whose code runs
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq: an AdamW checkpoint holds each weight three times
REMOVED = ".removed"  # suffix of a checkpoint being deleted (discard)


@dataclass
class Checkpoint:
    path: Path
    step: int  # the last completed step
    state: dict[str, Any]


# --- fingerprint -----------------------------------------------------------------------------------------------------


def _ignored(path: Path) -> bool:
    """Bytecode caches and hidden files change without the inputs changing."""
    return "__pycache__" in path.parts or path.name.startswith(".")


def hash_paths(paths: Iterable[Path | str]) -> str:
    """sha256 over the names and bytes of the files (folders: every file below, in sorted order)."""
    digest = hashlib.sha256()
    for path in map(Path, paths):
        files = sorted(p for p in path.rglob("*") if p.is_file() and not _ignored(p)) if path.is_dir() else [path]
        for file in files:
            digest.update(str(file.relative_to(path) if path.is_dir() else file).encode())
            with open(file, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):  # noqa: B023 (f is bound for this loop only)
                    digest.update(block)
    return digest.hexdigest()


def fingerprint(name: str, params: Params, paths: Iterable[Path | str], exclude: Iterable[str] = (),
                extra: dict[str, Any] | None = None) -> str:
    """What determines a run of stage ``name``: the params dvc.yaml lists for it (but ``exclude``) and ``extra``, the
    content of the existing ``paths`` (inputs; Hub ids are not paths and are pinned by the params), its code deps in
    dvc.yaml and the library versions. A code change restarts a run: a checkpoint of other code could not be continued
    to the same result."""
    import transformers

    wired = wiring(name)
    config = stage_values(params, [key for key in expand(wired.params) if key not in set(exclude)]) | (extra or {})
    config |= {"torch": torch.__version__, "transformers": transformers.__version__}
    text = json.dumps(config, sort_keys=True, default=str)
    inputs = sorted({Path(p) for p in paths if Path(p).exists()})
    code = hashlib.sha256()  # the code dvc.yaml reruns the stage for, as it runs (this project's)
    for dep in (ROOT / dep for dep in wired.deps if dep.startswith(CODE) or dep.endswith(".py")):
        for file in [dep] if dep.is_file() else sorted(dep.rglob("*.py")):
            code.update(file.relative_to(ROOT).as_posix().encode() + file.read_bytes())
    return hashlib.sha256(f"{text}\n{hash_paths(inputs)}\n{code.hexdigest()}".encode()).hexdigest()[:16]


# --- save, find, restore ---------------------------------------------------------------------------------------------


def weights_bytes(model: torch.nn.Module) -> int:
    """Size of the weights as saved (in their own dtype)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def trained_weights(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The weights a run trains, by name: those that require grad (GPT-2's LM head, tied to its embedding, once)."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def checkpoint_bytes(model: torch.nn.Module) -> int:
    """Size of one checkpoint: the trained weights plus their two AdamW moments (fp32)."""
    trained = trained_weights(model).values()
    return sum(p.numel() * (p.element_size() + ADAM_MOMENTS * 4) for p in trained)


def check_room_for_checkpoints(folder: Path, needed: int, key: str, fingerprint: str) -> None:
    """Stop before training when ``folder`` is not writable or its disk cannot hold the run's checkpoints: two of
    ``needed`` bytes (the new one is written before the old one is removed), less the checkpoints already there
    (this run's newest goes after the next save, other runs' go now). With one of this run's own there, the advice
    keeps the params as they are: changing them would restart the run at step 0."""
    check_writable(folder, folder)
    kept = checkpoints(folder)
    on_disk = sum(file.stat().st_size for path in kept for file in path.rglob("*") if file.is_file())
    own = [path for path in kept if read_state(path).get("fingerprint") == fingerprint]
    hint = (f" (free space to resume from {own[-1]}; a change to the params would restart at step 0)" if own
            else f" (free space, or set {key}: 0 to train without them)")
    require_free_space(folder, max(needed, 2 * needed - on_disk), key, "checkpoints need", hint)


def save(folder: Path, step: int, model: torch.nn.Module | None, optimizer_state: dict[str, Any] | None,
         state: dict[str, Any], files: dict[str, Path], sharded: Path | None = None) -> Path:
    """Write checkpoint ``step`` atomically (temp sibling, then rename), state.json last with the size and hash of
    every file written before it, then remove the older ones. ``sharded``: a DCP folder, the checkpoint's instead."""
    final = folder / f"{CHECKPOINT_PREFIX}{step:06d}"
    with atomic_path(final) as tmp:
        if sharded is not None:  # every process's shards of the weights and the optimizer's state
            os.replace(sharded, tmp)
        else:
            tmp.mkdir()
            save_file({name: p.detach().contiguous() for name, p in trained_weights(model).items()},
                      str(tmp / WEIGHTS_FILE))
            torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
        for name, source in files.items():
            if source.exists():
                shutil.copytree(source, tmp / FILES_DIR / name)
        manifest = {file.relative_to(tmp).as_posix(): {"size": file.stat().st_size, HASH: file_hash(file)}
                    for file in sorted(tmp.rglob("*")) if file.is_file()}
        (tmp / STATE_FILE).write_text(json.dumps({"step": step, **state, MANIFEST: manifest}), encoding="utf-8")
    for old in checkpoints(folder):
        if old != final:
            discard(old)
    return final


def read_state(path: Path) -> dict[str, Any]:
    """A checkpoint's state.json; {} (matches no run) when it is missing or unreadable, e.g. edited by hand."""
    try:
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def file_hash(path: Path) -> str:
    """The HASH of a file's bytes (read in blocks: a checkpoint's optimizer state can be gigabytes)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, xxhash.xxh3_128).hexdigest()


def damage(path: Path, state: dict[str, Any], required: Iterable[str], steps: int | None) -> str | None:
    """Why checkpoint ``path`` (its ``state``) cannot be resumed from, None when it can: state.json lacks a key the
    run reads (``required``), its step is past the run's ``steps``, a file is missing, not the size it was saved with
    or, the sizes all right, not the content (its hash): a kill, a full disk, a bad sector, a hand. The content is
    what a resume loads or publishes: the weights, the optimizer state, the copies of the rollout log and curves."""
    missing = [key for key in ("step", "fingerprint", MANIFEST, *required) if key not in state]
    if missing:
        return f"{STATE_FILE} lacks {', '.join(missing)}"
    if not isinstance(state["step"], int) or not 0 <= state["step"] < (steps if steps is not None else 2**62):
        return f"its step {state['step']!r} is not a step of this run"
    saved = state[MANIFEST]
    if not (isinstance(saved, dict) and all(isinstance(entry, dict) and entry.keys() == {"size", HASH}
                                            and ".." not in Path(name).parts and not Path(name).is_absolute()
                                            for name, entry in saved.items())):
        return f"{STATE_FILE}'s {MANIFEST} is not one this code writes"
    for name, entry in saved.items():  # the sizes first: a truncated file is found without reading gigabytes
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != entry["size"]:
            return f"{name} is {file.stat().st_size} bytes, {entry['size']} when saved"
    for name, entry in saved.items():
        if file_hash(path / name) != entry[HASH]:
            return f"{name} is not what was saved (same size, other content)"
    return None


def find(folder: Path, fingerprint: str, prune: bool = True, required: Iterable[str] = (),
         steps: int | None = None) -> Checkpoint | None:
    """The newest whole checkpoint of this run (``damage``: the keys its loader reads, ``required``, and the run's
    ``steps``), if any. With ``prune`` (the main process), other runs' checkpoints, damaged ones, older ones and
    what killed saves or removals left are removed, one log line each: the run resumes from the newest good one."""
    _dvc_process()  # now, before step 0: once its dvc has exited, a stage is re-parented and that dvc is not found
    found = None
    for path in reversed(checkpoints(folder)):
        state = read_state(path)
        if not path.is_dir():
            reason = "not a checkpoint folder"
        elif state.get("fingerprint") != fingerprint:
            reason = "another run's checkpoint: params, inputs or code changed since"
        elif found is not None:
            reason = "an older checkpoint of this run"
        elif (why := damage(path, state, required, steps)) is not None:
            reason = f"damaged: {why}"
        else:
            found = Checkpoint(path, state["step"], state)
            continue
        if prune:
            log.info("removing %s (%s)", path, reason)
            discard(path)
    if prune and folder.is_dir():  # what killed saves and removals left
        for leftover in [*folder.glob(f".{CHECKPOINT_PREFIX}*.tmp"), *folder.glob(f".*{REMOVED}")]:
            remove(leftover)
    return found


def load_weights(checkpoint: Checkpoint, model: torch.nn.Module) -> None:
    """The checkpoint's weights into ``model``'s trained weights (its frozen ones stay as they were loaded)."""
    state, trained = load_file(checkpoint.path / WEIGHTS_FILE), trained_weights(model)
    if state.keys() != trained.keys():
        raise PipelineError(f"{checkpoint.path}: holds other weights than this run trains; delete "
                            f"{checkpoint.path.parent} to start the run over")
    with torch.no_grad():
        for name, weight in trained.items():
            weight.copy_(state[name])


def load_optimizer_state(checkpoint: Checkpoint) -> dict[str, Any]:
    """weights_only: a file that would run code when unpickled is refused, not executed."""
    path = checkpoint.path / OPTIMIZER_FILE
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        raise PipelineError(f"{path}: refused: it pickles objects other than tensors, which could run code when "
                            f"loaded; delete {checkpoint.path.parent} to start the run over") from None


def restore_files(checkpoint: Checkpoint, files: dict[str, Path]) -> None:
    """Put the (staged) outputs saved with the checkpoint back where the resumed run writes them: the files its
    manifest lists, whose content ``find`` checked, and nothing else that may lie in its folder since."""
    for name, target in files.items():
        folder = Path(FILES_DIR, name)
        if target.exists():
            shutil.rmtree(target)
        if not (checkpoint.path / folder).is_dir():
            continue
        target.mkdir(parents=True)
        for saved in map(Path, checkpoint.state[MANIFEST]):
            if saved.is_relative_to(folder):
                copy = target / saved.relative_to(folder)
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(checkpoint.path / saved, copy)


def discard(path: Path) -> None:
    """Delete ``path`` so that it is gone at once, whatever stops the deletion: renamed to a hidden ``.<name>.removed``
    sibling first, then deleted (what a kill leaves there, the next ``find`` removes)."""
    if os.path.lexists(path):
        aside = path.parent / f".{path.name}{REMOVED}"
        remove(aside)
        os.replace(path, aside)
        remove(aside)


# --- stopping at a checkpoint ----------------------------------------------------------------------------------------
# ``kill <pid of dvc>`` stops DVC alone: the stage would run on as an orphan whose result DVC never records, and the
# next ``dvc repro`` would start it over. So a stage that DVC started stops right after its next checkpoint once DVC
# has exited, and the rerun resumes from it. A stage run by hand is never stopped this way (``nohup`` on purpose).
# The same stop comes when params.yaml changed under the stage.


def _is_dvc(cmdline: list[str]) -> bool:
    """``dvc ...``, ``/path/to/dvc ...``, ``python /path/to/dvc ...`` or ``python -m dvc ...``."""
    return (any(Path(arg).name == "dvc" for arg in cmdline[:2])
            or any(a == "-m" and b == "dvc" for a, b in zip(cmdline, cmdline[1:], strict=False)))


@functools.cache
def _dvc_process() -> psutil.Process | None:
    """The dvc that started this stage (DVC sets DVC_STAGE, and runs the command through a shell that may or may not
    exec it): the nearest ancestor running dvc."""
    if "DVC_STAGE" not in os.environ:
        return None
    for process in psutil.Process().parents():
        with contextlib.suppress(psutil.Error):
            if _is_dvc(process.cmdline()):
                return process
    return None


def dvc_gone() -> int | None:
    """The pid of the dvc that started this stage once it has exited (a zombie has), else None. ``is_running`` tells a
    reused pid by its start since boot: the wall-clock start moves at clock updates (a false exit in long runs)."""
    if (process := _dvc_process()) is None:
        return None
    try:
        alive = process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        alive = False
    return None if alive else process.pid


def stop_reason(stage: str, step: int) -> str | None:
    """Why ``stage`` stops right after its checkpoint of ``step``, as its one line, or None: the dvc that started it
    has exited (``dvc_gone``), or params.yaml changed among the keys it read (``params.changed_since_read``: the end
    would refuse outputs made with other values than DVC records beside them, so the run stops here rather than train
    on). Either way the checkpoint is kept and the rerun resumes from it."""
    if (pid := dvc_gone()) is not None:
        why = (f"stopped after step {step}: the dvc process that ran {stage} (pid {pid}) has exited, so it would "
               "never record this run")
        advice = "rerun (dvc repro) to resume"
    elif (change := changed_since_read(stage)) is not None:
        why = (f"params.yaml changed while {stage} ran ({change}): stopped after step {step}, as its outputs would "
               "be recorded with the new values")
        advice = ("restore the params and rerun to resume (run experiments one at a time, or queue them: dvc exp "
                  "run --queue)")
    else:
        return None
    kept = checkpoints(checkpoint_dir(stage))
    return f"{why}; checkpoint {kept[-1] if kept else 'none'} kept: {advice}"
