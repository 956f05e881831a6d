"""The README's promises about the repo hold: CI runs the README's test command, the top level is as documented."""

from __future__ import annotations

import re
from pathlib import Path

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


def stage_modules(script: Path) -> set[str]:
    """Every module of the ``stages`` package that ``script`` imports, directly or through other such modules."""
    import ast

    seen: set[str] = set()
    todo = [script]
    while todo:
        tree = ast.parse(todo.pop().read_text())
        for node in ast.walk(tree):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                path = ROOT / (name.replace(".", "/") + ".py")
                if name.startswith("stages.") and path.exists() and str(path.relative_to(ROOT)) not in seen:
                    seen.add(str(path.relative_to(ROOT)))
                    todo.append(path)
    return seen


def test_every_stage_depends_on_the_code_it_runs() -> None:
    """A code change reruns exactly the stages that import the changed module (DVC knows only the listed deps)."""
    import yaml

    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        script = ROOT / "stages" / f"{name}.py"
        deps = set(stage["deps"])
        assert f"stages/{name}.py" in deps, name
        missing = stage_modules(script) - deps
        assert not missing, f"dvc.yaml: stage {name} imports {sorted(missing)} without listing them as deps"
