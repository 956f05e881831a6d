"""`dvc plots show` draws every chart of dvc.yaml's top-level `plots:` in a real headless browser (Debian's chromium),
offline, as the README says: with the page template .dvc/plots/offline.html, which loads vega, vega-lite and
vega-embed from the project's .vega/ folder instead of DVC's CDN (that no test machine reaches). The scripts are the
versions DVC's own page asks for, installed once with npm (.ci/run does this):

    npm install --prefix ~/.cache/imdb-rlhf/vega --no-save --legacy-peer-deps \
        vega@5.20.2 vega-lite@5.2.0 vega-embed@6.18.2

(VEGA_JS_DIR overrides that folder; the test links the project's .vega to it.) Without chromium or those scripts the
test skips, naming what is missing; under CI (CI=true) it fails instead, so a missing install step cannot pass
unnoticed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import dvc
from helpers import add_plot_columns

from rlhf.eval.frontier import CHART_DIR, write_frontier

VEGA_JS_DIR = Path(os.environ.get("VEGA_JS_DIR", Path.home() / ".cache" / "imdb-rlhf" / "vega"))
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--virtual-time-budget=20000"]
SCRIPT = re.compile(r'<script src="([^"]*/npm/(vega(?:-lite|-embed)?)@([0-9.]+))"></script>')
CHART = re.compile(r'<div id="([^"]+)" class="vega-embed[^"]*">'  # the plot's div, as vega-embed leaves it
                   r'<div class="chart-wrapper"[^>]*><(?:canvas|svg)\b([^>]*)>')


def missing(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must install it: see tests/test_plots_browser.py)")
    pytest.skip(reason)


def find_chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    missing("no chromium binary on PATH (apt-get install chromium)")


def check_local_scripts(html: str) -> None:
    """The scripts DVC's own page loads from its CDN are installed in VEGA_JS_DIR, the same versions."""
    scripts = SCRIPT.findall(html)
    assert {name for _, name, _ in scripts} == {"vega", "vega-lite", "vega-embed"}, scripts
    for _, name, version in scripts:
        package = VEGA_JS_DIR / "node_modules" / name
        js = package / "build" / f"{name}.min.js"
        installed = json.loads((package / "package.json").read_text())["version"] if js.exists() else None
        if installed != version:
            missing(f"{js}: need {name}@{version} (found {installed}); "
                    f"npm install --prefix {VEGA_JS_DIR} --no-save --legacy-peer-deps {name}@{version}")


def fake_frontier(project: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A two-series frontier written by the frontier tool's own writer, the second with two seeds (error bars);
    return the chart's plot id."""
    reference = {"experiment": "", "point": "reference", "kl.mean": 0.0, "reward.policy_positive_rate": 0.41,
                 "judge.vader.policy_positive_rate": 0.36}
    rows = [{**reference, "series": "ppo"}, {**reference, "series": "rloo"}]
    for series, shift, seed in (("ppo", 0.0, None), ("rloo", 0.05, 0), ("rloo", 0.08, 1)):
        rows += [{"experiment": f"cpu-{series}-kl{c}", "series": series, "point": f"kl{c}", "seed": seed,
                  "kl.mean": kl + shift, "reward.policy_positive_rate": rm + shift,
                  "judge.vader.policy_positive_rate": vader + shift}
                 for c, kl, rm, vader in ((0.4, 1.6, 0.52, 0.44), (0.2, 4.8, 0.68, 0.55), (0.05, 7.9, 0.8, 0.5))]
    monkeypatch.chdir(project)
    _, chart = write_frontier(rows, "cpu")
    return re.sub(r"[^A-Za-z0-9]", "_", str(chart))  # the div id DVC gives a plot of a folder's file


def fake_plot_data(project: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Write a few rows into every file a top-level plot reads, with the fields it names; return the plot ids."""
    spec = yaml.safe_load((project / "dvc.yaml").read_text())
    ids, columns = [], {}  # columns: {file: [x, fields...]}, gathered first: several plots read one file
    for entry in spec["plots"]:
        ((plot_id, plot),) = entry.items()
        if plot_id == str(CHART_DIR):  # a folder of files, one chart each, with a template of its own
            ids.append(fake_frontier(project, monkeypatch))
            continue
        ids.append(plot_id)
        add_plot_columns(columns, plot)
    for name, names in columns.items():
        path = project / name
        sep = "\t" if path.suffix == ".tsv" else ","
        rows = [names] + [[i, *(0.5 * i * (k + 1) for k in range(len(names) - 1))] for i in range(8)]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(sep.join(map(str, row)) + "\n" for row in rows))
    return ids


def rendered_charts(chromium: str, page: Path, profile: Path) -> dict[str, tuple[int, int]]:
    """Open the page in headless chromium, let its JavaScript run, return {plot id: (width, height)} drawn."""
    result = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    charts = {}
    for plot_id, attrs in CHART.findall(result.stdout):
        size = dict(re.findall(r'(width|height)="(\d+)"', attrs))
        charts[plot_id] = (int(size.get("width", 0)), int(size.get("height", 0)))
    return charts


def test_dvc_plots_show_renders_every_chart(project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    chromium = find_chromium()
    plot_ids = fake_plot_data(project, monkeypatch)
    assert {"reward", "kl", "score_histogram", "metrics_frontier_chart_cpu_json"} <= set(plot_ids)

    dvc(project, "plots", "show", "-o", "online")
    check_local_scripts((project / "online" / "index.html").read_text())
    (project / ".vega").symlink_to(VEGA_JS_DIR)
    dvc(project, "plots", "show", "-o", "plots", "--html-template", ".dvc/plots/offline.html")
    page = project / "plots" / "index.html"
    assert not SCRIPT.findall(page.read_text()), "the offline page loads a script from the CDN"

    charts = rendered_charts(chromium, page, tmp_path / "chromium-profile")
    for plot_id in plot_ids:
        width, height = charts.get(plot_id, (0, 0))
        assert width > 0 and height > 0, f"{plot_id}: not drawn ({charts})"
