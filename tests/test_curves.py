"""The ppo stage's curves: DVCLive's files, without re-reading them at every step when no DVC Studio is set up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dvclive.live
import pytest

from rlhf.train.curves import open_curves


def test_steps_write_dvclive_s_files_without_rereading_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("DVC_STUDIO_TOKEN", "STUDIO_TOKEN", "DVC_STUDIO_URL", "DVC_STUDIO_REPO_URL"):
        monkeypatch.delenv(name, raising=False)
    reads = []
    parse = dvclive.live.parse_metrics
    monkeypatch.setattr(dvclive.live, "parse_metrics", lambda live: reads.append(live) or parse(live))
    with open_curves(tmp_path / "curves", resume=False) as live:
        for step in range(3):
            live.log_metric("objective/kl", 0.5 * step, plot=True)
            live.log_metric("objective/scores", 1.0 + step, plot=True)
            live.next_step()
        assert reads == []  # DVCLive itself re-reads every file at every step
    rows = (tmp_path / "curves/plots/metrics/objective/kl.tsv").read_text().splitlines()
    assert rows[0].split("\t") == ["step", "kl"] and [r.split("\t")[1] for r in rows[1:]] == ["0.0", "0.5", "1.0"]
    assert json.loads((tmp_path / "curves/metrics.json").read_text())["objective"] == {"kl": 1.0, "scores": 3.0}


def test_dvc_s_state_database_that_cannot_grow_is_one_line(tmp_path: Path) -> None:
    """DVCLive opens the DVC repo, whose state database (sqlite) fails as a bare "disk I/O error" when the disk is
    full or a file size limit is set (seen with ``ulimit -f 20``): one line naming the curves, no traceback."""
    subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    script = ("import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))\n"
              "from rlhf.pipeline.cli import run_stage; from rlhf.train.curves import open_curves\n"
              "run_stage(lambda: open_curves('metrics/ppo', resume=False))\n")
    (tmp_path / "run.py").write_text(script)
    result = subprocess.run([sys.executable, "run.py"], cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "DVC_SITE_CACHE_DIR": str(tmp_path / "site-cache")})
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: metrics/ppo: DVCLive cannot open DVC's state database (disk I/O error)"), result.stderr
