"""Shared training pieces: the CPU bf16 probe's fallback, the precision rule and the LR schedule."""

from __future__ import annotations

import pytest
import torch

from stages.core import training


@pytest.mark.parametrize("present", [(), ("_is_amx_tile_supported",), ("_is_avx512_bf16_supported",)])
def test_cpu_has_bf16_reads_the_probes_torch_has(monkeypatch: pytest.MonkeyPatch, present: tuple[str, ...]) -> None:
    for name in training.CPU_BF16_PROBES:
        if name in present:
            monkeypatch.setattr(torch.cpu, name, lambda: True, raising=False)
        else:
            monkeypatch.delattr(torch.cpu, name, raising=False)
    assert training.cpu_has_bf16() is bool(present)


def test_without_the_probes_auto_precision_on_cpu_is_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in training.CPU_BF16_PROBES:
        monkeypatch.delattr(torch.cpu, name, raising=False)
    assert training.mixed_precision(torch.device("cpu"), "auto") is None
    assert training.mixed_precision(torch.device("cpu"), "bf16") is torch.bfloat16


def test_warmup_then_cosine_to_the_floor() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = training.warmup_cosine(optimizer, warmup_steps=4, total_steps=14, floor=0.1)
    lrs = []
    for _ in range(16):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4] == pytest.approx(1.0) and lrs[9] == pytest.approx(0.55)  # half way down the cosine
    assert lrs[14:] == pytest.approx([0.1, 0.1])
