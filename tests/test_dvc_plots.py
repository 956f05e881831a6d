"""`dvc plots show` draws each plotted file once, against a column the file has (never DVC's row-index fallback)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import dvc
from helpers import add_plot_columns

from rlhf.pipeline.params import read_yaml


def stage_plots(spec: dict) -> dict[str, dict]:
    """{file: its props} of the stages' ``plots:`` entries."""
    return {path: props for stage in spec["stages"].values() for entry in stage.get("plots", [])
            for path, props in entry.items()}


def test_each_plotted_file_is_drawn_once_against_its_own_x_column(project: Path) -> None:
    spec = read_yaml(project / "dvc.yaml")
    columns = {}  # file -> its columns, x first
    for path, props in stage_plots(spec).items():
        assert "x" in props and "y" in props, f"dvc.yaml: stage plot {path} needs x and y (else: the row index)"
        columns[path] = [props["x"], props["y"]]
    folders = []  # plots whose id is a path (each file in it is a chart of its own), e.g. the frontier charts
    top: dict[str, list[str]] = {}  # file -> its columns, over the top-level plots that draw it (x first)
    for entry in spec["plots"]:
        ((plot_id, plot),) = entry.items()
        if isinstance(plot["y"], str):
            folders.append(plot_id)
            continue
        for path in plot["y"]:
            assert path not in columns, f"{path}: a stage plot and in a top-level plot, so drawn twice"
        add_plot_columns(top, plot)
    columns |= top

    for path, names in columns.items():
        target = project / path
        target.parent.mkdir(parents=True, exist_ok=True)
        sep = "\t" if target.suffix == ".tsv" else ","
        rows = [names] + [[i] + [i / 2] * (len(names) - 1) for i in range(4)]
        target.write_text("".join(sep.join(map(str, row)) + "\n" for row in rows))

    shown = json.loads(dvc(project, "plots", "show", "--json").stdout)
    assert not shown.get("errors"), shown["errors"]
    named = {name for entry in spec["plots"] for name in entry if name not in folders}
    assert {name for name in shown["data"] if not name.startswith(tuple(folders))} == named | set(stage_plots(spec))
    for path in stage_plots(spec):
        (render,) = shown["data"][path]
        assert render["content"]["encoding"]["x"]["field"] == columns[path][0], path
