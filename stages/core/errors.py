"""One error type for everything a user can get wrong, and the one place that turns it into a one-line exit."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path


class PipelineError(Exception):
    """Bad input (params, data files, model paths) or a numerical fault, stated in one line that names the culprit."""


class ParamsError(PipelineError):
    """A params.yaml key is unknown, of the wrong type, or has an impossible value."""


class DataError(PipelineError):
    """A data file is missing, unreadable or has the wrong schema or content."""


class ModelError(PipelineError):
    """A model or tokenizer path/id cannot be loaded or does not fit the pipeline."""


class TrainingError(PipelineError):
    """A numerical fault during training (NaN/inf score, loss or gradient)."""


def stage_help(main: Callable[[], None]) -> str | None:
    """``--help`` of the stage whose ``main`` this is: its module docstring (what it reads and writes), with the
    docstring's ``Params`` line replaced by the params the stage reads as declared in ``params.STAGE_PARAMS``.
    None for a module that is no pipeline stage."""
    from stages.core.params import STAGE_PARAMS, describe_params  # params imports this module

    module = sys.modules[main.__module__]
    stage = Path(module.__file__).stem
    if stage not in STAGE_PARAMS:
        return None
    params = f"Params  (params.yaml; dvc.yaml lists the same)\n{describe_params(stage)}\n"
    doc = re.sub(r"(?m)^Params  .*\n", lambda _: params, (module.__doc__ or "").strip() + "\n", count=1)
    return f"usage: python -m stages.{stage} [-h]\n\n{doc}"


def run_stage(main: Callable[[], None]) -> None:
    """Run a stage's ``main`` and turn a PipelineError into ``error: <message>`` on stderr and exit status 1.

    Anything else is a bug and keeps its traceback. ``-h`` / ``--help`` prints ``stage_help`` and runs nothing.
    """
    if {"-h", "--help"} & set(sys.argv[1:]) and (text := stage_help(main)) is not None:
        print(text, end="")
        raise SystemExit(0)
    try:
        main()
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
