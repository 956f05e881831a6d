"""Randomness: seeding every generator at a stage's start, and capturing / restoring their states in a checkpoint
(so that a resumed run draws what the uninterrupted one would have)."""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python, NumPy and torch (all devices); return a CPU generator for the stage's own draws."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # NumPy's seeds are 32-bit; a stage's seed + its process rank may pass 2**32 - 1
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def _encode(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode()


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_states(generators: dict[str, torch.Generator]) -> dict[str, Any]:
    """Python, NumPy, torch (CPU and every CUDA device) and the named generators' states, JSON-ready."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(mt), gauss],
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
        "torch": _encode(torch.get_rng_state()),
        "cuda": [_encode(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
        "generators": {name: _encode(g.get_state()) for name, g in generators.items()},
    }


def set_rng_states(states: dict[str, Any], generators: dict[str, torch.Generator]) -> None:
    version, mt, gauss = states["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_decode(states["torch"]))
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_decode(s) for s in states["cuda"]])
    for name, generator in generators.items():
        generator.set_state(_decode(states["generators"][name]))
