"""What a training loop asks of the machine, beside its curves: the CPU, memory and GPU use of the stage's process,
sampled by a background thread while it trains, written as ``metrics/<stage>/system.csv`` (drawn by ``dvc plots
show`` beside the loss and the reward: dvc.yaml's top-level plots) and summed up in the stage's metrics (``gpu_busy``:
the share of the training time the GPU was running a kernel), which ``python -m tools.compare`` shows.

DVCLive's ``Live(monitor_system=True)`` records CPU and RAM the same way, but its ``system/gpu/usage (%)`` (3.49) is
NVML's memory-controller utilisation divided by the GPU's, not the time the GPU was busy, and it reads every GPU of
the machine where a stage holds one (docs/gpu.md); sft and reward write no DVCLive curves. The GPU's utilisation
comes from NVML (``torch.cuda.utilization``, through nvidia-ml-py, which DVCLive installs); without it the column
stays empty and the summary has no ``gpu_busy``.
"""

from __future__ import annotations

import contextlib
import csv
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import psutil

from rlhf.pipeline.io import write_text

if TYPE_CHECKING:
    import torch

INTERVAL = 2.0  # seconds between samples: NVML's own utilisation window is 1/6 to 1 second
COLUMNS = ("seconds", "cpu", "ram_gb", "gpu_busy", "gpu_memory_gb")
"""seconds since training began; cpu: the process's CPU use in cores since the previous sample; ram_gb: its resident
memory; gpu_busy: the % of NVML's last sample period that its GPU ran a kernel; gpu_memory_gb: what its CUDA
allocator holds. The GPU columns are empty on CPU."""
HEADER = ",".join(COLUMNS) + "\n"  # a switched-off stage's system.csv
GIB = 2**30


class SystemUse:
    """``with SystemUse(device) as system: <train>``, then ``system.summary()`` and ``system.write(path)``. The
    sampling thread is a daemon, reads only counters, and samples once more at the end, so a run shorter than one
    ``interval`` has a row too."""

    def __init__(self, device: torch.device | str, interval: float = INTERVAL) -> None:
        import torch  # here, not above: a switched-off stage writes HEADER without loading torch

        self.device, self.interval = torch.device(device), interval
        self.cuda = self.device.type == "cuda"
        self.rows: list[dict[str, float | None]] = []
        self.process = psutil.Process()
        self.nvml = self.cuda  # until NVML fails once: then quietly without the GPU's utilisation
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.loop, name="system-use", daemon=True)

    def __enter__(self) -> SystemUse:
        self.start = self.last = time.perf_counter()
        self.start_cpu = self.last_cpu = self.cpu_seconds()
        self.thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop.set()
        self.thread.join()
        self.sample()
        self.seconds = self.last - self.start

    def loop(self) -> None:
        while not self.stop.wait(self.interval):
            self.sample()

    @staticmethod
    def cpu_seconds() -> float:
        # the kernel's own clock for all the process's threads: /proc's tick-based times (psutil's cpu_times) move in
        # steps of 10 ms, so a sample a few ticks long could read twice the cores the process used
        return time.process_time()

    def sample(self) -> None:
        now, cpu = time.perf_counter(), self.cpu_seconds()
        row: dict[str, float | None] = {
            "seconds": round(now - self.start, 2), "cpu": round((cpu - self.last_cpu) / max(now - self.last, 1e-9), 3),
            "ram_gb": round(self.process.memory_info().rss / GIB, 3), "gpu_busy": None, "gpu_memory_gb": None}
        self.last, self.last_cpu = now, cpu
        if self.cuda:
            import torch

            row["gpu_memory_gb"] = round(torch.cuda.memory_reserved(self.device) / GIB, 3)
        if self.nvml:
            import torch

            try:
                row["gpu_busy"] = float(torch.cuda.utilization(self.device))
            except Exception:  # no nvidia-ml-py, no NVML (another vendor's GPU, a container without it)
                self.nvml = False
        self.rows.append(row)

    def summary(self) -> dict[str, float]:
        """gpu_busy (with NVML): the share of the samples' time the GPU ran a kernel, in [0, 1]; gpu_memory_gb (on
        CUDA): the most the allocator held; cpu_cores: the mean CPU use in cores; ram_gb: the most resident memory."""
        out = {"cpu_cores": round((self.last_cpu - self.start_cpu) / max(self.seconds, 1e-9), 2),
               "ram_gb": max(row["ram_gb"] for row in self.rows)}
        busy = [row["gpu_busy"] for row in self.rows if row["gpu_busy"] is not None]
        if busy:
            out["gpu_busy"] = round(sum(busy) / len(busy) / 100, 3)
        if self.cuda:
            import torch

            out["gpu_memory_gb"] = round(torch.cuda.max_memory_reserved(self.device) / GIB, 3)
        return out

    def write(self, path: Path | str) -> None:
        """The samples as CSV (COLUMNS; an empty cell where a value is not measured)."""
        text = io.StringIO()
        writer = csv.DictWriter(text, COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in self.rows)
        write_text(text.getvalue(), path)


class Clock:
    """Wall times of named phases (``with clock("generate"): ...``, then ``clock.timings``); on CUDA each phase waits
    for its queued kernels, so it gets its own time."""

    def __init__(self, device: torch.device) -> None:
        import torch  # the module reads the machine without it; a device means torch is loaded

        self.sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
        self.timings: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.sync()
        start = time.perf_counter()
        yield
        self.sync()
        self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - start
