"""One GPU per stage process (rlhf/models/devices.py), on CPU with N devices named in a lock folder of the test's:
N processes that claim at once hold N different devices, one more waits, and a holder killed by SIGKILL frees its
device for it. The locks are the real ones (flock), in separate processes as queued experiments are."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT

from rlhf.models.devices import claim, lock_file

DEVICES = ["GPU-0a1b", "GPU-2c3d", "MIG-GPU-4e5f/1/0"]
# a stage as far as its GPU goes: claim one, say which, hold it until killed
HOLDER = ("import sys, time; from pathlib import Path; from rlhf.models.devices import claim; "
          "print(claim(sys.argv[2:], Path(sys.argv[1])), flush=True); time.sleep(120)")


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen]]:
    started: list[subprocess.Popen] = []
    yield started
    for process in started:
        process.kill()
        process.wait()


def start(folder: Path, started: list[subprocess.Popen]) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(folder), *DEVICES], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    started.append(process)
    return process


def line(stream, timeout: float) -> str | None:
    """The next line of ``stream``, or None if none comes within ``timeout`` seconds."""
    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline() if ready else None


def test_concurrent_stages_hold_different_devices_and_a_killed_one_frees_its_own(
        tmp_path: Path, processes: list[subprocess.Popen]) -> None:
    holders = [start(tmp_path, processes) for _ in DEVICES]
    held = [int(line(process.stdout, timeout=120)) for process in holders]
    assert sorted(held) == list(range(len(DEVICES))), held
    waiting = start(tmp_path, processes)
    # every device is held: it says so once, naming the holders, and waits
    said = line(waiting.stderr, timeout=120)
    assert said and "all 3 visible GPUs are held by other stages (pids " in said, said
    assert all(str(process.pid) in said for process in holders), said
    assert line(waiting.stdout, timeout=1.5) is None
    victim = holders[held.index(1)]
    victim.send_signal(signal.SIGKILL)  # no Python code runs: the OS alone releases the lock
    victim.wait()
    assert line(waiting.stdout, timeout=30) == "1\n"


def test_a_device_held_here_is_not_claimed_again_and_without_waiting_none_is_given(tmp_path: Path,
                                                                                  processes: list) -> None:
    """In one process a second claim is another open file description, which flock refuses too: pick_device claims
    once per process (``claimed_gpu`` is cached). Without waiting, every device held gives None (a single visible
    GPU held by another stage is shared, not waited for)."""
    assert claim(DEVICES[:1], tmp_path, wait=False) == 0
    assert claim(DEVICES[:1], tmp_path, wait=False) is None
    assert claim(DEVICES, tmp_path, wait=False) == 1
    assert lock_file(tmp_path, DEVICES[2]).name == "MIG-GPU-4e5f_1_0.lock"
    assert lock_file(tmp_path, DEVICES[0]).read_text() == f"{os.getpid()}\n"
