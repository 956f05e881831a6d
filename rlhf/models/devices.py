"""One GPU per stage process: where several GPUs are visible, each stage that uses one takes one no other stage holds,
so experiments run side by side (``dvc queue start -j N``, ``python -m tools.frontier --jobs N``) spread over them.

A GPU is held by an exclusive ``flock`` on a file named after its UUID in a per-user folder of the system's temporary
directory (``lock_folder``): every process of the user on the machine sees the same files, whichever workspace a
queued experiment runs in (DVC runs each in a temporary copy), and CUDA_VISIBLE_DEVICES may number the same GPU
differently in two processes, never its UUID. The lock lasts as long as the process: the OS releases it when the
process ends, however it ends (a SIGKILL too), so a crashed stage never leaves a GPU taken. Which GPUs a stage sees
and takes: ``precision.pick_device``.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0  # how often a stage that found every GPU held looks again


def lock_folder() -> Path:
    """Where the GPUs' lock files live: one folder per user in the system's temporary directory."""
    return Path(tempfile.gettempdir()) / f"imdb-rlhf-gpus-{os.getuid()}"


def lock_file(folder: Path, identity: str) -> Path:
    return folder / (re.sub(r"[^\w.-]", "_", identity) + ".lock")  # a MIG instance's UUID holds slashes


def try_lock(path: Path) -> bool:
    """Take ``path``'s exclusive lock for the rest of this process's life (its descriptor is left open on purpose:
    closing it would release the lock), writing our pid in it for a waiting stage to name; False if another process
    holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)  # not inherited by child processes (PEP 446)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return True


def holders(folder: Path, identities: Sequence[str]) -> list[str]:
    """The pids written in the lock files (their holders, unless a holder has just gone)."""
    pids = []
    for identity in identities:
        with contextlib.suppress(OSError):
            pids.append(lock_file(folder, identity).read_text().strip() or "?")
    return pids


def claim(identities: Sequence[str], folder: Path, wait: bool = True) -> int | None:
    """The index of the first device of ``identities`` (stable names: the GPUs' UUIDs) no other process holds, held
    by this process from now until it exits. When every one is held: with ``wait``, wait until one frees (saying
    once who holds them); without, None."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    said = False
    while True:
        for index, identity in enumerate(identities):
            if try_lock(lock_file(folder, identity)):
                return index
        if not wait:
            return None
        if not said:
            log.warning("all %d visible GPUs are held by other stages (pids %s): waiting for one to free "
                        "(docs/gpu.md#one-gpu-per-experiment)", len(identities),
                        ", ".join(holders(folder, identities)))
            said = True
        time.sleep(POLL_SECONDS)
