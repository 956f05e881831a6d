"""reward.functions: Python callables ``f(queries, responses) -> one float per response``, named ``module:callable``
(a module under the project root or an installed package), each weighted and added to the reward model's score.

A stage loads them before any model (``load_functions``): each is imported, its module file checked against the
stage's deps in dvc.yaml (DVC reruns a stage only for the files listed there), and called once on a few prompts. Any
failure, then or later, is one line naming the function's params key and spec.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf.pipeline.errors import RewardFunctionError
from rlhf.pipeline.sections import RewardFunctionParams
from rlhf.pipeline.wiring import wiring

PROBE_PROMPTS = 4  # prompts a function is first called on, the first answered by an empty response


@dataclass(frozen=True)
class RewardFunction:
    key: str  # its params key, "reward.functions[0]"
    spec: str  # "rewards.text:repetition_penalty"
    weight: float
    fn: Callable
    file: Path | None  # its module's source file

    def __call__(self, queries: list[str], responses: list[str]) -> torch.Tensor:
        """(B,) float32 scores of the responses, checked: one finite float each."""
        where = f"{self.key} ({self.spec})"
        try:
            out = self.fn(list(queries), list(responses))
        except (Exception, SystemExit) as e:  # the user's code: whatever it raises (sys.exit too) is named
            frame = traceback.extract_tb(e.__traceback__)[-1]
            raise RewardFunctionError(f"{where} raised {type(e).__name__}: {e} ({frame.filename}:{frame.lineno})") \
                from None
        try:
            scores = torch.as_tensor(out, dtype=torch.float32)
        except (TypeError, ValueError, RuntimeError):
            raise RewardFunctionError(f"{where} returned a {type(out).__name__}, not one float per response") \
                from None
        if scores.shape != (len(responses),):
            got = "a single number" if scores.dim() == 0 else f"shape {tuple(scores.shape)}"
            raise RewardFunctionError(f"{where} returned {got} for {len(responses)} responses (one float each)")
        if not (finite := torch.isfinite(scores)).all():
            i = int((~finite).nonzero()[0])
            raise RewardFunctionError(f"{where} returned {scores[i].item()} for response {i} ({responses[i][:40]!r}); "
                                      f"{int((~finite).sum())} of {len(responses)} not finite")
        return scores


def load_function(spec: RewardFunctionParams, key: str, root: Path) -> RewardFunction:
    """Import ``spec.function`` with ``root`` (the project) importable."""
    module_name, _, attr = spec.function.partition(":")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as e:  # importing runs the user's module (argparse at import exits)
        raise RewardFunctionError(f"{key}: cannot import {module_name} for {spec.function} ({type(e).__name__}: "
                                  f"{e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardFunctionError(f"{key}: {module_name} ({module.__file__}) has no function {attr!r}")
    return RewardFunction(key, spec.function, spec.weight, fn, Path(module.__file__) if module.__file__ else None)


def check_watched(function: RewardFunction, stage: str, root: Path) -> None:
    """A function's module under the project root must be one of ``stage``'s deps in dvc.yaml (or inside one), or
    DVC would not rerun the stage when it changes; an installed package's is not checked (nor seen by DVC)."""
    file = function.file.resolve() if function.file else None
    installed = file is None or not file.is_relative_to(root) or "site-packages" in file.parts
    if installed:
        return
    path = file.relative_to(root).as_posix()
    if not any(path == dep or path.startswith(dep.rstrip("/") + "/") for dep in wiring(stage).deps):
        raise RewardFunctionError(f"{function.key} ({function.spec}): {path} is not among the {stage} stage's deps "
                                  f"in dvc.yaml, so DVC would not rerun {stage} when it changes (add it there, or "
                                  "move the function into rewards/)")


def load_functions(specs: list[RewardFunctionParams], stage: str, probe: list[str]) -> list[RewardFunction]:
    """The reward functions of ``stage``, each imported, checked against its deps and called once on the first
    PROBE_PROMPTS of ``probe`` (prompts), the first answered by an empty response (a policy can stop at once), the
    others by another prompt's text."""
    root = Path.cwd().resolve()
    functions = [load_function(spec, f"reward.functions[{i}]", root) for i, spec in enumerate(specs)]
    queries = probe[:PROBE_PROMPTS]
    responses = ["", *queries[:0:-1]]
    for function in functions:
        check_watched(function, stage, root)
        function(queries, responses)
    return functions
