"""A training stage's use of the machine (rlhf/train/system_use.py): samples of its CPU and memory land in
system.csv (the GPU's columns empty on CPU), and the summary for its metrics measures the CPU time it spent."""

from __future__ import annotations

import csv
import threading
import time
from pathlib import Path

from rlhf.train.system_use import COLUMNS, HEADER, SystemUse


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_cpu_and_memory_samples_land_in_the_csv_and_the_summary(tmp_path: Path) -> None:
    system = SystemUse("cpu", interval=0.05)  # outside the clocks: the first one imports torch
    wall, cpu = time.perf_counter(), time.process_time()
    with system:
        spin(0.4)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    system.write(tmp_path / "system.csv")
    rows = list(csv.DictReader((tmp_path / "system.csv").open()))
    assert len(rows) >= 3 and list(rows[0]) == list(COLUMNS)
    assert [float(row["seconds"]) for row in rows] == sorted(float(row["seconds"]) for row in rows)
    # cores, not a percentage: one thread spinning keeps at most one busy, whatever the machine
    assert all(float(row["ram_gb"]) > 0 and 0 <= float(row["cpu"]) <= 1.5 for row in rows)
    assert sum(float(row["cpu"]) for row in rows) > 0  # the spinning shows
    assert all(row["gpu_busy"] == "" and row["gpu_memory_gb"] == "" for row in rows)
    summary = system.summary()
    assert set(summary) == {"cpu_cores", "ram_gb"}  # no GPU: no gpu_busy, no gpu_memory_gb
    # the cores it kept busy, near its CPU time over the wall time (a busy machine gives the spinning less of a core):
    # cores, not a percentage nor the machine's count
    assert cpu / wall - 0.1 <= summary["cpu_cores"] <= 1.1
    assert (tmp_path / "system.csv").read_text().startswith(HEADER)


def test_a_short_run_has_a_row_and_the_thread_ends_with_the_block() -> None:
    with SystemUse("cpu", interval=60) as system:
        pass
    assert len(system.rows) == 1
    assert not system.thread.is_alive() and "system-use" not in [t.name for t in threading.enumerate()]
