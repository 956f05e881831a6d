"""docs/ppo.md's table from TRL 0.11's PPOConfig to params.yaml is the one place that mapping lives: it lists every
field TRL 0.11.4's PPOConfig has (checked in the benchmark's TRL venv where it exists), and each row names a key
params.yaml has, or says "none, because ..."."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest
from conftest import ROOT

from rlhf.pipeline.params import defaults

SECTION = "## From TRL 0.11's PPOConfig"
TRL_VENVS = [ROOT / "bench" / ".venvs" / name for name in ("trl011", "trl011-system-torch")]  # bench/compare.py's


def table() -> dict[str, str]:
    """{TRL field: our cell} of the section's table."""
    text = (ROOT / "docs" / "ppo.md").read_text()
    assert SECTION in text, f"docs/ppo.md has no '{SECTION}' section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| (.+) \|$", section, flags=re.M)
    assert len(rows) == len(dict(rows)), "a field is listed twice"
    return dict(rows)


def keys(node: dict, prefix: str = "") -> set[str]:
    """Every dotted key of params.yaml's defaults, sections included."""
    out = set()
    for name, value in node.items():
        out.add(prefix + name)
        if isinstance(value, dict):
            out |= keys(value, f"{prefix}{name}.")
    return out


def test_each_row_names_one_of_our_keys_or_says_why_not() -> None:
    ours = keys(defaults().model_dump())
    for field, cell in table().items():
        if cell.startswith("none, because "):
            continue
        key = re.match(r"`([\w.]+)`", cell)
        assert key, f"docs/ppo.md: {field}: {cell!r} names no key of ours (`section.key`) nor says 'none, because'"
        assert key.group(1) in ours, f"docs/ppo.md: {field}: {key.group(1)} is no key of params.yaml"


def test_the_table_lists_every_field_of_trl_0_11_s_ppo_config() -> None:
    python = next((venv / "bin" / "python" for venv in TRL_VENVS if (venv / "bin" / "python").exists()), None)
    if python is None:
        pytest.skip("no TRL 0.11 venv (python -m bench.compare --peers trl011-batched --setup-only makes it)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the venv's packages, not this interpreter's
    script = ("import dataclasses, json, trl; "
              "print(json.dumps([trl.__version__, [f.name for f in dataclasses.fields(trl.PPOConfig)]]))")
    out = subprocess.run([str(python), "-c", script], capture_output=True, text=True, env=env, check=True)
    version, fields = json.loads(out.stdout.strip().splitlines()[-1])
    assert version == "0.11.4"
    listed = table()
    assert not (missing := [f for f in fields if f not in listed]), f"docs/ppo.md lacks TRL's {missing}"
    assert not (extra := [f for f in listed if f not in fields]), f"docs/ppo.md lists {extra}, which TRL lacks"
    assert list(listed) == fields, "docs/ppo.md lists the fields in another order than TRL's PPOConfig"
