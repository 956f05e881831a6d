"""What every params section is: a strict, frozen pydantic model whose fields each carry one docstring and no
default (params.yaml holds them), and which, in a stage's view (params.for_stage), refuses the fields dvc.yaml does not
list for the stage; and ``Rule``, what a broken rule between keys raises (params.message makes it one line)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, PrivateAttr

from rlhf.pipeline.errors import ParamsError


class Section(BaseModel):
    # strict: a string is never a number and a bool never an int (an int is still accepted for a float)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False,
                              use_attribute_docstrings=True)
    _view: tuple[str, str] | None = PrivateAttr(None)  # (stage, key prefix) in a stage's view (params.for_stage)

    def __getattr__(self, name: str) -> Any:  # reached only for a field left out of a stage's view
        if name in type(self).model_fields:
            stage, prefix = self.__pydantic_private__.get("_view") or ("?", "")
            raise ParamsError(f"{stage} reads {prefix}{name}, which dvc.yaml does not list among its params (add it "
                              f"to the {stage} stage's params there)")
        return super().__getattr__(name)


class Rule(ValueError):
    """``params.yaml: <key>: <rule> (got <value>)``; ``key`` relative to the model that raises it ('': the field)."""

    def __init__(self, key: str, rule: str, value: Any) -> None:
        super().__init__(rule)
        self.key, self.rule, self.value = key, rule, value


def at_most(model: BaseModel, key: str, limit: str, section: str) -> None:
    if getattr(model, key) > getattr(model, limit):
        raise Rule(key, f"must be <= {section}.{limit} ({getattr(model, limit)})", getattr(model, key))
