"""The pipeline's stages, one script each (``python -m stages.<name>``), wired by dvc.yaml.

``python -m stages.X`` imports this package before X's own imports (torch, transformers: seconds). While the package
is imported on behalf of ``-m`` (sys.argv[0] is "-m" until the module is found):
- ``-h``/``--help`` is answered here, from X's docstring and dvc.yaml, so it starts at once and loads no model;
- Ctrl-C, SIGTERM and SIGHUP end the process with one line and the signal's exit status (a stop during the imports
  would otherwise print a long traceback from inside them); rlhf.pipeline.cli.run_stage installs the handlers that
  keep checkpoints once the stage starts;
- a stage that runs as one process, started by a launcher as several (torchrun, accelerate launch: WORLD_SIZE), stops
  with one line (from the first process) before it loads anything: each process would train alone and write the same
  outputs.

A stage that params switch off (all but prepare and evaluate) imports its model and data code inside the functions
that run when it is on: off, it writes its marker in about a second, without loading transformers.
"""

import ast
import os
import signal
import sys
import textwrap
from pathlib import Path

SEVERAL_PROCESSES = ("ppo",)  # the stages whose work is shared by a launcher's processes (docs/gpu.md)


def stage_help(stage: str, root: Path) -> str:
    """``python -m stages.<stage> --help``: the script's docstring (what it reads and writes) and the params that
    ``root``'s dvc.yaml lists for it, each with its doc. Reads the script without importing it (no torch)."""
    from rlhf.pipeline.params import declaration, expand
    from rlhf.pipeline.wiring import wiring

    doc = ast.get_docstring(ast.parse((root / "stages" / f"{stage}.py").read_text(encoding="utf-8"))) or ""
    keys = expand(wiring(stage, root / "dvc.yaml").params)
    width = max(map(len, keys)) + 1
    params = "\n".join(textwrap.fill(" ".join((declaration(key).description or "").split()), 119,
                                     initial_indent=f"  {key:<{width}}", subsequent_indent=" " * (width + 2))
                       for key in keys)
    return (f"usage: python -m stages.{stage} [-h]\n\n{doc.strip()}\n\n"
            f"Params  (params.yaml; the keys dvc.yaml lists for {stage})\n{params}\n")


def _stop_while_starting(signum: int, frame: object) -> None:
    os.write(2, f"{'interrupted' if signum == signal.SIGINT else 'stopped by ' + signal.Signals(signum).name} "
                "while starting; nothing was run\n".encode())
    os._exit(128 + signum)  # nothing to clean up yet; atexit hooks of half-imported libraries would print tracebacks


if sys.argv[:1] == ["-m"]:
    from rlhf.pipeline.cli import STOP_SIGNALS
    from rlhf.pipeline.errors import PipelineError

    for _signum in STOP_SIGNALS:
        signal.signal(_signum, _stop_while_starting)
    _args = sys.orig_argv[sys.orig_argv.index("-m") + 1:]  # [stages.X, its arguments...]
    _stage = _args[0].removeprefix("stages.") if _args[0].startswith("stages.") else None
    if _stage is not None and {"-h", "--help"} & set(_args[1:]):
        try:
            print(stage_help(_stage, Path(__file__).resolve().parents[1]), end="")
        except PipelineError as _e:  # no dvc.yaml there
            print(f"error: {_e}", file=sys.stderr)
            raise SystemExit(1) from None
        raise SystemExit(0)
    _processes = int(os.environ.get("WORLD_SIZE", "1"))
    if _stage is not None and _processes > 1 and _stage not in SEVERAL_PROCESSES:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: stages.{_stage} runs as one process, but its launcher started {_processes} "
                  f"(WORLD_SIZE): run python -m stages.{_stage}; only {', '.join(SEVERAL_PROCESSES)} runs over "
                  "several (docs/gpu.md)",
                  file=sys.stderr)
        raise SystemExit(1)
