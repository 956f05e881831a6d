"""What every params section shares: strict types, the ``Rule`` a broken rule raises (naming its key), Hub ids or
local paths that must exist, and finding a key's declaration."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo
from pydantic.fields import FieldInfo

from rlhf.pipeline.paths import is_local


class Rule(ValueError):
    """A broken rule, raised inside validation and reported as ``params.yaml: <key>: <rule> (got <value>)``; ``key``
    is relative to the model that raises it ('' for the field being validated)."""

    def __init__(self, key: str, rule: str, value: Any) -> None:
        super().__init__(rule)
        self.key, self.rule, self.value = key, rule, value


def _exists_if_local(value: str, info: ValidationInfo) -> str:
    """A value written like a local path must exist under the params file's folder (a Hub id cannot be checked
    offline, and is not). Checked only when validating a params file (``parse_params`` gives the root)."""
    root = (info.context or {}).get("root")
    if root is not None and is_local(value) and not (Path(root) / Path(value).expanduser()).exists():
        raise Rule("", "local path does not exist", value)
    return value


PathOrId = Annotated[str, AfterValidator(_exists_if_local)]
"""A Hub id or a local path; a local one must exist."""


def judge_name(spec: str) -> str:
    """A stable, DVC-friendly metrics name for a scorer: 'vader', or the model's last path component, sanitized."""
    return re.sub(r"[^A-Za-z0-9_-]+", "_", Path(spec.rstrip("/")).name) or "model"


class Section(BaseModel):
    # strict: a string is never a number and a bool never an int (an int is still accepted for a float)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False,
                              use_attribute_docstrings=True)

    def check_with(self, params: Any) -> None:
        """The rules between this section's keys and other sections' (``params``: the whole, validated ``Params``);
        a broken one raises ``Rule`` with the key from the root ('dpo.max_length')."""


class Schedule(Section):
    """The keys of every stage trained by the one fit loop (rlhf/train/fit.py): its section's first four."""

    learning_rate: float = Field(gt=0)
    """Peak AdamW learning rate (warmup, then cosine decay)."""
    warmup_steps: int = Field(ge=0)
    """Linear warmup steps (at most half of the steps)."""
    max_grad_norm: float = Field(gt=0)
    """Gradient-norm clip of each optimizer step."""
    checkpoint_every: int | None = Field(ge=0)
    """Optimizer steps per resumable checkpoint in data/checkpoints/<stage>/ (a rerun after a kill resumes from the
    newest); 0 or null: off."""


def at_most(model: BaseModel, key: str, limit: str, section: str) -> None:
    if getattr(model, key) > getattr(model, limit):
        raise Rule(key, f"must be <= {section}.{limit} ({getattr(model, limit)})", getattr(model, key))


def section_of(field: FieldInfo) -> type[Section] | None:
    tp = field.annotation
    return tp if isinstance(tp, type) and issubclass(tp, Section) else None


def declaration(root: type[Section], dotted: str) -> FieldInfo:
    """The declaration of a dotted key ('ppo.steps') or section ('ppo') of the ``root`` model."""
    model = root
    *parents, last = dotted.split(".")
    for name in parents:
        model = section_of(model.model_fields[name])
    return model.model_fields[last]


def dotted_keys(model: type[Section], prefix: str = "") -> list[str]:
    """Every leaf key, dotted, in declaration order ('seed', 'data.source', ...)."""
    keys = []
    for name, field in model.model_fields.items():
        section = section_of(field)
        keys += dotted_keys(section, f"{prefix}{name}.") if section else [prefix + name]
    return keys


def read_keys(root: type[Section], entries: tuple[str, ...]) -> list[str]:
    """The dotted keys of a stage record's params entries, a section's own keys in its place."""
    keys = []
    for entry in entries:
        section = section_of(declaration(root, entry))
        keys += dotted_keys(section, f"{entry}.") if section else [entry]
    return keys


def key_doc(root: type[Section], key: str) -> str:
    """A dotted key's doc on one line (for ``--help``)."""
    return " ".join((declaration(root, key).description or "").split())
