"""tests/zygote.py's children are the processes the tests would otherwise start: the same streams, exit status,
folder, ``sys.argv``, ``sys.path`` and environment as ``python -m`` or ``python <script>`` started afresh."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import run, zygote

REPORT = """\
import json, os, signal, sys
import probe
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0], "probe": probe.__file__,
                  "main": __name__, "stdin": sys.stdin.read()}))
print("progress\\r50%\\r\\ndone", file=sys.stderr)
if "--kill" in sys.argv:
    os.kill(os.getpid(), signal.SIGKILL)
if "--raise" in sys.argv:
    raise KeyboardInterrupt
sys.exit(int(sys.argv[-1]))
"""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A project-like folder: a package ``report`` to run with -m, the same code as a script, and ``probe`` found
    only through PYTHONPATH (run() sets it to the folder)."""
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "__init__.py").write_text("")
    (tmp_path / "report" / "main.py").write_text(REPORT)
    (tmp_path / "script.py").write_text(REPORT)
    (tmp_path / "probe.py").write_text("")
    return tmp_path


@pytest.mark.parametrize("args", [("-m", "report.main", "a b", "3"), ("script.py", "0"),
                                  ("script.py", "--kill", "0"), ("-m", "report.main", "--raise", "0")],
                         ids=["module", "script", "killed", "interrupted"])
def test_a_forked_run_is_the_fresh_process(folder: Path, args: tuple[str, ...]) -> None:
    forked = run(folder, sys.executable, *args)
    fresh = subprocess.run([sys.executable, *args], cwd=folder, capture_output=True, text=True,
                           stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(folder)})
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout), forked.stderr
    if "--raise" in args:  # the traceback's frames above the module are the zygote's and runpy's
        assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1] == "KeyboardInterrupt"
    else:
        assert forked.stderr == fresh.stderr
    assert '"main": "__main__"' in forked.stdout or "--kill" in args


def test_runs_that_differ_in_a_per_run_variable_share_a_zygote(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pytest sets PYTEST_CURRENT_TEST for each test: a zygote per test would import again at each."""
    assert run(folder, sys.executable, "script.py", "0").returncode == 0
    started = zygote.cache_info().currsize
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test")
    assert run(folder, sys.executable, "script.py", "0").returncode == 0
    assert zygote.cache_info().currsize == started
