"""The README's promises about the repo hold: CI runs the README's test command, the top level is as documented."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf.pipeline import registry

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    """The fenced shell commands of the README's 'Quick start' section."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", section, flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line and not line.startswith("#")]


def test_quick_start_has_exactly_two_commands() -> None:
    commands = readme_commands()
    assert len(commands) == 2, commands
    assert commands[0].endswith("dvc repro")
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci


def test_top_level_layout() -> None:
    for name in ["dvc.yaml", "params.yaml", "stages", "data", "models", "metrics", "tests", "pyproject.toml",
                 "README.md", ".ci/run", ".dvc/config"]:
        assert (ROOT / name).exists(), name


def test_dvc_yaml_is_what_the_stage_records_give() -> None:
    """dvc.yaml's stages are written from the records (STAGE in each script): `python -m tools.dvc_yaml --check`."""
    result = subprocess.run([sys.executable, "-m", "tools.dvc_yaml", "--check"], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr


def test_imported_files_sees_every_import_form(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    core = tmp_path / "rlhf" / "core"
    core.mkdir(parents=True)
    for name in ("plain", "aliased", "from_package", "from_module", "relative", "relative_module", "nested", "unused"):
        (core / f"{name}.py").write_text("")
    (core / "relative.py").write_text("from . import relative_module\nfrom .nested import x\n")
    (tmp_path / "stages").mkdir()
    script = tmp_path / "stages" / "script.py"
    script.write_text("import rlhf.core.plain\nimport rlhf.core.aliased as a\n"
                      "from rlhf.core import from_package, missing_name\nfrom rlhf.core.from_module import f\n"
                      "def g():\n    from rlhf.core import relative\n")
    monkeypatch.setattr(registry, "ROOT", tmp_path)
    assert registry.imported_files(script) == {f"rlhf/core/{name}.py" for name in (
        "plain", "aliased", "from_package", "from_module", "relative", "relative_module", "nested")}


def test_editing_the_rl_math_reruns_only_ppo_and_evaluate() -> None:
    """A stage's code deps are what it imports: the PPO math is no dep of prepare, sft or reward (an SFT rerun costs
    hours), nor is the estimator functions' module."""
    for math in ("rlhf/rl/ppo.py", "rlhf/rl/trainer.py"):
        assert {name for name in registry.stage_names() if math in registry.stage(name).code} <= {"ppo", "evaluate"}


def module_graph() -> dict[str, set[str]]:
    """Every project module -> the project modules it imports."""
    files = [path for package in ("stages", "rlhf", "tools") for path in (ROOT / package).rglob("*.py")]
    graph = {}
    for path in files:
        names = registry._imports(path)
        graph[path.relative_to(ROOT).as_posix()] = {
            name.replace(".", "/") + ".py" for name in names if (ROOT / (name.replace(".", "/") + ".py")).is_file()}
    return graph


def test_no_import_circle() -> None:
    graph = module_graph()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        assert node not in path, f"import circle: {' -> '.join(path[path.index(node):] + [node])}"
        if node in done:
            return
        for child in graph.get(node, ()):
            visit(child, [*path, node])
        done.add(node)

    for node in graph:
        visit(node, [])


def test_no_module_over_350_lines() -> None:
    long = {name: n for name in module_graph() if (n := len((ROOT / name).read_text().splitlines())) > 350}
    assert not long, long
