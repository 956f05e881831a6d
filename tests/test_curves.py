"""The ppo stage's curves: DVCLive's files, without re-reading them at every step when no DVC Studio is set up."""

from __future__ import annotations

import json
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
