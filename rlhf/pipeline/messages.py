"""A params validation error as the one line a user reads: ``params.yaml: <dotted key>: <rule> (got <value>)``."""

from __future__ import annotations

import typing
from typing import Any

import annotated_types
from pydantic.fields import FieldInfo

from rlhf.pipeline.errors import ParamsError
from rlhf.pipeline.schema import params_model
from rlhf.pipeline.sections import Rule, declaration
from rlhf.pipeline.yaml_files import parse_yaml


def _range(field: FieldInfo) -> str:
    """'must be > 0', 'must be in [0, 1)' from a field's declared bounds."""
    low = high = None
    for bound in field.metadata:
        if isinstance(bound, annotated_types.Gt | annotated_types.Ge):
            low = ("(", bound.gt) if isinstance(bound, annotated_types.Gt) else ("[", bound.ge)
        elif isinstance(bound, annotated_types.Lt | annotated_types.Le):
            high = (")", bound.lt) if isinstance(bound, annotated_types.Lt) else ("]", bound.le)
    if low and high:
        return f"must be in {low[0]}{low[1]:g}, {high[1]:g}{high[0]}"
    if low:
        return f"must be {'>' if low[0] == '(' else '>='} {low[1]:g}"
    return f"must be {'<' if high[0] == ')' else '<='} {high[1]:g}"


def _quoted_number_hint(value: Any, number: tuple[type, ...]) -> str:
    """' (a string): write it without quotes' when ``value`` is a quoted spelling of the wanted kind of number."""
    try:
        unquoted = parse_yaml(value, "") if isinstance(value, str) else None
    except ParamsError:
        return ""
    ok = isinstance(unquoted, number) and not isinstance(unquoted, bool)
    return " (a string): write it without quotes" if ok else ""


TYPE_RULES = {"int_type": "must be an integer", "float_type": "must be a number", "bool_type": "must be a bool",
              "string_type": "must be a str", "model_type": "must be a mapping",
              "finite_number": "must be a finite number", "too_short": "must not be empty"}


def message(error: dict[str, Any]) -> str:
    """One pydantic error as ``params.yaml: <dotted key>: <rule> (got <value>)``."""
    loc, value, kind = error["loc"], error["input"], error["type"]
    names = [part for part in loc if isinstance(part, str)]
    key = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    field = declaration(params_model(), ".".join(names)) if names else None
    hint = ""
    if kind == "value_error" and isinstance(error["ctx"]["error"], Rule):
        rule_error = error["ctx"]["error"]
        key = ".".join(filter(None, [key, rule_error.key]))
        rule, value = rule_error.rule, rule_error.value
    elif kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        rule = _range(field)
    elif kind == "literal_error":
        rule = "must be one of " + ", ".join(map(str, typing.get_args(field.annotation)))
    elif kind == "list_type":
        (item,) = typing.get_args(field.annotation)
        rule = f"must be a list of {typing.get_args(item)[0].__name__ if typing.get_args(item) else item.__name__}"
    elif kind in TYPE_RULES:
        rule = TYPE_RULES[kind]
        if kind in ("int_type", "float_type"):
            hint = _quoted_number_hint(value, (int,) if kind == "int_type" else (int, float))
    else:
        rule = error["msg"][0].lower() + error["msg"][1:]
    return f"params.yaml: {key + ': ' if key else ''}{rule} (got {value!r}{hint})"
