"""Compiled training steps (ppo.compile, sft.compile): whether a step compiles, and its first use checked against the
eager step, with the eager step for the rest of the run where the compiled one fails or differs.

The check (``CompiledStep.first_use``) runs the compiled step, puts back the state it changed (weights, gradients,
optimizer, RNGs), runs the eager step on the same inputs and keeps the eager step's result: whatever the verdict, the
run's first step is the eager run's. A compile, lowering or capture exception, or a distance between the two steps'
numbers above what the run's precision allows, is one warning under ``auto`` (the step runs eagerly from then on) and
one error line under ``true``.

Also the one place of the private torch APIs the compiled steps lean on (tests/test_compiled.py tells when a torch
release moves one).
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from rlhf.pipeline.errors import ParamsError
from rlhf.train import rng

log = logging.getLogger(__name__)

R = TypeVar("R")


def compiles(setting: bool | str, device: torch.device, key: str, processes: bool = False) -> bool:
    """Whether a step compiles under ``key``'s ``setting`` (true, false or auto) on ``device``. auto: on CUDA only. On
    a CPU the compiled step is faster only in bf16, and compiling it takes minutes there, which only a long run
    repays (docs/gpu.md). ``processes``: the step runs data-parallel over several processes, which it does eagerly.
    True where torch.compile cannot run is an error naming ``key``."""
    if not setting:
        return False
    problem = "several processes (accelerate) run the step eagerly" if processes else compile_problem(device)
    if setting == "auto":
        if device.type == "cuda" and problem is not None:
            log.warning("%s: auto, but torch.compile cannot run here (%s): the step runs eagerly", key, problem)
        return device.type == "cuda" and problem is None
    if problem is not None:
        raise ParamsError(f"{key}: true, but torch.compile cannot run here ({problem}); set it to auto or false", key)
    return bool(setting)


def compile_problem(device: torch.device) -> str | None:
    """Why torch.compile cannot run on ``device`` in this process (None: it can)."""
    if not dynamo_supported():
        return "this Python is not supported by torch.compile"
    if device.type == "cuda" and not triton_available():
        return "Triton, its GPU code generator, is not installed"
    return None


def tolerance(precision: str) -> float:
    """The largest distance (``distance``) allowed between a compiled step's numbers and the eager step's under
    ``precision`` ('bf16' or 'fp32', model.precision resolved): the square root of its machine epsilon, agreement to
    half its digits. Both steps round the same sums in other orders, so they part by a few epsilons of each
    operation, compounded over a step's layers and optimizer steps; a wrong step (a term lost, a sign, stale inputs)
    parts by the size of the number itself. The TF32 head (11 significant bits) runs only under bf16 (8 bits), whose
    epsilon is the coarser."""
    return torch.finfo(torch.bfloat16 if precision == "bf16" else torch.float32).eps ** 0.5


def distance(got: dict[str, float], expected: dict[str, float]) -> float:
    """The largest difference between two steps' numbers, relative to the expected one where it exceeds 1 in size
    (a loss near 0 would otherwise magnify rounding); inf where a number is missing, NaN where one is NaN."""
    if got.keys() != expected.keys():
        return math.inf
    return max((abs(got[k] - v) / max(abs(v), 1.0) for k, v in expected.items()), default=0.0)


def first_line(error: BaseException) -> str:
    """``error``'s type and the first line of its message, with the next line where the first only leads to it
    (Dynamo's "backend='inductor' raised:")."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else "".join(lines[:1])
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


@dataclass
class CompiledStep:
    """The state of a compiled step in a run: unchecked (``compiled`` None), checked and in use (True), or given up
    for the eager step (False), with the ``distance`` its check found (None: none was measured)."""

    key: str  # the setting's params key: ppo.compile, sft.compile
    setting: bool | str  # its value, true or auto (a false one compiles nothing)
    precision: str  # 'bf16' or 'fp32': the precision the step runs in, which bounds the distance (``tolerance``)
    compiled: bool | None = None
    distance: float | None = None

    def run(self, step: Callable[[bool], R], numbers: Callable[[R], dict[str, float]],
            save: Callable[[], Callable[[], None]]) -> R:
        """``step(compiled)``: compiled once checked (``first_use``, of ``step(True)`` against ``step(False)``), eager
        where the check gave it up."""
        if self.compiled is None:
            return self.first_use(lambda: step(True), lambda: step(False), numbers, save)
        return step(self.compiled)

    def first_use(self, compiled_run: Callable[[], R], eager_run: Callable[[], R],
                  numbers: Callable[[R], dict[str, float]], save: Callable[[], Callable[[], None]]) -> R:
        """Check the compiled step: ``compiled_run()``, the state put back (``save()`` returns the function that puts
        it back), then ``eager_run()`` on the same inputs and state; their ``numbers`` compared. Returns the eager
        run's result. Where the compiled step raised or differs: a warning under auto (``compiled`` False from then
        on), a ParamsError naming the key under true."""
        restore = save()
        try:
            got = numbers(compiled_run())
        except Exception as e:  # Dynamo, Inductor, CUDA graph capture: any of them, on any input
            problem = f"failed ({first_line(e)})"
        else:
            problem = None
        restore()
        result = eager_run()
        if problem is None:
            self.distance, bound = distance(got, numbers(result)), tolerance(self.precision)
            if not self.distance <= bound:  # NaN too
                problem = f"differs from the eager step by {self.distance:.3g} (bound {bound:.3g}, {self.precision})"
        self.compiled = problem is None
        if problem is None:
            log.info("%s: the compiled step matches the eager step (distance %.2g)", self.key, self.distance)
        elif self.setting == "auto":
            log.warning("%s: auto, but the compiled step %s: the step runs eagerly for the rest of the run",
                        self.key, problem)
        else:
            raise ParamsError(f"{self.key}: true, but the compiled step {problem}; set it to auto or false", self.key)
        return result


def step_metrics(step: CompiledStep | None) -> dict[str, Any]:
    """For a stage's metrics: whether its step ran compiled (``step`` None: it never compiled), and the distance its
    first use found from the eager step (None where none was measured)."""
    found = None if step is None else step.distance
    return {"compiled": bool(step is not None and step.compiled),
            "distance": None if found is None or not math.isfinite(found) else float(f"{found:.3g}")}


def saved_state(trained: list[torch.Tensor], optimizer: torch.optim.Optimizer | None = None) -> Callable[[], None]:
    """Copy what a training step changes: the gradients of ``trained`` and the RNGs, and with an ``optimizer`` its
    state and the weights it moves; returns the function that puts them back, into the same tensors (a CUDA graph
    holds their addresses)."""
    weights = [p.detach().clone() for p in trained] if optimizer is not None else None
    grads = [None if p.grad is None else p.grad.detach().clone() for p in trained]
    state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
    rngs = rng.rng_states({})

    @torch.no_grad()
    def restore() -> None:
        for i, (p, grad) in enumerate(zip(trained, grads, strict=True)):
            if weights is not None:
                p.copy_(weights[i])
            if grad is None or p.grad is None:
                p.grad = grad
            else:
                p.grad.copy_(grad)
        if optimizer is not None:
            optimizer.load_state_dict(state)
        rng.set_rng_states(rngs, {})

    return restore


# --- the private torch APIs, one function each ----------------------------------------------------------------------

def dynamo_supported() -> bool:
    """Whether torch.compile's Dynamo supports this Python (torch._dynamo.is_dynamo_supported)."""
    from torch._dynamo import is_dynamo_supported

    return is_dynamo_supported()


def triton_available() -> bool:
    """Whether Triton, Inductor's GPU code generator, is installed and usable (torch.utils._triton.has_triton)."""
    from torch.utils._triton import has_triton

    return has_triton()


def mark_static_address(tensor: torch.Tensor) -> None:
    """Tell Dynamo that ``tensor`` keeps its address across calls, so a CUDA graph holds it instead of copying it in
    at each replay (torch._dynamo.mark_static_address)."""
    torch._dynamo.mark_static_address(tensor)


def skip_step_if(optimizer: torch.optim.Optimizer, flag: torch.Tensor) -> None:
    """Make the next ``optimizer.step()`` of a fused Adam/AdamW leave weights and state as they are where ``flag``
    (a 0-dim float tensor on the device) is nonzero, decided on the device: the ``found_inf`` attribute GradScaler
    sets for the fused kernels, which they read at their step."""
    optimizer.found_inf = flag
