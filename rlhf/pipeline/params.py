"""params.yaml -> ``Params``: typed, validated, frozen, the pipeline's only config. A stage calls
``load_params(stage)`` before any data or model loads: a missing or unknown key, a wrong type or an impossible value is
one line naming the dotted key and the rule, and the stage can read only the keys dvc.yaml lists for it (another
raises, naming it: DVC would not rerun the stage when it changes). YAML is read as DVC reads it (1.2: ``1e-5`` is a
number, ``yes`` a string)."""

from __future__ import annotations

import functools
import time
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from ruamel.yaml import YAML, YAMLError

from rlhf.pipeline.errors import ModelError, ParamsError
from rlhf.pipeline.paths import REWARD_DIR, SFT_DIR
from rlhf.pipeline.section import Rule, Section
from rlhf.pipeline.sections import Params
from rlhf.pipeline.wiring import wiring

PARAMS_FILE = Path("params.yaml")
ROOT = Path(__file__).resolve().parents[2]  # the project, whose params.yaml holds the defaults


def parse_yaml(text: str, where: str) -> Any:
    """YAML text as DVC reads params; ``where`` names the text in the one-line error."""
    try:
        return YAML(typ="safe").load(text)
    except YAMLError as e:
        problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
        line = f"line {mark.line + 1}: " if mark is not None else ""
        raise ParamsError(f"{where}: not valid YAML: {line}{problem or str(e).strip().splitlines()[0]}") from None


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ParamsError(f"{path}: not found (run from the project root)") from None
    except UnicodeDecodeError as e:
        raise ParamsError(f"{path}: not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r})") from None
    except OSError as e:  # a folder, no permission
        raise ParamsError(f"{path}: cannot be read ({e.strerror})") from None


def read_yaml(path: Path | str) -> Any:
    """A YAML file as DVC reads it (params.yaml, presets)."""
    return parse_yaml(read_text(Path(path)), str(path))


def read_settled_yaml(path: Path, *, wait: float = 0.05, tries: int = 40) -> Any:
    """read_yaml, once two reads ``wait`` seconds apart agree: a writer (``dvc exp run -S``, an editor) may be halfway
    through the file, which then misses its last keys."""
    text = read_text(path)
    for _ in range(tries):
        time.sleep(wait)
        if (again := read_text(path)) == text:
            break
        text = again
    return parse_yaml(text, str(path))


def is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, Section)


def items(annotation: Any) -> Any:
    """A list's item type (a list of sections: reward.functions), else the annotation."""
    return typing.get_args(annotation)[0] if typing.get_origin(annotation) is list else annotation


def declaration(dotted: str) -> FieldInfo:
    """The declaration of a dotted key ('ppo.steps'), a section ('ppo') or a key of a list's items."""
    model: Any = Params
    *parents, last = dotted.split(".")
    for name in parents:
        model = items(model.model_fields[name].annotation)
    return model.model_fields[last]


def dotted_keys(model: type[Section] = Params, prefix: str = "") -> list[str]:
    """Every key, dotted, in declaration order ('seed', 'method', 'data.source', ...)."""
    return [key for name, field in model.model_fields.items()
            for key in (dotted_keys(field.annotation, f"{prefix}{name}.") if is_section(field.annotation)
                        else [prefix + name])]


def expand(entries: tuple[str, ...] | list[str]) -> list[str]:
    """The dotted keys of params entries (dvc.yaml's), a section's keys in its place."""
    return [key for entry in entries for key in dotted_keys() if key == entry or key.startswith(entry + ".")]


# --- one line per error ----------------------------------------------------------------------------------------------

FIRST = {"extra_forbidden": 0, "missing": 1}  # a typo is named before the key it misspells is missing


def message(error: dict[str, Any]) -> ParamsError:
    """One pydantic error as ``params.yaml: <dotted key>: <rule> (got <value>)``: pydantic's rule, or ours for a rule
    between keys (``Rule``); an unknown key lists the known ones, a missing one says what it is."""
    loc, kind = error["loc"], error["type"]
    dotted = ".".join(part for part in loc if isinstance(part, str))
    key = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    rule, got = error["msg"][0].lower() + error["msg"][1:], f" (got {error['input']!r})"
    if kind == "value_error" and isinstance(broken := error["ctx"]["error"], Rule):
        key, rule, got = ".".join(filter(None, [key, broken.key])), broken.rule, f" (got {broken.value!r})"
    elif kind == "extra_forbidden":
        parent = dotted.rpartition(".")[0]
        known = (items(declaration(parent).annotation) if parent else Params).model_fields
        rule, got = f"unknown key (known: {', '.join(sorted(known))})", ""
    elif kind == "missing":
        field = declaration(dotted)
        what = "a section" if is_section(field.annotation) else " ".join((field.description or "").split())
        rule, got = f"missing (every key must be written out: params.yaml is DVC's cache key; {what})", ""
    return ParamsError(f"params.yaml: {key + ': ' if key else ''}{rule}{got}", key or None)


def parse_params(raw: Any, root: Path | str = ".") -> Params:
    """Validate a params mapping (as read from params.yaml) into ``Params``; relative paths resolve against root."""
    try:
        return Params.model_validate({} if raw is None else raw, context={"root": Path(root)})
    except ValidationError as e:
        raise message(min(e.errors(), key=lambda error: FIRST.get(error["type"], 2))) from None


# --- a stage's view --------------------------------------------------------------------------------------------------


def for_stage(params: Params, stage: str, keys: list[str]) -> Params:
    """``params`` in which only ``keys`` (dotted) can be read: any other field raises ``ParamsError`` naming ``stage``
    and the key (Section.__getattr__)."""

    def view(model: Section, prefix: str) -> Section:
        values = {}
        for name in type(model).model_fields:
            key, value = prefix + name, model.__dict__[name]
            if isinstance(value, Section):
                values[name] = view(value, key + ".")
            elif key in keys:
                values[name] = value
        restricted = type(model).model_construct(**values)
        restricted.__pydantic_private__["_view"] = (stage, prefix)
        return restricted

    return view(params, "")


def stage_values(params: Params, keys: list[str]) -> dict[str, Any]:
    """{dotted key: value} of ``keys`` (JSON-ready), e.g. for a checkpoint's fingerprint."""
    return {key: functools.reduce(getattr, key.split("."), params) for key in keys}


READ: dict[str, tuple[Path, dict[str, Any]]] = {}  # stage -> (params file, the values load_params gave it)


def load_params(stage: str | None = None, *, path: Path | str = PARAMS_FILE) -> Params:
    """Read and validate params.yaml (relative paths in it resolve against its folder); for ``stage``, its view of the
    keys dvc.yaml lists for it, whose values are remembered (``changed_since_read``)."""
    path = Path(path)
    params = parse_params(read_yaml(path), path.parent)
    if stage is None:
        return params
    keys = expand(wiring(stage).params)
    READ[stage] = (path.resolve(), stage_values(params, keys))
    return for_stage(params, stage, keys)


def changed_since_read(stage: str) -> str | None:
    """What changed in params.yaml among the keys ``stage`` read ("ppo.learning_rate: 1e-05 -> 2e-05"), or None. DVC
    records the file as it is when the stage ends: a value changed meanwhile (by a second ``dvc exp run``, by hand)
    would be recorded beside outputs made with another."""
    path, before = READ.get(stage, (None, {}))
    if path != PARAMS_FILE.resolve():  # another project's (tests run stages of many in one process)
        return None
    try:
        now = stage_values(parse_params(read_settled_yaml(path), path.parent), list(before))
    except ParamsError as e:
        return f"it no longer validates: {e}"
    changes = [f"{key}: {before[key]!r} -> {now[key]!r}" for key in before if now[key] != before[key]]
    return "; ".join(changes[:3]) + ("; ..." if len(changes) > 3 else "") if changes else None


# --- what the params point at ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InitialPolicy:
    """The initial policy, also the frozen reference: its weights, its tokenizer, what messages call it (the params key
    it came from, or its folder) and, beside models/sft, model.tokenizer (which must be the tokenizer sft saved)."""

    path: str
    tokenizer: str
    what: str
    same_tokenizer: str | None = None


def initial_policy(params: Params) -> InitialPolicy:
    """models/sft when sft.enabled (its own tokenizer), else model.policy."""
    if params.sft.enabled:
        if not (SFT_DIR / "config.json").exists():
            raise ModelError(f"sft.enabled is true but {SFT_DIR} holds no trained model (run the sft stage)")
        return InitialPolicy(str(SFT_DIR), str(SFT_DIR), str(SFT_DIR), params.model.tokenizer)
    return InitialPolicy(params.model.policy, params.tokenizer_path, "model.policy")


def reward_model(params: Params) -> tuple[str | None, str]:
    """(path or id, params key) of the training reward's model: models/reward when reward.train, else reward.model
    (None: reward.model is null, the reward functions alone)."""
    if params.reward.train:
        if not (REWARD_DIR / "config.json").exists():
            raise ModelError(f"reward.train is true but {REWARD_DIR} holds no trained model (run the reward stage)")
        return str(REWARD_DIR), str(REWARD_DIR)
    return params.reward.model, "reward.model"


@functools.cache
def defaults() -> Params:
    """The project's own params.yaml, the one place defaults are written (for tests, benchmarks and tools)."""
    return load_params(path=ROOT / PARAMS_FILE)
