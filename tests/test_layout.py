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


def imported_modules(path: Path, root: Path) -> set[str]:
    """Dotted names ``path`` may import, in every form: ``import a.b [as c]``, ``from a.b import c`` (where ``c`` may
    be a module or a name in ``a.b``) and relative ``from . import c`` / ``from .b import c``, nested ones included."""
    import ast

    package = path.relative_to(root).with_suffix("").parts[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = [*package[: len(package) - node.level + 1]] if node.level else []
            module = ".".join(parts + (node.module.split(".") if node.module else []))
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return names


def stage_modules(script: Path, root: Path = ROOT) -> set[str]:
    """Every module of the ``stages`` package that ``script`` imports, directly or through other such modules."""
    seen: set[str] = set()
    todo = [script]
    while todo:
        for name in imported_modules(todo.pop(), root):
            path = root / (name.replace(".", "/") + ".py")
            relative = path.relative_to(root).as_posix()
            if name.startswith("stages.") and path.is_file() and relative not in seen:
                seen.add(relative)
                todo.append(path)
    return seen


def test_stage_modules_sees_every_import_form(tmp_path: Path) -> None:
    core = tmp_path / "stages" / "core"
    core.mkdir(parents=True)
    for name in ("plain", "aliased", "from_package", "from_module", "relative", "relative_module", "nested", "unused"):
        (core / f"{name}.py").write_text("")
    (core / "relative.py").write_text("from . import relative_module\nfrom .nested import x\n")
    script = tmp_path / "stages" / "script.py"
    script.write_text("import stages.core.plain\nimport stages.core.aliased as a\n"
                      "from stages.core import from_package, missing_name\nfrom stages.core.from_module import f\n"
                      "def g():\n    from .core import relative\n")
    assert stage_modules(script, tmp_path) == {f"stages/core/{name}.py" for name in (
        "plain", "aliased", "from_package", "from_module", "relative", "relative_module", "nested")}


def test_every_stage_depends_on_exactly_the_code_it_runs() -> None:
    """A code change reruns exactly the stages that import the changed module (DVC knows only the listed deps)."""
    import yaml

    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name, stage in stages.items():
        script = ROOT / "stages" / f"{name}.py"
        code = {dep for dep in stage["deps"] if dep.startswith("stages/")}
        assert f"stages/{name}.py" in code, name
        imported = stage_modules(script) | {f"stages/{name}.py"}
        assert not imported - code, f"dvc.yaml: stage {name} imports {sorted(imported - code)} without listing them"
        assert not code - imported, f"dvc.yaml: stage {name} lists {sorted(code - imported)} but does not import them"
