"""In what precision training runs: bf16 autocast, the LM head's TF32 on CUDA, and the head's matmuls on a
vocabulary padded for the GPU's aligned kernels. Where it runs: rlhf/models/devices.py."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

CPU_BF16_PROBES = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")  # private torch.cpu functions


def cpu_has_bf16() -> bool:
    """AMX or AVX-512 BF16: bf16 matmuls run several times faster than fp32 (elsewhere they are emulated, slower).

    The probes are private to torch; a torch without them is taken for a CPU without native bf16 (fp32 is correct
    everywhere, only slower).
    """
    probes = (getattr(torch.cpu, name, None) for name in CPU_BF16_PROBES)
    return any(probe() for probe in probes if probe is not None)


def mixed_precision(device: torch.device, precision: str) -> torch.dtype | None:
    """The autocast dtype for ``model.precision``: bf16, or None for plain fp32.

    ``auto`` is bf16 on CUDA and on CPUs with native bf16 matmuls, fp32 elsewhere.
    """
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_bf16() else None
    return torch.bfloat16 if precision == "bf16" else None


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast where ``mixed_precision`` says so, else a no-op (fp32)."""
    dtype = mixed_precision(device, precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def full_precision(device: torch.device) -> contextlib.AbstractContextManager:
    """Leave autocast inside a mixed-precision block, for the numerically sensitive tail of a model."""
    return torch.autocast(device.type, enabled=False)


def head_precision(device: torch.device) -> str:
    """How the LM head's fp32 matmul runs at this point: 'tf32' on CUDA inside bf16 autocast (a run that chose mixed
    precision), 'ieee' (full fp32) elsewhere; CPUs have no TF32, so the CPU path never changes."""
    return "tf32" if device.type == "cuda" and torch.is_autocast_enabled(device.type) else "ieee"


def head_grad_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype of the LM head's backward matmuls at this point: on a CPU inside bf16 autocast (a run that chose
    mixed precision), bf16, as every other layer's backward is there; None (the forward's fp32) elsewhere. The
    logits, and so every log-prob and ratio, stay fp32; on CUDA the backward keeps TF32 (``_PaddedHead``)."""
    if device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return None


@contextlib.contextmanager
def cuda_matmul_precision(precision: str | None) -> Iterator[None]:
    """fp32 CUDA matmuls in ``precision`` ('tf32': inputs rounded to 11 significant bits, fp32 accumulation and output,
    8x the fp32 rate of an H100; 'ieee': fp32) for the block, torch's own setting restored after. A no-op for other
    devices' matmuls, and for ``precision`` None (torch's own setting)."""
    if precision is None:
        yield
        return
    matmul = torch.backends.cuda.matmul
    new_api = hasattr(matmul, "fp32_precision")  # torch >= 2.9; mixing it with allow_tf32 is an error there
    before = matmul.fp32_precision if new_api else matmul.allow_tf32
    if new_api:
        matmul.fp32_precision = precision
    else:
        matmul.allow_tf32 = precision == "tf32"
    try:
        yield
    finally:
        if new_api:
            matmul.fp32_precision = before
        else:
            matmul.allow_tf32 = before


def cpu_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` of 2-D CPU tensors, fp32 ones through oneDNN's kernel (torch's private op of inductor's CPU
    path): full fp32 as MKL's sgemm, which torch calls otherwise, and faster than it at the LM head's shapes on AMD
    EPYC (BENCHMARKS.md). The plain matmul where torch lacks the op, for other dtypes, and inside torch.compile
    (inductor picks its own kernel)."""
    linear = None
    if x.dtype == weight.dtype == torch.float32 and torch.backends.mkldnn.is_available():
        linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if linear is None or torch.compiler.is_compiling():
        return x @ weight.T
    return linear(x, weight, None, "none", [], "")


VOCAB_ALIGN = 64  # CUDA: the head's vocabulary padded to a multiple of this (nanoGPT pads GPT-2's to 50,304 too)


class _PaddedHead(torch.autograd.Function):
    """``hidden @ weight.T`` with the weight's rows (the vocabulary) zero-padded to a multiple of ``align``, every
    matmul of forward and backward in the fp32 ``precision`` (None: torch's own setting), the backward's in
    ``grad_dtype`` where given (None: the forward's dtype).

    cuBLAS takes its fast kernels only for 16-byte-aligned rows, which GPT-2's 50,257 logits are not (the profile of
    an H200 showed the head on older, slower kernels); and autograd runs the backward after the forward's
    ``cuda_matmul_precision`` block has ended, so without this the fp32 backward ran in full fp32, off the tensor
    cores. The padded columns are cut from the logits, and their gradient from the weight's.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, precision: str | None, align: int,
                grad_dtype: torch.dtype | None) -> torch.Tensor:
        vocab = weight.shape[0]
        padded = F.pad(weight, (0, 0, 0, -vocab % align)) if vocab % align else weight
        # 2-D: a (B, R, H) slice of the body's output would otherwise go to a batched matmul, R rows at a time
        flat = hidden.reshape(-1, hidden.shape[-1])
        ctx.save_for_backward(flat, padded)
        ctx.precision, ctx.vocab, ctx.shape, ctx.grad_dtype = precision, vocab, hidden.shape, grad_dtype
        with cuda_matmul_precision(precision):
            logits = cpu_linear(flat, padded) if flat.device.type == "cpu" else flat @ padded.T
        return logits.view(*hidden.shape[:-1], -1)[..., :vocab]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        flat, padded = ctx.saved_tensors
        dtype = ctx.grad_dtype or flat.dtype
        grad = F.pad(grad, (0, padded.shape[0] - ctx.vocab)).reshape(-1, padded.shape[0]).to(dtype)
        grad_hidden = grad_weight = None
        with cuda_matmul_precision(ctx.precision):
            if ctx.needs_input_grad[0]:
                grad_hidden = (grad @ padded.to(dtype)).view(ctx.shape).to(flat.dtype)
            if ctx.needs_input_grad[1]:
                grad_weight = (grad.T @ flat.to(dtype))[: ctx.vocab].to(padded.dtype)
        return grad_hidden, grad_weight, None, None, None


def head_logits(head: nn.Module, hidden: torch.Tensor, precision: str | None = None, align: int | None = None,
                grad_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``head(hidden)``: the logits of an LM's output layer, in autocast's dtype where autocast is on, its fp32 CUDA
    matmuls in ``precision`` (None: torch's own setting), its backward's matmuls in ``grad_dtype`` (None: the
    logits' dtype).

    On CUDA (or where ``align`` or ``grad_dtype`` is given) a plain bias-free linear head runs through
    ``_PaddedHead``: its vocabulary padded to ``align`` (default VOCAB_ALIGN on CUDA, else none), ``precision`` held
    in its backward too. Elsewhere it is the module's own call.
    """
    device = hidden.device
    align = align or (VOCAB_ALIGN if device.type == "cuda" else 1)
    if (align == 1 and grad_dtype is None) or type(head) is not nn.Linear or head.bias is not None:
        with cuda_matmul_precision(precision):
            return head(hidden)
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else hidden.dtype
    return _PaddedHead.apply(hidden.to(dtype), head.weight.to(dtype), precision, align, grad_dtype)


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on ``device``. To CUDA through pinned memory, without waiting: a copy from pageable memory waits
    for the GPU to finish everything queued before it, a host sync every step that would leave the GPU idle while the
    host queues the next step."""
    if device.type != "cuda":
        return batch.to(device)
    return batch.pin_memory().to(device, non_blocking=True)
