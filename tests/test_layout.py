"""The README's promises about the repo hold: CI runs its test command, dvc.yaml lists the code each stage runs, the
layers import in one direction as the README writes them down."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import ROOT

from rlhf.pipeline.wiring import stages, wiring


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


def imports(path: Path) -> set[str]:
    """Dotted names ``path`` may import, in every form (``import a.b``, ``from a.b import c`` where ``c`` may be a
    module or a name, relative imports, imports inside functions)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = [*package[: len(package) - node.level + 1]] if node.level else []
            module = ".".join(parts + (node.module.split(".") if node.module else []))
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return names


def project_imports(path: Path) -> set[str]:
    """The project's module files ``path`` imports directly, relative to the project ('rlhf/rl/ppo.py')."""
    files = {name.replace(".", "/") + ".py" for name in imports(path)}
    return {file for file in files if (ROOT / file).is_file() and not file.endswith("__init__.py")}


# the params' ppo section validates ppo.advantage_estimator with the estimators' records; a stage that never runs an
# estimator does not depend on its math for its outputs, so this edge does not make the RL math every stage's code
VALIDATION_ONLY = ("rlhf/pipeline/ppo_params.py", "rlhf/rl/estimators.py")


def code_of(script: str) -> set[str]:
    """The project's modules ``script`` runs: what it imports, directly or through other project modules."""
    seen: set[str] = set()
    todo = [script]
    while todo:
        module = todo.pop()
        for file in project_imports(ROOT / module):
            if (module, file) != VALIDATION_ONLY and file not in seen:
                seen.add(file)
                todo.append(file)
    return seen


@pytest.mark.parametrize("stage", list(stages(ROOT / "dvc.yaml")))
def test_dvc_yaml_lists_the_code_each_stage_runs(stage: str) -> None:
    """Editing any module a stage runs reruns it: each is one of its deps in dvc.yaml, or in a folder that is."""
    deps = wiring(stage, ROOT / "dvc.yaml").deps
    assert f"stages/{stage}.py" in deps
    missing = sorted(file for file in code_of(f"stages/{stage}.py")
                     if not any(file == dep or file.startswith(dep.rstrip("/") + "/") for dep in deps))
    assert not missing, f"dvc.yaml: stage {stage} runs {missing}, which are not among its deps"


def test_editing_the_rl_math_reruns_only_the_stages_that_run_it() -> None:
    """The PPO math and trainer are no code of prepare, sft or reward (an SFT rerun costs hours): dvc.yaml does not
    list them there, and the test above holds that those stages do not run them."""
    for math in ("rlhf/rl/ppo.py", "rlhf/rl/advantages.py", "rlhf/train/ppo_trainer.py"):
        runs = {name for name in stages(ROOT / "dvc.yaml")
                if any(math == dep or math.startswith(dep + "/") for dep in wiring(name, ROOT / "dvc.yaml").deps)}
        assert runs <= {"ppo", "evaluate"}, (math, runs)


def layers() -> list[list[str]]:
    """The layer order the README writes down ('Layers: `a` -> `b`, `c` -> ...'), bottom first."""
    paragraph = next(part for part in (ROOT / "README.md").read_text().split("\n\n") if part.startswith("Layers:"))
    order = " ".join(paragraph.split()).split(":", 1)[1].split(". ")[0]
    return [re.findall(r"`([\w/]+)/?`", part) for part in order.split("->")]


def test_layers_import_in_one_direction() -> None:
    """Each folder imports only the folders before it in the README's order (and itself); the library never imports
    a stage script, a tool or a benchmark."""
    rank = {folder: i for i, group in enumerate(layers()) for folder in group}
    assert {"rlhf/rl", "rlhf/pipeline", "stages", "tools", "bench"} <= set(rank), rank

    def folder(file: str) -> str:
        return next(name for name in sorted(rank, key=len, reverse=True) if file.startswith(name + "/"))

    wrong = []
    # bench/.venvs holds the benchmark peers' environments (installed packages, not ours)
    for path in sorted(p for name in rank for p in (ROOT / name).rglob("*.py") if ".venvs" not in p.parts):
        module = path.relative_to(ROOT).as_posix()
        for file in project_imports(path):
            mine, theirs = folder(module), folder(file)
            if theirs != mine and rank[theirs] >= rank[mine] and not mine.startswith(theirs):
                wrong.append(f"{module} imports {file}")
    assert not wrong, "\n".join(wrong)


def module_graph() -> dict[str, set[str]]:
    """Every project module -> the project modules it imports."""
    files = [path for package in ("stages", "rlhf", "tools") for path in (ROOT / package).rglob("*.py")]
    graph = {}
    for path in files:
        names = imports(path)
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
