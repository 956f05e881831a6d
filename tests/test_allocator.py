"""The CPU allocator setting (glibc's environment variables of docs/gpu.md, or what a stage sets itself on CPU): freed
tensor memory is kept for reuse instead of being faulted in afresh at every training step."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT

FAULTS = """
import resource, sys, torch
if sys.argv[1:] == ["stage"]:  # what a stage does on CPU
    from rlhf.models.devices import pick_device
    assert pick_device().type == "cpu"
n = 12 << 20  # floats: 48 MiB and 24 MiB tensors, made and freed as in a training step
for i in range(10):
    if i == 5:  # the heap has grown to what a step needs
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step = [torch.empty(n).fill_(1.0), torch.empty(n // 2).fill_(1.0)]
    del step
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 5)
"""


def documented() -> dict[str, str]:
    """The variables of docs/gpu.md's ``export MALLOC_...`` line."""
    line = next(line for line in (ROOT / "docs/gpu.md").read_text().splitlines() if line.startswith("export MALLOC_"))
    return dict(re.findall(r"(\w+)=(\S+)", line))


def page_faults(env: dict[str, str], *args: str) -> int:
    """Minor page faults a step in a fresh interpreter."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    return int(subprocess.run([sys.executable, "-c", FAULTS, *args], cwd=ROOT, check=True, capture_output=True,
                              text=True, env=clean | env | {"CUDA_VISIBLE_DEVICES": ""}).stdout)


def test_the_documented_setting_reuses_freed_memory_without_page_faults() -> None:
    if "CS_GNU_LIBC_VERSION" not in getattr(os, "confstr_names", {}):
        pytest.skip("not glibc")
    default = page_faults({})
    if default < 1000:  # 72 MiB a step in 4 KiB pages is ~18,000: the kernel backs this memory with huge pages
        pytest.skip(f"{default} page faults a step without the setting: nothing to save here")
    assert page_faults(documented()) * 4 < default
    assert page_faults({}, "stage") * 4 < default  # a stage on CPU sets it itself
    assert page_faults({"MALLOC_TRIM_THRESHOLD_": str(128 << 10)}, "stage") * 4 > default  # unless told otherwise
