"""One error type for everything a user can get wrong, and the one place that turns it (and Ctrl-C, a full disk, GPU
out-of-memory) into a one-line exit."""

from __future__ import annotations

import contextlib
import errno
import re
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from stages.core.paths import CHECKPOINTS_DIR, checkpoints, output_path


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


class DiskFull(PipelineError):
    """A write failed for want of disk space (or quota); the message names the output being written."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C inside a training loop, carrying the step it was on."""

    def __init__(self, step: int) -> None:
        super().__init__(step)
        self.step = step


@contextlib.contextmanager
def interrupted_at(step: Callable[[], int]) -> Iterator[None]:
    """Ctrl-C inside a training loop becomes ``Interrupted(step())``, the step the loop was on."""
    try:
        yield
    except Interrupted:
        raise
    except KeyboardInterrupt:
        raise Interrupted(step()) from None


# what bounds each stage's GPU memory: the advice printed when it runs out
OUT_OF_MEMORY = {
    "sft": "lower sft.batch_size (and raise sft.gradient_accumulation_steps to keep the same batch)",
    "reward": "lower reward.batch_size or reward.max_length",
    "ppo": "lower ppo.batch_size or ppo.mini_batch_size",
    "evaluate": "lower evaluate.batch_size",
}


def is_disk_full(error: BaseException) -> bool:
    """ENOSPC/EDQUOT as an OSError, or as the text of a writer that wraps it (safetensors' Rust I/O error)."""
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return any(text in str(error) for text in ("No space left on device", "Disk quota exceeded"))


def is_out_of_memory(error: BaseException) -> bool:
    torch = sys.modules.get("torch")  # a stage that never imported torch cannot have run out of GPU memory
    return torch is not None and isinstance(error, torch.OutOfMemoryError)


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


def interrupted_message(stage: str, step: int | None) -> str:
    """``interrupted at step N; checkpoint <folder> kept; rerun to resume``, or ``...; nothing written`` (a stage
    writes its outputs only when it completes); plain ``interrupted`` for a tool that is no pipeline stage."""
    from stages.core.params import STAGE_PARAMS  # params imports this module

    if stage not in STAGE_PARAMS:
        return "interrupted"
    where = "" if step is None else f" at step {step}"
    kept = checkpoints(CHECKPOINTS_DIR / stage)
    return f"interrupted{where}; " + (f"checkpoint {kept[-1]} kept; rerun to resume" if kept else "nothing written")


def stop_signals(handler: Callable[[int, object], None] | int) -> None:
    """Ctrl-C (SIGINT) and a scheduler's or ``kill``'s stop (SIGTERM) alike get ``handler``."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handler)


STOP_SIGNAL = [signal.SIGINT]  # the signal that stopped the run, for the message and the exit status


def raise_interrupt(signum: int, frame: object) -> None:
    """SIGTERM reads like Ctrl-C: a KeyboardInterrupt where the stage is, so it keeps its checkpoint."""
    STOP_SIGNAL[0] = signal.Signals(signum)
    raise KeyboardInterrupt


def check_no_arguments(main: Callable[[], None]) -> None:
    """A stage reads params.yaml only: an argument it would ignore (``--steps 10``) is refused, not dropped."""
    module = sys.modules[main.__module__]
    if stage_help(main) is not None and sys.argv[1:]:
        name = f"python -m {module.__spec__.name if module.__spec__ else Path(module.__file__).stem}"
        print(f"error: {name} takes no arguments but -h (got {' '.join(sys.argv[1:])}): set params in params.yaml "
              "or with dvc exp run -S key=value", file=sys.stderr)
        raise SystemExit(2)


def run_stage(main: Callable[[], None]) -> None:
    """Run a stage's ``main``; a PipelineError, a full disk or GPU out-of-memory becomes ``error: <message>`` on
    stderr and exit status 1, Ctrl-C or SIGTERM one ``interrupted ...`` line and exit status 130 (143).

    Anything else is a bug and keeps its traceback. ``-h`` / ``--help`` prints ``stage_help`` and runs nothing; any
    other argument of a stage is refused (exit status 2).
    """
    if {"-h", "--help"} & set(sys.argv[1:]) and (text := stage_help(main)) is not None:
        print(text, end="")
        raise SystemExit(0)
    check_no_arguments(main)
    stage = Path(sys.modules[main.__module__].__file__).stem
    stop_signals(raise_interrupt)
    try:
        main()
    except KeyboardInterrupt as e:
        stop_signals(signal.SIG_IGN)  # a second Ctrl-C must not add a traceback to the one line
        message = interrupted_message(stage, getattr(e, "step", None))
        if STOP_SIGNAL[0] != signal.SIGINT:
            message = message.replace("interrupted", f"stopped by {STOP_SIGNAL[0].name}", 1)
        print(message, file=sys.stderr)
        raise SystemExit(128 + STOP_SIGNAL[0]) from None
    except Exception as e:
        message = one_line(e, stage)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(1) from None


def one_line(error: Exception, stage: str) -> str | None:
    """What to tell the user about ``error``; None for a bug, which keeps its traceback. A full disk not met inside
    a writer that names its output (io.atomic_path) names the file the OS reported, if any."""
    if isinstance(error, PipelineError):
        return str(error)
    if is_disk_full(error):
        filename = getattr(error, "filename", None)
        return (f"disk full writing {output_path(Path(filename))}" if filename
                else f"disk full ({str(error).splitlines()[0]})")
    if is_out_of_memory(error) and stage in OUT_OF_MEMORY:
        return f"out of GPU memory in {stage}: {OUT_OF_MEMORY[stage]}"
    return None
