"""Writing outputs so that a stage either completes and replaces all of them, or fails and leaves every previous one
as it was.

- ``StagedOutputs``: a stage's outputs (dvc.yaml's outs, metrics and plots of the stage); it holds the stage's lock
  (one run of a stage per workspace), and checks that their folders are writable and every previous output can be
  moved aside, before anything loads; everything is written under staging siblings and moved into place together when
  the stage's block completes, and only then are the stage's checkpoints deleted. A failure (an error, Ctrl-C, a full
  disk) deletes the staging and touches no output.
- ``atomic_path``: one file or folder written to a temporary sibling and renamed into place, with the user's umask,
  a full disk reported as ``disk full writing <output>``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlhf.pipeline.errors import DiskFull, PipelineError, is_disk_full
from rlhf.pipeline.paths import CHECKPOINTS_DIR, checkpoint_dir, output_path, staging_path
from rlhf.pipeline.wiring import wiring

UMASK = os.umask(0o022)
os.umask(UMASK)
REPLACED = ".replaced"  # suffix of a previous output moved aside while the new ones move in
DISABLED_MARKER = "DISABLED"  # the one file of a switched-off stage's model folder


@contextlib.contextmanager
def naming_disk_full(path: Path | str) -> Iterator[None]:
    """A full disk inside the block becomes ``DiskFull("disk full writing <path>")`` (the output's own name, not its
    staging one); other errors pass unchanged."""
    try:
        yield
    except Exception as e:
        if is_disk_full(e) and not isinstance(e, PipelineError):
            raise DiskFull(f"disk full writing {output_path(Path(path))}") from None
        raise


def apply_umask(path: Path) -> None:
    """Give ``path`` (and everything below) the modes the user's umask gives a new file or folder: some writers
    create files 0600 (transformers writes model.safetensors through a private temporary file)."""
    for item in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~UMASK)


@contextlib.contextmanager
def atomic_path(path: Path | str) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` (file or folder) and move it into place only if the block succeeds.

    An existing ``path`` is replaced in one rename for files; for folders the old one is removed just before the move.
    On error the temporary is deleted and ``path`` keeps its previous content.
    """
    path = Path(path)
    with naming_disk_full(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        target = tmp / path.name
        try:
            yield target
            apply_umask(target)
            if target.is_dir() and path.exists():
                remove(path)
            os.replace(target, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def write_parquet(table: pa.Table, path: Path | str) -> None:
    """Write a Parquet file atomically."""
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


def write_json(obj: Any, path: Path | str) -> None:
    """Write pretty JSON atomically (DVC metrics files are read by people too)."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_text(text: str, path: Path | str) -> None:
    """Write a text file atomically."""
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
    """Create and delete a file in ``folder`` (what os.access cannot tell for root, a read-only mount or an
    immutable folder)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PipelineError(f"{output}: cannot write in {folder}/ ({e.strerror}); nothing was run") from None


def check_movable(output: Path) -> None:
    """Move an existing ``output`` aside and back, as the final replacement will (an immutable output or one on a
    read-only mount fails here, before the run, not after it)."""
    if not os.path.lexists(output):
        return
    aside = replaced_path(output)
    try:
        os.replace(output, aside)
    except OSError as e:
        raise PipelineError(f"{output}: cannot be replaced ({e.strerror}); nothing was run") from None
    os.replace(aside, output)


def lock_stage(stage: str) -> int:
    """Hold ``data/checkpoints/.<stage>.lock`` until the process ends (the OS releases it, even after a kill -9), or
    refuse in one line while another process of this workspace holds it. Returns the lock's descriptor."""
    path = CHECKPOINTS_DIR / f".{stage}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
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


def replaced_path(output: Path) -> Path:
    """Where a previous output waits while the new ones move in."""
    return output.parent / f".{output.name}{REPLACED}"


class StagedOutputs:
    """A stage's outputs, written under ``paths.staging_path`` siblings and moved into place together on success.

    Entering checks that every output's folder is writable, takes ``stage``'s lock (when given), clears what a killed
    run left behind and checks that every previous output can be moved aside. ``outputs[path]`` is where to write
    ``path`` (an output or a file inside one). Leaving the block normally replaces every output by its staged version
    (an output not written is removed), then deletes ``stage``'s checkpoints (data/checkpoints/<stage>): a run is
    finished only once its outputs are in place. Leaving it by an exception (Ctrl-C included) deletes the staging and
    touches nothing.
    """

    def __init__(self, outputs: Iterable[Path], stage: str | None = None) -> None:
        self.outputs = [Path(p) for p in outputs]
        self.stage = stage
        self.lock: int | None = None

    @classmethod
    def of(cls, stage: str) -> StagedOutputs:
        """The outputs dvc.yaml lists for ``stage``, under its lock."""
        return cls(wiring(stage).outputs, stage)

    def __getitem__(self, path: Path) -> Path:
        """Where to write ``path``: one of the outputs, or a file inside an output folder."""
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
            for output in self.outputs:
                backup = replaced_path(output)
                if os.path.lexists(backup) and not os.path.lexists(output):
                    os.replace(backup, output)  # a kill in the middle of the final moves: the previous output returns
                remove(backup)
                remove(staging_path(output))
            for output in self.outputs:
                check_movable(output)
        except BaseException:
            self.unlock()
            raise
        return self

    def unlock(self) -> None:
        if self.lock is not None:
            os.close(self.lock)
            self.lock = None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        try:
            if exc_type is None:
                try:
                    self.commit()
                except BaseException:
                    self.discard()
                    raise
                if self.stage is not None:
                    shutil.rmtree(checkpoint_dir(self.stage), ignore_errors=True)  # the run is complete
            else:
                self.discard()
        finally:
            self.unlock()

    def discard(self) -> None:
        """Delete the staging: the previous outputs stay as they were."""
        for output in self.outputs:
            remove(staging_path(output))

    def check_free_space(self, output: Path, needed: int) -> None:
        """Stop when ``output``'s disk cannot hold ``needed`` more bytes (the previous output stays until the end)."""
        require_free_space(output.parent, needed, str(output), "the new output needs",
                         " (the previous one is replaced only when the stage completes)")

    def commit(self) -> None:
        """Move every previous output aside, every staged one in, then delete the previous ones; on any failure
        before the end, put everything back as it was."""
        moved: list[tuple[Path, Path]] = []
        try:
            for output in self.outputs:
                backup = replaced_path(output)
                if os.path.lexists(output):
                    os.replace(output, backup)
                moved.append((output, backup))
            for output in self.outputs:
                if os.path.lexists(staging_path(output)):
                    os.replace(staging_path(output), output)
        except BaseException:
            for output, backup in reversed(moved):
                remove(output)
                if os.path.lexists(backup):
                    os.replace(backup, output)
            raise
        # the stage is complete: from here on only the standard library runs, and nothing may fail it
        for _, backup in moved:
            if backup.is_dir() and not backup.is_symlink():
                shutil.rmtree(backup, ignore_errors=True)
            elif os.path.lexists(backup):
                with contextlib.suppress(OSError):
                    backup.unlink()


def run_switchable(stage: str, enabled: bool, train: Callable[[StagedOutputs], None], folder: Path,
                   reason: str, files: dict[Path, str]) -> None:
    """Run a stage that params can switch off, all its outputs replaced together (``StagedOutputs``): ``train`` when
    enabled; else ``folder`` holding one fixed line, so its hash (and everything downstream) stays put, plus ``files``
    (output -> fixed text: the stage's metrics and empty plot files)."""
    with StagedOutputs.of(stage) as outputs:
        if enabled:
            train(outputs)
        else:
            write_disabled(outputs, folder, reason, files)


def write_disabled(outputs: StagedOutputs, folder: Path, reason: str, files: dict[Path, str]) -> None:
    """A switched-off stage's outputs: ``folder`` holding one fixed line, and ``files`` (output -> fixed text)."""
    with atomic_path(outputs[folder]) as tmp:
        tmp.mkdir()
        (tmp / DISABLED_MARKER).write_text(reason + "\n", encoding="utf-8")
    for path, text in files.items():
        write_text(text, outputs[path])
