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


TOY_STAGE = '''"""toy: a new way to train the policy, added by its script alone (and its params.yaml section)."""
from pathlib import Path

from pydantic import Field

from rlhf.pipeline.paths import SFT_DIR
from rlhf.pipeline.registry import Output, Stage
from rlhf.pipeline.sections import Section

TOY_DIR = Path("models/toy")


class ToyParams(Section):
    steps: int = Field(gt=0)
    """Optimizer steps."""


STAGE = Stage(__spec__.name, params=("seed", "method", "toy"), inputs=(SFT_DIR,), outputs=(Output(TOY_DIR),),
              section=ToyParams, policy=TOY_DIR)
'''

TOY_CHECKS = '''
import sys
from rlhf.pipeline.errors import ParamsError
from rlhf.pipeline.params import parse_params
from rlhf.pipeline.registry import stage
from rlhf.pipeline.schema import methods
from rlhf.pipeline.yaml_files import read_yaml
from tools.dvc_yaml import render

raw = read_yaml("params.yaml")
assert parse_params(raw | {"method": "toy"}).toy.steps == 3
assert methods() == ["ppo", "dpo", "toy", "best_of_n"], methods()
for bad, message in (({"toy": {"steps": 0}}, "params.yaml: toy.steps: must be > 0 (got 0)"),
                     ({"toy": None}, "params.yaml: toy: must be a mapping (got None)")):
    try:
        parse_params(raw | bad)
    except ParamsError as e:
        assert str(e) == message, str(e)
    else:
        sys.exit(f"{bad} passed")
assert stage("evaluate").deps[-1].as_posix() == "models/toy", stage("evaluate").deps
dvc_yaml = render(open("dvc.yaml").read())
assert "  toy:\\n    cmd: python -m stages.toy\\n" in dvc_yaml and "      - toy\\n" in dvc_yaml
assert "      - models/toy\\n" in dvc_yaml.split("  evaluate:")[1]
print("ok")
'''


def test_a_new_stage_is_its_script_and_its_params_section(tmp_path: Path) -> None:
    """A stage added by writing stages/toy.py and its params.yaml section, and nothing else: its params validate
    (one line per bad value), ``method: toy`` is allowed, evaluate reads its policy and dvc.yaml gets its stage."""
    files = subprocess.run(["git", "ls-files", "stages", "rlhf", "tools", "params.yaml", "dvc.yaml"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes((ROOT / name).read_bytes())
    (tmp_path / "stages" / "toy.py").write_text(TOY_STAGE)
    with (tmp_path / "params.yaml").open("a") as f:
        f.write("\ntoy:\n  steps: 3\n")
    result = subprocess.run([sys.executable, "-c", TOY_CHECKS], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
