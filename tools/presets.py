"""What the tools that run DVC experiments share (tools/recipe.py, tools/frontier.py): presets as params overlays,
flat dotted params, ``-S`` values DVC parses back to the same value, validation before anything is copied or run, the
local inputs a preset reads under data/raw/, and running dvc with its failure as one line."""

from __future__ import annotations

import argparse
import contextlib
import copy
import filecmp
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rlhf.pipeline.errors import ParamsError, PipelineError
from rlhf.pipeline.params import parse_params, parse_yaml, read_yaml
from rlhf.pipeline.paths import RAW_IMDB, RAW_TOKENIZER

PRESETS = Path("presets")
LOCAL_INPUTS = {"imdb": RAW_IMDB.as_posix(), "tokenizer": RAW_TOKENIZER.as_posix()}


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"ppo": {"steps": 2}} -> {"ppo.steps": 2}."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def overlay(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for dotted, value in flatten(changes).items():
        node = merged
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return merged


# a string Hydra's override grammar (which parses DVC's -S values) reads back unquoted as the same string
PLAIN_STRING = re.compile(r"(?:[A-Za-z_]|\.{0,2}/)[A-Za-z0-9_./-]*")
HYDRA_KEYWORDS = {"true", "false", "null", "inf", "nan"}


def as_override(value: None | bool | int | float | str | list | dict) -> str:
    """A validated params value spelled so that ``dvc exp run -S key=<it>`` writes back the same value and type.

    DVC parses ``-S`` with Hydra's override grammar (not YAML): null, true, 1e-05, [a,b], {key:value}, and a string
    that would read as something else (``'1'``, ``'null'``, ``'a b'``) in single quotes.
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(map(as_override, value)) + "]"
    if isinstance(value, dict):  # reward.functions' entries; their keys are params keys, plain names
        return "{" + ",".join(f"{key}:{as_override(item)}" for key, item in value.items()) + "}"
    if PLAIN_STRING.fullmatch(value) and value.lower() not in HYDRA_KEYWORDS:
        return value
    # Hydra's quoted strings: \' is a quote; backslashes are literal except before a quote or the closing quote
    escaped = re.sub(r"(\\*)'", lambda m: m[1] * 2 + "\\'", value)
    escaped = re.sub(r"(\\+)$", lambda m: m[1] * 2, escaped)
    return f"'{escaped}'"


def load_preset(name: str) -> dict[str, Any]:
    """presets/<name>.yaml; ``name`` is a plain name (``../params`` would read params.yaml as a preset)."""
    path = PRESETS / f"{name}.yaml"
    if Path(name).name != name or name.startswith(".") or not path.exists():
        known = ", ".join(sorted(p.stem for p in PRESETS.glob("*.yaml")))
        raise ParamsError(f"{path}: no such preset (known: {known})")
    return read_yaml(path) or {}


def parse_sets(pairs: list[str], flag: str) -> dict[str, Any]:
    """``key=value`` pairs (value in YAML, as DVC's ``-S`` reads it) into {dotted key: value}."""
    changes = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ParamsError(f"{flag}: {pair!r} is not key=value")
        changes[key] = parse_yaml(value, f"{flag} {pair!r}")
    return changes


def local_inputs(changes: dict[str, Any], sources: dict[str, Path | None]) -> dict[str, Path]:
    """{target: source} of the local IMDb / tokenizer copies the preset needs under data/raw/ (a DVC dependency) and
    that are missing there. A source not given for a missing target, a source that is no folder, or one that differs
    from a target already there (it would be ignored) is an error."""
    wanted = [value for value in flatten(changes).values() if isinstance(value, str)]
    copies = {}
    for kind, target in LOCAL_INPUTS.items():
        source = sources[kind]
        if source is not None and not source.is_dir():
            what = "does not exist" if not source.exists() else "is a file, not a folder"
            raise ParamsError(f"--{kind}: {source} {what} (the preset needs a folder to copy to {target})")
        if target not in wanted:
            continue
        if Path(target).exists():
            if source is not None and not same_files(source, Path(target)):
                raise ParamsError(f"--{kind}: {target} already exists and differs from {source}: remove it to copy "
                                  f"{source} there, or leave --{kind} out to use it")
            continue
        if source is None:
            raise ParamsError(f"--{kind}: the preset reads {target}, which is missing: pass --{kind} FOLDER to copy "
                              "it there")
        copies[target] = source
    return copies


def same_files(a: Path, b: Path) -> bool:
    """Whether folders ``a`` and ``b`` hold the same files, byte for byte."""
    files = {path.relative_to(a) for path in a.rglob("*") if path.is_file()}
    if files != {path.relative_to(b) for path in b.rglob("*") if path.is_file()}:
        return False
    return all(filecmp.cmp(a / file, b / file, shallow=False) for file in files)


def untracked_inputs(values: Iterable[Any], to_copy: Iterable[str]) -> list[str]:
    """The params values that name a local input inside the project that git does not hold (data/raw/..., as the
    docs advise), there or about to be copied (``to_copy``): a queued experiment runs in a copy of the commit, so
    ``dvc exp run --queue -C`` must carry them. The stages' own outputs are not inputs: DVC makes them there."""
    from rlhf.pipeline.wiring import stages, wiring

    outputs = [output for name in stages() for output in wiring(name).outputs]
    found = sorted({value for value in values if isinstance(value, str) and not Path(value).is_absolute()
                    and (Path(value).exists() or value in set(to_copy))
                    and not any(Path(value) == out or out in Path(value).parents for out in outputs)})
    tracked = subprocess.run(["git", "ls-files", "--", *found], capture_output=True, text=True).stdout.split()
    return [value for value in found
            if not any(Path(file) == Path(value) or Path(value) in Path(file).parents for file in tracked)]


def check_sources(copies: dict[str, Path]) -> None:
    """Read each source of the ``local_inputs`` copies as the stages will read its copy (the IMDb's train and test
    splits, the tokenizer), so that one that cannot be read is named before anything is copied: a broken copy left in
    data/raw/ ran into dvc exp run, and the next attempt, given a good source, refused to copy over it."""
    kinds = {target: kind for kind, target in LOCAL_INPUTS.items()}
    for target, source in copies.items():
        try:
            if kinds[target] == "imdb":
                from rlhf.data.imdb import load_imdb

                load_imdb(str(source), None, ["train", "test"])
            else:  # the models layer imports torch and transformers: seconds, only when a tokenizer is read
                from rlhf.models.loading import load_tokenizer
                from rlhf.pipeline.params import defaults

                load_tokenizer(str(source), defaults().model, what=str(source))
        except PipelineError as e:
            raise ParamsError(f"--{kinds[target]}: {e} (nothing was copied to {target})") from None


def copy_inputs(copies: dict[str, Path], dry_run: bool) -> None:
    """Make the ``local_inputs`` copies (with ``dry_run``, only say so), every source checked first
    (``check_sources``)."""
    from rlhf.pipeline.io import atomic_path

    check_sources(copies)
    for target, source in copies.items():
        print(f"{'would copy' if dry_run else 'copying'} {source} -> {target}")
        if not dry_run:
            with atomic_path(target) as tmp:  # an interrupted copy must not pass for a complete one next time
                shutil.copytree(source, tmp)


def validate(base: dict[str, Any], changes: dict[str, Any], copies: dict[str, Path]) -> None:
    """Validate params.yaml with the preset applied, each copy still to be made read as its source (which exists),
    so that nothing is copied for a preset that would fail."""
    due = {target: str(source.resolve()) for target, source in copies.items()}
    parse_params(overlay(base, {key: due.get(value, value) if isinstance(value, str) else value
                                for key, value in flatten(changes).items()}), ".")


def run_dvc(command: list[str], capture_output: bool = False, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run`` of a dvc command (``["dvc", ...]``), through this environment's DVC less one warning that
    is noise here (tools/quiet_dvc.py), except at a stop: subprocess.run kills its child a quarter of a second after
    Ctrl-C, which left DVC's locks held and its stage running on. Here dvc is waited for, and the stop passed on
    (``stop_dvc``)."""
    if capture_output:
        kwargs |= {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    with subprocess.Popen([sys.executable, "-m", "tools.quiet_dvc", *command[1:]], **kwargs) as process:
        try:
            stdout, stderr = process.communicate()
        except KeyboardInterrupt as e:  # Ctrl-C, or a stop signal (rlhf/pipeline/cli.py: Stopped)
            stop_dvc(process.pid, getattr(e, "signum", signal.SIGINT))
            process.communicate()  # its output still read: a full pipe would keep it from exiting
            raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def stop_dvc(pid: int, signum: int) -> None:
    """Stop the dvc process ``pid`` as Ctrl-C in its terminal would: SIGINT to dvc (between stages it stops; while a
    stage runs it ignores SIGINT and waits for the stage) and ``signum`` to the stage, which keeps its checkpoint and
    says so. Ctrl-C already reached both from the terminal; a SIGTERM or SIGHUP sent to this process alone did not.
    DVC runs a stage's command as ``$SHELL -c`` (its get_executable: /bin/sh without SHELL); a shell that waits for
    it rather than exec it (dash) is left alone: signalled, it dies at once, and DVC reports the stage failed before
    the stage has said what it kept. It exits with its command's status."""
    import psutil
    from dvc.stage.run import get_executable

    shell = get_executable()
    with contextlib.suppress(psutil.Error):
        dvc = psutil.Process(pid)
        for process in [dvc, *dvc.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                if (command := process.cmdline())[:1] == [shell] and "-c" in command:
                    continue
                process.send_signal(signal.SIGINT if process is dvc else signum)


def dvc(*args: str) -> str:
    """Run a read-only dvc command and return its stdout; its last error line when it fails."""
    result = run_dvc(["dvc", *args], capture_output=True, text=True)
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines() or ["no output"]
        raise PipelineError(f"dvc {' '.join(args)} failed: {lines[-1]}")
    return result.stdout


def add_input_flags(parser: argparse.ArgumentParser) -> None:
    """--imdb and --tokenizer: where to copy a preset's local inputs from, needed only when they are missing."""
    parser.add_argument("--imdb", type=Path, help=f"local IMDb Parquet folder, copied to {LOCAL_INPUTS['imdb']} "
                                                  "when a preset reads it and it is missing")
    parser.add_argument("--tokenizer", type=Path, help=f"local tokenizer folder, copied to "
                                                       f"{LOCAL_INPUTS['tokenizer']} when a preset reads it and it is "
                                                       "missing")
