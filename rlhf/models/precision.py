"""Where and in what precision training runs: device choice, bf16 autocast, the LM head's TF32 on CUDA."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


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


@contextlib.contextmanager
def cuda_matmul_precision(precision: str) -> Iterator[None]:
    """fp32 CUDA matmuls in ``precision`` ('tf32': inputs rounded to 11 significant bits, fp32 accumulation and output,
    8x the fp32 rate of an H100; 'ieee': fp32) for the block, torch's own setting restored after. A no-op for other
    devices' matmuls."""
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
