"""Where a stage runs (``pick_device``): CUDA or the CPU, with glibc keeping freed memory there, and one GPU per stage
process: where several GPUs are visible, each stage that uses one takes one no other stage holds, so experiments run
side by side (``dvc queue start -j N``, ``python -m tools.frontier --jobs N``) spread over them.

A GPU is held by an exclusive ``flock`` on a file named after its UUID in a per-user folder of the system's temporary
directory (``lock_folder``): every process of the user on the machine sees the same files, whichever workspace a
queued experiment runs in (DVC runs each in a temporary copy), and CUDA_VISIBLE_DEVICES may number the same GPU
differently in two processes, never its UUID. The lock lasts as long as the process: the OS releases it when the
process ends, however it ends (a SIGKILL too), so a crashed stage never leaves a GPU taken. torch is imported only
where a device is picked: the lock alone needs none.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import logging
import os
import re
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0  # how often a stage that found every GPU held looks again
# glibc's environment variables -> its mallopt parameter (malloc.h: M_TRIM_THRESHOLD -1, M_MMAP_THRESHOLD -3), 1 GiB
MALLOC_KEEP = {"MALLOC_TRIM_THRESHOLD_": (-1, 1 << 30), "MALLOC_MMAP_THRESHOLD_": (-3, 1 << 30)}


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


def pick_device() -> torch.device:
    """CUDA when present, else CPU (with glibc keeping freed memory: ``keep_freed_memory``). On CUDA a stage process
    holds one of the visible GPUs (CUDA_VISIBLE_DEVICES chooses which are visible), one no other stage holds where
    there are several (``claim``), and makes it torch's current device; a stage launched as several
    processes (accelerate launch, torchrun: LOCAL_RANK set) is its launcher's to place."""
    import torch

    if not torch.cuda.is_available():
        keep_freed_memory()
        return torch.device("cpu")
    if "LOCAL_RANK" in os.environ or (index := claimed_gpu()) is None:
        return torch.device("cuda")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


@functools.cache  # once per process
def keep_freed_memory() -> bool:
    """Have glibc serve blocks up to 1 GiB from its heap and keep freed memory for reuse, as docs/gpu.md's
    environment line does: otherwise it hands a CPU training step's large tensors back to the OS, and the next step
    faults them in afresh, page by page. Not where the environment sets either variable (it decides) or the C library
    has no ``mallopt``; False then."""
    if any(name in os.environ for name in MALLOC_KEEP):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own C library
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return all([mallopt(param, value) for param, value in MALLOC_KEEP.values()])


@functools.cache  # once per process: the lock, once taken, is this process's until it exits
def claimed_gpu() -> int | None:
    """The index (as this process numbers its visible GPUs) of the GPU this stage holds. With several visible: a free
    one, waiting for one when all are held. With one (a single-GPU machine, or CUDA_VISIBLE_DEVICES naming one): it
    is taken when free, so that other stages choose around it, and shared when not (None): there is no other."""
    import torch

    identities = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    index = claim(identities, lock_folder(), wait=len(identities) > 1)
    if len(identities) > 1:
        log.info("GPU %d of the %d visible (%s) is this stage's", index, len(identities), identities[index])
    return index
