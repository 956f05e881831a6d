"""One error type for everything a user can get wrong, and the one place that turns it into a one-line exit."""

from __future__ import annotations

import sys
from collections.abc import Callable


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


def run_stage(main: Callable[[], None]) -> None:
    """Run a stage's ``main`` and turn a PipelineError into ``error: <message>`` on stderr and exit status 1.

    Anything else is a bug and keeps its traceback.
    """
    try:
        main()
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
