"""The ppo stage's training curves: DVCLive, without its per-step re-read of every curve when no Studio is set up.

``Live.next_step`` re-reads every metric's whole TSV file to queue data for DVC Studio, and does so even when no
Studio is configured and nothing will be sent: work that grows with the square of the steps, for every one of the
stage's curves (measured in the benchmark notes). The files, the summary and what ``dvc plots`` reads are DVCLive's
own, unchanged.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from dvclive import Live

from rlhf.pipeline.errors import PipelineError
from rlhf.pipeline.io import naming_disk_full
from rlhf.pipeline.paths import output_path


class Curves(Live):
    """DVCLive's Live; a full disk while it writes names the curves' folder (a write's OSError names no file)."""

    def log_metric(self, *args: Any, **kwargs: Any) -> None:
        with naming_disk_full(self.dir):
            super().log_metric(*args, **kwargs)

    def next_step(self) -> None:
        with naming_disk_full(self.dir):
            super().next_step()

    def end(self) -> None:
        with naming_disk_full(self.dir):
            super().end()

    def post_data_to_studio(self) -> None:
        # a private set of DVCLive's: should it go away, every step posts (slowly) as before
        if "data" not in getattr(self, "_studio_events_to_skip", ()):
            super().post_data_to_studio()


def open_curves(folder: Path | str, resume: bool) -> Curves:
    """DVCLive's Live over ``folder``, no DVC experiment or dvc.yaml of its own (the stage's dvc.yaml declares the
    plots); ``resume`` continues the step count and files of an interrupted run."""
    try:
        return Curves(str(folder), save_dvc_exp=False, dvcyaml=False, resume=resume)
    except sqlite3.Error as e:  # DVCLive opens the DVC repo, whose state database lives in DVC's site cache folder
        raise PipelineError(f"{output_path(Path(folder))}: DVCLive cannot open DVC's state database ({e}): is the "
                            "disk full, or a file size limit (ulimit -f) set?") from None
