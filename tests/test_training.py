"""Shared training pieces: the CPU bf16 probe's fallback, the precision rule, the LM head's matmul precision and the LR
schedule."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from rlhf.models import precision
from rlhf.models.policy import lm_head
from rlhf.train import fit


@pytest.mark.parametrize("present", [(), ("_is_amx_tile_supported",), ("_is_avx512_bf16_supported",)])
def test_cpu_has_bf16_reads_the_probes_torch_has(monkeypatch: pytest.MonkeyPatch, present: tuple[str, ...]) -> None:
    for name in precision.CPU_BF16_PROBES:
        if name in present:
            monkeypatch.setattr(torch.cpu, name, lambda: True, raising=False)
        else:
            monkeypatch.delattr(torch.cpu, name, raising=False)
    assert precision.cpu_has_bf16() is bool(present)


def test_without_the_probes_auto_precision_on_cpu_is_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in precision.CPU_BF16_PROBES:
        monkeypatch.delattr(torch.cpu, name, raising=False)
    assert precision.mixed_precision(torch.device("cpu"), "auto") is None
    assert precision.mixed_precision(torch.device("cpu"), "bf16") is torch.bfloat16


def cuda_matmul_setting() -> object:
    matmul = torch.backends.cuda.matmul
    return matmul.fp32_precision if hasattr(matmul, "fp32_precision") else matmul.allow_tf32


def test_cuda_matmul_precision_holds_for_the_block_and_restores_torch_s_setting() -> None:
    before = cuda_matmul_setting()
    with pytest.raises(KeyError), precision.cuda_matmul_precision("tf32"):
        assert cuda_matmul_setting() in ("tf32", True)
        raise KeyError  # an error inside the block restores the setting too
    assert cuda_matmul_setting() == before


def tiny_lm(n_embd: int = 64) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=16, n_embd=n_embd, n_layer=1, n_head=2))


def test_on_cpu_the_lm_head_is_full_fp32_even_under_bf16_autocast() -> None:
    lm, hidden = tiny_lm(), torch.randn(2, 3, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert precision.head_precision(hidden.device) == "ieee"  # CPUs have no TF32
        mixed = lm_head(lm, hidden.bfloat16())
    assert mixed.dtype == torch.float32  # as fp32's (another kernel: its rounding, not bf16's)
    torch.testing.assert_close(mixed, lm_head(lm, hidden.bfloat16().float()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 64, 257])
def test_cpu_linear_is_an_fp32_matmul(rows: int) -> None:
    """oneDNN's fp32 kernel (where torch has it) as accurate as MKL's sgemm against float64, strided input too."""
    g = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 2 * 384, generator=g)[:, ::2], torch.randn(1000, 384, generator=g) * 0.05
    exact = x.double() @ weight.double().T
    ours, sgemm = precision.cpu_linear(x, weight), x @ weight.T
    assert ours.dtype == torch.float32 and ours.shape == (rows, 1000)
    assert (ours.double() - exact).abs().max() <= 4 * (sgemm.double() - exact).abs().max() + 1e-6
    assert torch.equal(precision.cpu_linear(x.bfloat16(), weight.bfloat16()), x.bfloat16() @ weight.bfloat16().T)


def test_on_cpu_under_bf16_autocast_the_lm_head_backward_runs_in_bf16() -> None:
    """The logits stay fp32 (above); the backward's two matmuls, the head's largest cost in a CPU update, run in bf16
    as every other layer's backward does under autocast: the gradients of a bf16 matmul of the same operands. In
    fp32 (no autocast) they are the module's own."""
    lm, hidden = tiny_lm(), torch.randn(2, 3, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert precision.head_grad_dtype(hidden.device) == torch.bfloat16
        logits, grad_hidden, grad_weight = head_grads(lm.lm_head, hidden, lambda h, x: lm_head(lm, x))
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, lm.lm_head(hidden), rtol=1e-5, atol=1e-6)
    coef = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1)).bfloat16().reshape(-1, 300)
    flat, weight = hidden.reshape(-1, 64).bfloat16(), lm.lm_head.weight.detach().bfloat16()
    assert torch.equal(grad_hidden, (coef @ weight).float().view(2, 3, 64))
    assert torch.equal(grad_weight, (coef.T @ flat).float())
    assert precision.head_grad_dtype(hidden.device) is None
    full = head_grads(lm.lm_head, hidden, lambda h, x: lm_head(lm, x))
    plain = head_grads(lm.lm_head, hidden, lambda h, x: h(x))
    for ours, theirs in zip(full, plain, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TF32 needs a CUDA GPU; on CPU the head is fp32 (above)")
def test_on_cuda_under_bf16_autocast_the_lm_head_runs_in_tf32() -> None:
    lm, hidden = tiny_lm(768).cuda(), torch.randn(4, 16, 768, device="cuda")
    before = cuda_matmul_setting()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert precision.head_precision(hidden.device) == "tf32"
        mixed = lm_head(lm, hidden)
    assert cuda_matmul_setting() == before
    with precision.cuda_matmul_precision("ieee"):
        full = lm_head(lm, hidden)
    assert mixed.dtype == torch.float32
    assert not torch.equal(mixed, full)  # TF32 rounded the inputs
    torch.testing.assert_close(mixed, full, rtol=0, atol=2e-3 * full.abs().max().item())


def head_grads(head: torch.nn.Linear, hidden: torch.Tensor, logits_of) -> tuple[torch.Tensor, ...]:
    """The logits of ``logits_of(head, hidden)`` and the gradients of a fixed linear function of them: a gradient the
    logits' values do not change, so what differs is the backward's own arithmetic."""
    head.zero_grad()
    hidden = hidden.detach().requires_grad_()
    logits = logits_of(head, hidden)
    coef = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1)).to(logits.device)
    (logits.float() * coef).sum().backward()
    return logits, hidden.grad, head.weight.grad


def test_the_padded_head_equals_the_module_in_values_and_gradients() -> None:
    """The GPU path's logic, run on CPU: a 300-word vocabulary padded to 320 changes neither the logits nor the
    gradients of hidden and weight (the padded rows' are cut), in fp32 and under bf16 autocast."""
    torch.manual_seed(0)
    head, hidden = torch.nn.Linear(64, 300, bias=False), torch.randn(2, 7, 64)[:, 1:6]  # a slice, as the callers'
    padded = head_grads(head, hidden, lambda h, x: precision.head_logits(h, x, align=64))
    plain = head_grads(head, hidden, lambda h, x: h(x))
    assert padded[0].shape == (2, 5, 300) and padded[2].shape == (300, 64)
    for ours, theirs in zip(padded, plain, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        padded = head_grads(head, hidden, lambda h, x: precision.head_logits(h, x, align=64))
        plain = head_grads(head, hidden, lambda h, x: h(x))
    assert padded[0].dtype == torch.bfloat16 and padded[2].dtype == torch.float32
    for ours, theirs in zip(padded, plain, strict=True):
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TF32 needs a CUDA GPU")
def test_on_cuda_the_lm_head_s_backward_runs_in_tf32_too() -> None:
    """The backward runs after lm_head's TF32 block has closed: the padded head carries the setting into it."""
    lm, hidden = tiny_lm(768).cuda(), torch.randn(4, 16, 768, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        tf32 = head_grads(lm.lm_head, hidden, lambda h, x: lm_head(lm, x))
    full = head_grads(lm.lm_head, hidden, lambda h, x: h(x.float()))  # ieee in both directions
    for ours, theirs in zip(tf32[1:], full[1:], strict=True):
        assert not torch.equal(ours, theirs)  # TF32 rounded the backward's inputs too
        torch.testing.assert_close(ours, theirs, rtol=0, atol=5e-3 * theirs.abs().max().item())


def test_warmup_then_cosine_to_the_floor() -> None:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = fit.warmup_cosine(optimizer, warmup_steps=4, total_steps=14, floor=0.1)
    lrs = []
    for _ in range(16):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4] == pytest.approx(1.0) and lrs[9] == pytest.approx(0.55)  # half way down the cosine
    assert lrs[14:] == pytest.approx([0.1, 0.1])
