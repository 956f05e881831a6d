"""reward.functions: Python callables named ``module:callable`` (a module under the project root or an installed
package) that score responses, each weighted and added to the reward model's score. Two conventions, told apart
once, from the signature, when the function loads:

- ours, ``f(queries, responses)``: the prompts' and the responses' texts, positionally;
- TRL's (its GRPO and RLOO trainers), ``f(prompts=..., completions=..., completion_ids=..., **kwargs)``: a function
  whose signature names any of these keywords, or takes only ``**kwargs``, gets the texts and the responses' token ids
  (lists of ints, EOS included) by keyword: those it names, or all three with ``**kwargs``. TRL's dataset columns and
  ``trainer_state`` are not passed, so a function that requires one is refused.

Either returns one float per response (an ``async def`` function's result is awaited). A stage loads them before any
model (``load_functions``): each module's files are found without running them and checked against the stage's deps
in dvc.yaml (DVC reruns a stage only for the files listed there), then imported, then the function is called once on
a few prompts. Any failure, then or later, is one line naming the function's params key and spec.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.machinery
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from rlhf.pipeline.errors import RewardFunctionError
from rlhf.pipeline.sections import RewardFunctionParams

PROBE_PROMPTS = 4  # prompts a function is first called on, the first answered by an empty response
TRL_KEYWORDS = ("prompts", "completions", "completion_ids")
MAX_ABS_SCORE = 1e6
"""The largest magnitude a function may return. PPO's rewards, whitening and value loss run in float32, whose 7
significant digits lose a KL penalty of 0.01 next to a score of 1e6, and whose squares overflow from about 1.8e19:
a larger score trains on noise or stops with a NaN loss far from its cause."""


class Probe(Protocol):
    """Prompts to call the functions on once at load (``rlhf.data.prompts.Prompts`` is one)."""

    queries: list[str]
    input_ids: list[list[int]]


@dataclass(frozen=True)
class RewardFunction:
    key: str  # its params key, "reward.functions[0]"
    spec: str  # "rewards.text:repetition_penalty"
    weight: float
    fn: Callable
    keywords: tuple[str, ...] | None  # TRL's convention: the keywords it is called with; None: ours, positional

    def __call__(self, queries: Sequence[str], responses: Sequence[str],
                 response_ids: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """(B,) float32 scores of the responses, checked: one finite float each, within ±MAX_ABS_SCORE.
        ``response_ids``: the responses' token ids, for a function that asks for ``completion_ids``."""
        where = f"{self.key} ({self.spec})"
        args: tuple = (list(queries), list(responses))
        kwargs = {}
        if self.keywords is not None:
            if "completion_ids" in self.keywords and response_ids is None:
                raise RewardFunctionError(f"{where} asks for completion_ids, which this caller has not passed")
            given = {"prompts": args[0], "completions": args[1], "completion_ids": response_ids}
            args, kwargs = (), {name: given[name] for name in self.keywords}
        try:
            out = self.fn(*args, **kwargs)
            if inspect.isawaitable(out):
                out = asyncio.run(out)
        except (Exception, SystemExit) as e:  # the user's code: whatever it raises (sys.exit too) is named
            frame = traceback.extract_tb(e.__traceback__)[-1]
            raise RewardFunctionError(f"{where} raised {type(e).__name__}: {e} ({frame.filename}:{frame.lineno})") \
                from None
        try:  # float64 first: a value beyond float32's range is named as returned, not as inf
            scores = torch.as_tensor(out, dtype=torch.float64)
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
        if (huge := scores.abs() > MAX_ABS_SCORE).any():
            i = int(huge.nonzero()[0])
            raise RewardFunctionError(f"{where} returned {scores[i].item():.4g} for response {i} "
                                      f"({responses[i][:40]!r}), beyond ±{MAX_ABS_SCORE:g}: PPO's float32 loss would "
                                      "lose the KL penalty beside it or overflow (scale the function down)")
        return scores.float()


def calling_convention(fn: Callable, where: str) -> tuple[str, ...] | None:
    """How ``fn`` is called, read from its signature: None for ours, ``f(queries, responses)``; else the TRL keywords
    it takes. A signature that fits both conventions, or neither, is refused."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (some builtins): called as ours, positionally
        return None
    parameters = signature.parameters.values()
    named = tuple(p.name for p in parameters if p.name in TRL_KEYWORDS and p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                                                     p.KEYWORD_ONLY))
    keywords = TRL_KEYWORDS if any(p.kind is p.VAR_KEYWORD for p in parameters) else named
    trl = bool(keywords) and binds(signature, **dict.fromkeys(keywords))
    ours = binds(signature, None, None)
    if trl and (named or not ours):
        return keywords
    if ours and not (named or trl):
        return None
    others = [p.name for p in parameters if p.default is p.empty and p.name not in named
              and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    why = (f"it also requires {', '.join(others)}, which is no keyword TRL's convention gives here (dataset columns "
           "are not passed)" if named and others else "name its parameters one way" if trl else "")
    raise RewardFunctionError(f"{where}: the signature {signature} is neither ours, f(queries, responses), nor TRL's, "
                              f"f(prompts=..., completions=..., completion_ids=..., **kwargs)" + (f": {why}" if why
                                                                                                  else ""))


def binds(signature: inspect.Signature, *args: object, **kwargs: object) -> bool:
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def module_files(module_name: str) -> list[Path] | None:
    """The source files that importing ``module_name`` runs (each package's ``__init__`` on the way, then the
    module), found without running any of them; None where there is no such module. (``importlib.util.find_spec``
    imports the parents of a dotted name, so the submodules are looked up in their parent's folders here.)"""
    files, locations = [], None
    parts = module_name.split(".")
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        loaded = sys.modules.get(name)
        try:
            if loaded is not None:
                spec = loaded.__spec__
            elif depth == 1:
                spec = importlib.util.find_spec(name)  # a top-level name is found, not imported
            else:
                spec = importlib.machinery.PathFinder.find_spec(name, locations)
        except (ImportError, ValueError):  # an empty name part, a broken parent already imported
            return None
        if spec is None or (depth < len(parts) and spec.submodule_search_locations is None):
            return None
        if spec.has_location and spec.origin:
            files.append(Path(spec.origin))
        locations = spec.submodule_search_locations
    return files


def check_watched(files: list[Path], key: str, spec: str, stage: str, deps: Sequence[str], root: Path) -> None:
    """Each file of a function's module under the project root must be one of ``stage``'s ``deps`` (dvc.yaml's) or
    inside one, or DVC would not rerun the stage when it changes; an installed package's are not checked (nor seen
    by DVC)."""
    for file in (file.resolve() for file in files):
        if not file.is_relative_to(root) or "site-packages" in file.parts:
            continue
        path = file.relative_to(root).as_posix()
        if not any(path == dep or path.startswith(dep.rstrip("/") + "/") for dep in deps):
            raise RewardFunctionError(f"{key} ({spec}): {path} is not among the {stage} stage's deps in dvc.yaml, "
                                      f"so DVC would not rerun {stage} when it changes (add it there, or move the "
                                      "function into rewards/)")


def load_function(spec: RewardFunctionParams, key: str, root: Path, stage: str,
                  deps: Sequence[str]) -> RewardFunction:
    """Find ``spec.function``'s module with ``root`` (the project) importable, check its files against ``deps``,
    then import it (its top-level code runs only once it has passed) and read the function's convention."""
    module_name, _, attr = spec.function.partition(":")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    files = module_files(module_name)
    if files is None:
        raise RewardFunctionError(f"{key}: cannot import {module_name} for {spec.function} (ModuleNotFoundError: "
                                  f"no module named {module_name!r})")
    check_watched(files, key, spec.function, stage, deps, root)
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as e:  # importing runs the user's module (argparse at import exits)
        raise RewardFunctionError(f"{key}: cannot import {module_name} for {spec.function} ({type(e).__name__}: "
                                  f"{e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardFunctionError(f"{key}: {module_name} ({module.__file__}) has no function {attr!r}")
    return RewardFunction(key, spec.function, spec.weight, fn, calling_convention(fn, f"{key} ({spec.function})"))


def load_functions(specs: Sequence[RewardFunctionParams], probe: Probe, stage: str,
                   deps: Sequence[str]) -> list[RewardFunction]:
    """The reward functions of ``stage`` (named in messages), each checked against ``deps`` (the stage's deps in
    dvc.yaml), imported, and called once on the first PROBE_PROMPTS prompts of ``probe``, the first answered by an
    empty response (a policy can stop at once), the others by another prompt (its text and token ids)."""
    root = Path.cwd().resolve()
    functions = [load_function(spec, f"reward.functions[{i}]", root, stage, deps) for i, spec in enumerate(specs)]
    if functions:
        queries, ids = probe.queries[:PROBE_PROMPTS], probe.input_ids[:PROBE_PROMPTS]
        responses, response_ids = ["", *queries[:0:-1]], [[], *ids[:0:-1]]
        for function in functions:
            function(queries, responses, response_ids)
    return functions
