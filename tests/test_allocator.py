"""The CPU allocator setting every stage and tool starts with (rlhf.pipeline.cli.keep_freed_memory): freed tensor
memory is kept for reuse instead of being faulted in afresh at every training step."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAULTS = """
import resource, sys, torch
from rlhf.pipeline.cli import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
n = 12 << 20  # floats: 48 MiB and 24 MiB tensors, made and freed as in a training step
for i in range(10):
    if i == 5:  # the heap has grown to what a step needs
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step = [torch.empty(n).fill_(1.0), torch.empty(n // 2).fill_(1.0)]
    del step
print(kept, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 5)
"""


def page_faults(mode: str, env: dict[str, str] | None = None) -> tuple[str, int]:
    """(what keep_freed_memory returned, minor page faults a step) in a fresh interpreter."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], cwd=ROOT, env=clean | (env or {}), check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0], int(out[1])


def test_kept_memory_is_reused_without_page_faults() -> None:
    kept, faults = page_faults("keep")
    if kept != "True":
        pytest.skip("the C library has no glibc mallopt")
    _, default = page_faults("default")
    if default < 1000:  # 72 MiB a step in 4 KiB pages is ~18,000: the kernel backs this memory with huge pages
        pytest.skip(f"{default} page faults a step without the setting: nothing to save here")
    assert faults * 4 < default, (faults, default)


def test_a_users_own_malloc_setting_wins() -> None:
    kept, _ = page_faults("keep", {"MALLOC_TRIM_THRESHOLD_": "131072"})
    assert kept == "False"
