"""params.yaml -> typed, validated, frozen ``Params`` (rlhf/pipeline/sections.py), the only config source of the
pipeline. A stage calls ``load_params(<stage>)`` first, before any data or model loads: a missing or unknown key, a
value of the wrong type or an impossible value is one line naming the dotted key and the rule, and the stage may read
only the keys dvc.yaml lists for it (any other raises, naming it: DVC would not rerun the stage when it changes).
YAML is read as DVC reads params (ruamel.yaml's safe loader, YAML 1.2: ``1e-5`` is a number, ``yes`` a string).
"""

from __future__ import annotations

import functools
import typing
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import Field, ValidationError, model_validator
from pydantic.fields import FieldInfo
from ruamel.yaml import YAML, YAMLError

from rlhf.pipeline.errors import ParamsError
from rlhf.pipeline.ppo_params import PpoParams
from rlhf.pipeline.sections import (
    METHODS,
    DataParams,
    DpoParams,
    EvaluateParams,
    ModelParams,
    OptimumParams,
    PrepareParams,
    RewardParams,
    Rule,
    Section,
    SftParams,
)
from rlhf.pipeline.wiring import wiring

PARAMS_FILE = Path("params.yaml")
ROOT = Path(__file__).resolve().parents[2]  # the project, whose params.yaml holds the defaults


class Params(Section):
    """The whole of params.yaml."""

    seed: int = Field(ge=0, lt=2**32)
    """Seed of every random generator (each output derives its own from it); below 2**32, as NumPy's seeds are."""
    method: Literal[METHODS]  # type: ignore[valid-type]
    """How the evaluated policy is made from the initial one: ppo (RL against the reward scorer), dpo (DPO or IPO on
    preference pairs) or best_of_n (no training: the reward scorer's best of evaluate.best_of_n reference samples).
    The other methods' stages write only a marker."""
    data: DataParams
    model: ModelParams
    prepare: PrepareParams
    sft: SftParams
    reward: RewardParams
    ppo: PpoParams
    dpo: DpoParams
    evaluate: EvaluateParams
    optimum: OptimumParams

    @property
    def tokenizer_path(self) -> str:
        """The tokenizer every stage uses: model.tokenizer, else the SFT base / policy it belongs to."""
        if self.model.tokenizer is not None:
            return self.model.tokenizer
        if self.sft.enabled and self.sft.base != "scratch":
            return self.sft.base
        return self.model.policy

    @model_validator(mode="after")
    def _rules(self) -> Params:
        for name in type(self).model_fields:
            if isinstance(section := getattr(self, name), Section):
                section.check_with(self)
        return self


def parse_yaml(text: str, where: str) -> Any:
    """YAML text as DVC reads params; ``where`` names the text in the one-line error."""
    try:
        return YAML(typ="safe").load(text)
    except YAMLError as e:
        problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
        line = f"line {mark.line + 1}: " if mark is not None else ""
        raise ParamsError(f"{where}: not valid YAML: {line}{problem or str(e).strip().splitlines()[0]}") from None


def read_yaml(path: Path | str) -> Any:
    """A YAML file as DVC reads it (params.yaml, presets)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ParamsError(f"{path}: not found (run from the project root)") from None
    except UnicodeDecodeError as e:
        raise ParamsError(f"{path}: not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r})") from None
    except OSError as e:  # a folder, no permission
        raise ParamsError(f"{path}: cannot be read ({e.strerror})") from None
    return parse_yaml(text, str(path))


# --- the declarations ------------------------------------------------------------------------------------------------


def section_of(field: FieldInfo) -> type[Section] | None:
    tp = field.annotation
    return tp if isinstance(tp, type) and issubclass(tp, Section) else None


def declaration(dotted: str, root: type[Section] = Params) -> FieldInfo:
    """The declaration of a dotted key ('ppo.steps') or section ('ppo')."""
    model = root
    *parents, last = dotted.split(".")
    for name in parents:
        model = section_of(model.model_fields[name])
    return model.model_fields[last]


def dotted_keys(model: type[Section] = Params, prefix: str = "") -> list[str]:
    """Every leaf key, dotted, in declaration order ('seed', 'method', 'data.source', ...)."""
    keys = []
    for name, field in model.model_fields.items():
        section = section_of(field)
        keys += dotted_keys(section, f"{prefix}{name}.") if section else [prefix + name]
    return keys


def expand(entries: tuple[str, ...] | list[str]) -> list[str]:
    """The dotted keys of params entries (dvc.yaml's), a section's keys in its place."""
    return [key for entry in entries for key in dotted_keys()
            if key == entry or key.startswith(entry + ".")]


def key_doc(key: str) -> str:
    """A dotted key's doc on one line (for ``--help``)."""
    return " ".join((declaration(key).description or "").split())


# --- validation ------------------------------------------------------------------------------------------------------


def _check_keys(raw: Any, model: type[Section], prefix: str = "") -> None:
    """Unknown keys, then missing ones: params.yaml is DVC's cache key, so every key must be written out (the code has
    no defaults). A missing key's message gives its doc."""
    if not isinstance(raw, dict):
        return  # validation names the wrong type
    known = model.model_fields
    for key in raw:
        if key not in known:
            raise ParamsError(f"params.yaml: {prefix}{key}: unknown key (known: {', '.join(sorted(known))})",
                              f"{prefix}{key}")
    for name, field in known.items():
        if name not in raw:
            what = "a section" if section_of(field) else " ".join((field.description or "").split())
            raise ParamsError(f"params.yaml: {prefix}{name}: missing (every key must be written out: params.yaml is "
                              f"DVC's cache key; {what})", f"{prefix}{name}")
        if section := section_of(field):
            _check_keys(raw[name], section, f"{prefix}{name}.")


def _bounds(field: FieldInfo) -> str:
    """'must be > 0', 'must be in [0, 1)' from a field's declared bounds."""
    low = high = None
    for bound in field.metadata:
        if isinstance(bound, annotated_types.Gt | annotated_types.Ge):
            low = ("(", bound.gt) if isinstance(bound, annotated_types.Gt) else ("[", bound.ge)
        elif isinstance(bound, annotated_types.Lt | annotated_types.Le):
            high = (")", bound.lt) if isinstance(bound, annotated_types.Lt) else ("]", bound.le)
    def number(value: float) -> str:
        return str(value) if isinstance(value, int) else f"{value:g}"

    if low and high:
        return f"must be in {low[0]}{number(low[1])}, {number(high[1])}{high[0]}"
    if low:
        return f"must be {'>' if low[0] == '(' else '>='} {number(low[1])}"
    return f"must be {'<' if high[0] == ')' else '<='} {number(high[1])}"


TYPE_RULES = {"int_type": "must be an integer", "float_type": "must be a number", "bool_type": "must be a bool",
              "string_type": "must be a str", "model_type": "must be a mapping", "list_type": "must be a list",
              "finite_number": "must be a finite number", "too_short": "must not be empty"}
BOUNDS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def message(error: dict[str, Any]) -> ParamsError:
    """One pydantic error as ``params.yaml: <dotted key>: <rule> (got <value>)``."""
    loc, value, kind = error["loc"], error["input"], error["type"]
    names = [part for part in loc if isinstance(part, str)]
    key = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    hint = ""
    if kind == "value_error" and isinstance(error["ctx"]["error"], Rule):
        rule_error = error["ctx"]["error"]
        key = ".".join(filter(None, [key, rule_error.key]))
        rule, value = rule_error.rule, rule_error.value
    elif kind in BOUNDS:
        rule = _bounds(declaration(".".join(names)))
    elif kind == "literal_error":
        rule = "must be one of " + ", ".join(map(str, typing.get_args(declaration(".".join(names)).annotation)))
    elif kind in TYPE_RULES:
        rule = TYPE_RULES[kind]
        number = {"int_type": (int,), "float_type": (int, float)}.get(kind)
        if number and isinstance(value, str):
            try:
                unquoted = parse_yaml(value, "")
            except ParamsError:
                unquoted = None
            if isinstance(unquoted, number) and not isinstance(unquoted, bool):
                hint = " (a string): write it without quotes"
    else:
        rule = error["msg"][0].lower() + error["msg"][1:]
    return ParamsError(f"params.yaml: {key + ': ' if key else ''}{rule} (got {value!r}{hint})", key or None)


def parse_params(raw: Any, root: Path | str = ".") -> Params:
    """Validate a params mapping (as read from params.yaml) into ``Params``; relative paths resolve against root."""
    raw = {} if raw is None else raw
    _check_keys(raw, Params)
    try:
        return Params.model_validate(raw, context={"root": Path(root)})
    except ValidationError as e:
        raise message(e.errors()[0]) from None


# --- a stage's view --------------------------------------------------------------------------------------------------


def for_stage(params: Params, stage: str, keys: list[str]) -> Params:
    """``params`` in which only ``keys`` (dotted) can be read: any other field raises ``ParamsError`` naming
    ``stage`` and the key (Section.__getattr__), so a stage cannot depend on a param DVC does not rerun it for."""

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
    values = {}
    for key in keys:
        value: Any = params
        for name in key.split("."):
            value = getattr(value, name)
        values[key] = value
    return values


READ: dict[str, tuple[Path, dict[str, Any]]] = {}  # stage -> (params file, the values load_params gave it)


def load_params(stage: str | None = None, *, path: Path | str = PARAMS_FILE) -> Params:
    """Read and validate params.yaml (relative paths in it resolve against its folder); for ``stage``, its view
    (``for_stage``) of the keys dvc.yaml lists for it, whose values are remembered (``changed_since_read``)."""
    path = Path(path)
    params = parse_params(read_yaml(path), path.parent)
    if stage is None:
        return params
    keys = expand(wiring(stage).params)
    READ[stage] = (path.resolve(), stage_values(params, keys))
    return for_stage(params, stage, keys)


def changed_since_read(stage: str) -> str | None:
    """What changed in params.yaml among the keys ``stage`` read since ``load_params(stage)`` ("ppo.learning_rate:
    1e-05 -> 2e-05"), or None. DVC records the params file as it is when the stage ends: a value changed meanwhile
    (a second ``dvc exp run`` in the workspace writes its -S values at once) would be recorded beside outputs made
    with another."""
    path, before = READ.get(stage, (None, {}))
    if path != PARAMS_FILE.resolve():  # another project's (tests run stages of many in one process)
        return None
    try:
        now = stage_values(parse_params(read_yaml(path), path.parent), list(before))
    except ParamsError as e:
        return f"it no longer validates: {e}"
    changes = [f"{key}: {before[key]!r} -> {now[key]!r}" for key in before if now[key] != before[key]]
    return "; ".join(changes[:3]) + ("; ..." if len(changes) > 3 else "") if changes else None


@functools.cache
def defaults() -> Params:
    """The project's own params.yaml, the one place defaults are written (for tests, benchmarks and tools)."""
    return load_params(path=ROOT / PARAMS_FILE)
