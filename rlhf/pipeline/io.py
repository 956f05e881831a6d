"""Writing outputs so that a stage either completes and replaces all of them, or fails and leaves every previous one
as it was: ``StagedOutputs`` (a stage's outputs, as dvc.yaml lists them, staged and replaced together under the
stage's lock) and ``atomic_path`` (one file or folder written beside its place and renamed into it)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf.pipeline.errors import PipelineError, is_disk_full
from rlhf.pipeline.params import changed_since_read
from rlhf.pipeline.paths import CHECKPOINTS_DIR, checkpoint_dir, output_path, staging_path
from rlhf.pipeline.wiring import wiring

log = logging.getLogger(__name__)

UMASK = os.umask(0o022)
os.umask(UMASK)
REMOVED = ".removed"  # suffix of a folder being deleted (discard)
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
            for item in [target, *target.rglob("*")] if target.is_dir() else [target]:
                os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~UMASK)
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


def discard(path: Path) -> None:
    """Delete ``path`` so that it is gone at once, whatever stops the deletion: renamed to a hidden ``.<name>.removed``
    sibling first, then deleted (what a kill leaves there, the next run removes)."""
    if os.path.lexists(path):
        aside = path.parent / f".{path.name}{REMOVED}"
        remove(aside)
        os.replace(path, aside)
        remove(aside)


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


def replaced_path(output: Path) -> Path:
    """Where a previous output waits while the new ones move in."""
    return output.parent / f".{output.name}.replaced"


class StagedOutputs:
    """A stage's outputs, written under ``paths.staging_path`` siblings and moved into place together on success.

    Entering checks that every output's folder is writable, takes ``stage``'s lock (one run per workspace), finishes
    what a killed run left half done (``recover``) and checks that every previous output can be moved aside.
    ``outputs[path]`` is where to write ``path`` (an output or a file inside one). Leaving the block normally replaces
    every output by its staged version, then deletes the stage's checkpoints (``commit``); leaving it by an exception
    (Ctrl-C included) deletes the staging only. Whatever is killed when, the journal (data/checkpoints/.<stage>.commit)
    exists from the moment every new output is staged until the previous ones are gone: a run that finds it moves the
    new set in, one that does not puts every previous output back; never a mix of two runs' outputs.
    """

    def __init__(self, outputs: Iterable[Path], stage: str | None = None) -> None:
        self.outputs, self.stage, self.lock = [Path(p) for p in outputs], stage, None
        self.journal = CHECKPOINTS_DIR / f".{stage}.commit" if stage is not None else None

    @classmethod
    def of(cls, stage: str) -> StagedOutputs:
        """The outputs dvc.yaml lists for ``stage``, under its lock."""
        return cls(wiring(stage).outputs, stage)

    def __getitem__(self, path: Path) -> Path:
        for output in self.outputs:
            if path == output or output in path.parents:
                return staging_path(output) / path.relative_to(output)
        raise KeyError(f"{path} is not one of this stage's outputs")

    def __enter__(self) -> StagedOutputs:
        for output in self.outputs:
            check_writable(output.parent, output)
        if self.stage is not None:  # before the leftovers of a killed run are cleared: they may be a running one's
            self.lock = lock_stage(self.stage)
        try:
            self.recover()
            for output in self.outputs:
                remove(staging_path(output))
                if os.path.lexists(output):  # an immutable output, a read-only mount: fail now, not after the run
                    try:
                        os.replace(output, replaced_path(output))
                    except OSError as e:
                        raise PipelineError(f"{output}: cannot be replaced ({e.strerror}); nothing was run") from None
                    os.replace(replaced_path(output), output)
        except BaseException:
            self.unlock()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        try:
            if exc_type is None:
                try:
                    self.commit()
                except BaseException:
                    self.discard()
                    raise
            else:
                self.discard()
        finally:
            self.unlock()

    def recover(self) -> None:
        """Finish what a killed run left: with its journal, move the rest of its outputs in; without, put back every
        previous output set aside (a failed replacement was putting them back)."""
        if self.journal is not None and self.journal.exists():
            log.info("%s: finishing the replacement of its outputs that a stopped run began", self.stage)
            self.move_in()
            self.finish(checkpoints=False)  # under DVC, which recorded nothing, a rerun of that run resumes from them
        self.put_back()
        if self.stage is not None:  # this stage's only: another stage may be deleting its own right now
            remove(checkpoint_dir(self.stage).parent / f".{self.stage}{REMOVED}")

    def unlock(self) -> None:
        if self.lock is not None:
            os.close(self.lock)
            self.lock = None

    def discard(self) -> None:
        for output in self.outputs:
            remove(staging_path(output))

    def check_free_space(self, output: Path, needed: int) -> None:
        """Stop when ``output``'s disk cannot hold ``needed`` more bytes (the previous output stays until the end)."""
        require_free_space(output.parent, needed, str(output), "the new output needs",
                           " (the previous one is replaced only when the stage completes)")

    def commit(self) -> None:
        """Unless params.yaml changed under the stage (``params.changed_since_read``), replace the previous outputs by
        the staged ones, each of which must have been written, then ``finish``; on a failure before the end, put
        every previous output back."""
        if self.stage is not None and (change := changed_since_read(self.stage)):
            raise PipelineError(f"params.yaml changed while {self.stage} ran ({change}): its outputs were not "
                                "replaced, as DVC would record them with the new values (another dvc exp run in "
                                "this workspace? run one at a time, or queue them: dvc exp run --queue); its "
                                "checkpoint is kept: restore the params and rerun to resume")
        unwritten = [output for output in self.outputs if not os.path.lexists(staging_path(output))]
        if unwritten:  # a stage's bug: replacing a previous output by nothing would pass for a result
            raise RuntimeError(f"{self.stage}: finished without writing {unwritten[0]}; the previous outputs are kept")
        if self.journal is not None:
            write_text(f"{os.getpid()}\n", self.journal)
        try:
            self.move_in()
        except BaseException:
            if self.journal is not None:
                remove(self.journal)
            self.put_back()
            raise
        self.finish()

    def move_in(self) -> None:
        """Every previous output aside, then every staged one in; a repeat after a kill does what is left."""
        for output in self.outputs:
            with naming_disk_full(output):
                if (os.path.lexists(staging_path(output)) and os.path.lexists(output)
                        and not os.path.lexists(replaced_path(output))):
                    os.replace(output, replaced_path(output))
        for output in self.outputs:
            with naming_disk_full(output):
                if os.path.lexists(staging_path(output)):
                    remove(output)
                    os.replace(staging_path(output), output)

    def put_back(self) -> None:
        """Every previous output set aside returns to its place (over a new one moved in)."""
        for output in self.outputs:
            if os.path.lexists(backup := replaced_path(output)):
                remove(output)
                os.replace(backup, output)

    def finish(self, checkpoints: bool = True) -> None:
        """The new outputs are in place: delete the previous ones and (``checkpoints``) the stage's checkpoints, then
        the journal. Only the standard library runs here, and nothing may fail the stage."""
        for output in self.outputs:
            with contextlib.suppress(OSError):
                remove(replaced_path(output))
        with contextlib.suppress(OSError):
            if self.stage is not None and checkpoints:
                discard(checkpoint_dir(self.stage))
            if self.journal is not None:
                self.journal.unlink(missing_ok=True)


def lock_stage(stage: str) -> int:
    """Hold ``data/checkpoints/.<stage>.lock`` until the process ends (the OS releases it, even after a kill -9), or
    refuse in one line while another process of this workspace holds it. Returns the lock's descriptor."""
    path = CHECKPOINTS_DIR / f".{stage}.lock"
    check_writable(path.parent, path.parent)  # a file there, or an immutable folder: one line, not a traceback
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666 & ~UMASK)
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
