"""Writing outputs: a stage's outputs (dvc.yaml's) staged and moved into place when it completes (``StagedOutputs``),
one file or folder written beside its place and renamed into it (``atomic_path``), and the checks that a stage can
write before it starts."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf.pipeline.cli import STARTED
from rlhf.pipeline.errors import PipelineError, is_disk_full
from rlhf.pipeline.params import changed_since_read
from rlhf.pipeline.paths import CHECKPOINTS_DIR, checkpoint_dir, checkpoints, output_path, staging_path
from rlhf.pipeline.wiring import wiring

DISABLED_MARKER = "DISABLED"  # the one file of a switched-off stage's model folder


@contextlib.contextmanager
def naming_disk_full(path: Path | str) -> Iterator[None]:
    """A full disk inside the block is ``disk full writing <path>`` (the output's own name, not its staging one)."""
    try:
        yield
    except Exception as e:
        if is_disk_full(e) and not isinstance(e, PipelineError):
            raise PipelineError(f"disk full writing {output_path(Path(path))}") from None
        raise


def umask() -> int:
    """The process's umask now: read from /proc where Linux shows it, else set and put back (the standard library's
    only way), never at import, where it would change it for the importer."""
    with contextlib.suppress(OSError, StopIteration, ValueError):
        status = Path("/proc/self/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` (to write a file or a folder) and rename it into place, with the modes
    the user's umask gives (some writers create files 0600), only if the block succeeds; else ``path`` is untouched."""
    path = Path(path)
    with naming_disk_full(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        target = tmp / path.name
        try:
            yield target
            mask = umask()
            for item in [target, *target.rglob("*")] if target.is_dir() else [target]:
                os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~mask)
            if target.is_dir() and path.exists():
                remove(path)
            os.replace(target, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def write_parquet(table: pa.Table, path: Path | str) -> None:
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def write_json(obj: Any, path: Path | str) -> None:
    """Pretty JSON (DVC metrics files are read by people too)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_text(text: str, path: Path | str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def remove(path: Path) -> None:
    """Delete a file, a link or a folder, if there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def require_free_space(folder: Path, needed: int, culprit: str, what: str, hint: str = "") -> None:
    """Stop naming ``culprit`` when ``folder``'s disk has less than ``needed`` bytes free for ``what``."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise PipelineError(f"{culprit}: {folder} has {free / 2**20:.0f} MiB free, {what} about "
                            f"{needed / 2**20:.0f} MiB{hint}")


def check_writable(folder: Path, output: Path) -> None:
    """Create and delete a file in ``folder`` (what os.access cannot tell for root, a read-only mount or an immutable
    folder)."""
    if os.path.lexists(folder) and not folder.is_dir():
        raise PipelineError(f"{output}: {folder} is a file, not a folder: move it away; nothing was run")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PipelineError(f"{output}: cannot write in {folder}/ ({e.strerror}); nothing was run") from None


def aside(output: Path) -> Path:
    """Where a previous output waits while the new ones move in."""
    return output.parent / f".{output.name}.replaced"


class StagedOutputs:
    """A stage's outputs, written under ``paths.staging_path`` siblings and moved into place together when the stage
    completes, so that a stage run by hand that fails or is stopped leaves its previous outputs as they were (under
    DVC, which removes a stage's outputs before running it and records them only when it completes, there are none).

    Entering checks that every output's folder is writable and every previous output can be moved, and takes
    ``stage``'s lock (one run of it at a time in a workspace). ``outputs[path]`` is where to write ``path`` (an
    output or a file inside one). ``with outputs.steps():`` marks the stage's steps (its training loop, or the work
    its outputs are made of), which ``commit`` times. Leaving the block normally moves the staged outputs in
    (``commit``); leaving it by an exception (Ctrl-C included) deletes them. A kill while they move in (milliseconds)
    leaves some outputs missing, never two runs' outputs side by side; a training stage's rerun then finishes at once
    from the checkpoint it kept.
    """

    def __init__(self, outputs: Iterable[Path], stage: str | None = None, metrics: Iterable[Path] = ()) -> None:
        self.outputs, self.stage, self.lock = [Path(p) for p in outputs], stage, None
        self.metrics = [Path(p) for p in metrics]
        self.steps_began: float | None = None  # perf_counter() when the first steps() began and the last ended
        self.steps_ended: float | None = None

    @classmethod
    def of(cls, stage: str) -> StagedOutputs:
        """The outputs dvc.yaml lists for ``stage``, under its lock."""
        stage_wiring = wiring(stage)
        return cls(stage_wiring.outputs, stage, stage_wiring.metrics)

    @contextlib.contextmanager
    def steps(self) -> Iterator[None]:
        """Mark the stage's steps: what runs before the first is its setup, what runs after the last its teardown."""
        self.steps_began = self.steps_began or time.perf_counter()
        yield
        self.steps_ended = time.perf_counter()

    def seconds(self) -> dict[str, float]:
        """``time/setup`` (from the process's start to the first step: imports, loading, reading), ``time/steps``
        and ``time/teardown`` (from the last step to now: held-out evaluation, saving); empty if no steps ran."""
        if self.steps_began is None or self.steps_ended is None:
            return {}
        now = time.perf_counter()
        return {"time/setup": round(self.steps_began - STARTED, 2),
                "time/steps": round(self.steps_ended - self.steps_began, 2),
                "time/teardown": round(now - self.steps_ended, 2)}

    def write_seconds(self) -> None:
        """Add ``seconds()`` under ``<stage>`` to each of the stage's staged JSON metrics files and log them: the
        same keys in every stage's metrics, written in one place."""
        seconds = self.seconds()
        if not seconds or self.stage is None:
            return
        for path in self.metrics:
            staged = staging_path(path)
            if path.suffix == ".json" and staged.is_file():
                metrics = json.loads(staged.read_text(encoding="utf-8"))
                metrics.setdefault(self.stage, {}).update(seconds)
                write_json(metrics, staged)
        logging.getLogger(self.stage).info("%s: setup %.1f s, steps %.1f s, teardown %.1f s", self.stage,
                                           *seconds.values())

    def __getitem__(self, path: Path) -> Path:
        for output in self.outputs:
            if path == output or output in path.parents:
                return staging_path(output) / path.relative_to(output)
        raise KeyError(f"{path} is not one of this stage's outputs")

    def __enter__(self) -> StagedOutputs:
        for output in self.outputs:
            check_writable(output.parent, output)
        if self.stage is not None:  # before a killed run's leftovers are cleared: they may be a running one's
            self.lock = lock_stage(self.stage)
        try:
            for output in self.outputs:
                remove(staging_path(output))
                remove(aside(output))
                if os.path.lexists(output):  # an immutable output, a read-only mount: fail now, not after the run
                    try:
                        os.replace(output, aside(output))
                    except OSError as e:
                        raise PipelineError(f"{output}: cannot be replaced ({e.strerror}); nothing was run") from None
                    os.replace(aside(output), output)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        try:
            if exc_type is not None:
                self.discard()
            else:
                try:
                    self.commit()
                except BaseException:
                    self.discard()
                    raise
        finally:
            if self.lock is not None:  # the standard library only, as after the outputs went in
                os.close(self.lock)

    def discard(self) -> None:
        for output in self.outputs:
            remove(staging_path(output))

    def check_free_space(self, output: Path, needed: int) -> None:
        """Stop when ``output``'s disk cannot hold ``needed`` more bytes (the previous output stays until the end)."""
        require_free_space(output.parent, needed, str(output), "the new output needs",
                           " (the previous one is replaced only when the stage completes)")

    def commit(self) -> None:
        """Unless params.yaml changed under the stage (``params.changed_since_read``), replace the outputs by the
        staged ones, each of which must have been written: every previous one set aside first, then every staged one
        moved in; a failure or a stop on the way puts the previous ones back and takes out the new ones that had none
        (outputs of two runs are never left side by side). Once they are in, only the standard
        library runs: nothing may fail a finished stage."""
        if self.stage is not None and (change := changed_since_read(self.stage)):
            raise PipelineError(f"params.yaml changed while {self.stage} ran ({change}): its outputs were not "
                                "replaced, as DVC would record them with the new values (another dvc exp run in "
                                "this workspace? run one at a time, or queue them: dvc exp run --queue)"
                                + ("; its checkpoint is kept: restore the params and rerun to resume"
                                   if checkpoints(checkpoint_dir(self.stage)) else ""))
        unwritten = [output for output in self.outputs if not os.path.lexists(staging_path(output))]
        if unwritten:  # a stage's bug: replacing a previous output by nothing would pass for a result
            raise RuntimeError(f"{self.stage}: finished without writing {unwritten[0]}; no output was replaced")
        self.write_seconds()
        moves = [(output, staging_path(output), aside(output)) for output in self.outputs]
        try:
            for output, _, previous in moves:
                if os.path.lexists(output):
                    os.replace(output, previous)
            for output, staged, _ in moves:
                os.replace(staged, output)
        except BaseException:
            for output, staged, previous in moves:
                if os.path.lexists(previous):
                    remove(output)
                    os.replace(previous, output)
                elif not os.path.lexists(staged):  # moved in with no previous version: not beside the previous run's
                    remove(output)
            raise
        for _, _, previous in moves:
            with contextlib.suppress(OSError):
                if os.path.isdir(previous) and not os.path.islink(previous):
                    shutil.rmtree(previous)
                elif os.path.lexists(previous):
                    os.unlink(previous)


def lock_stage(stage: str) -> int:
    """Hold ``data/checkpoints/.<stage>.lock`` until its descriptor, returned, is closed (``StagedOutputs`` closes it
    on leaving its block; the OS releases it when the process ends, even after a kill -9), or refuse in one line
    while another process of this workspace holds it."""
    path = CHECKPOINTS_DIR / f".{stage}.lock"
    check_writable(path.parent, path.parent)  # a file there, or an immutable folder: one line, not a traceback
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # open applies the umask itself
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise PipelineError(f"{stage}: another run of this stage is under way in this workspace (pid {holder} "
                            f"holds {path}); wait for it or stop it") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def run_switchable(stage: str, enabled: bool, train: Callable[[StagedOutputs], None], folder: Path,
                   reason: str, files: dict[Path, str]) -> None:
    """Run a stage that params can switch off (``StagedOutputs.of(stage)``): ``train`` when enabled, else
    ``write_disabled``."""
    with StagedOutputs.of(stage) as outputs:
        if enabled:
            train(outputs)
        else:
            write_disabled(outputs, folder, reason, files)


def write_disabled(outputs: StagedOutputs, folder: Path, reason: str, files: dict[Path, str]) -> None:
    """A switched-off stage's outputs: ``folder`` holding one fixed line (so its hash, and everything downstream,
    stays put) and ``files`` (output -> fixed text: its metrics and empty plot files)."""
    with atomic_path(outputs[folder]) as tmp:
        tmp.mkdir()
        (tmp / DISABLED_MARKER).write_text(reason + "\n", encoding="utf-8")
    for path, text in files.items():
        write_text(text, outputs[path])
