"""Plot tables: the score histogram shares its bins between the sets it counts."""

from __future__ import annotations

import numpy as np
import pytest

from rlhf.eval.plots import histogram


def test_histogram_shares_bins_and_counts_every_score() -> None:
    before, after = np.array([-2.0, -1.0, 0.0, 0.5]), np.array([0.7, 1.0, 2.0, 3.0])
    hist = histogram({"before": before, "after": after}, x="bin", bins=5)
    assert list(hist.columns) == ["bin", "before", "after"]
    assert hist["before"].sum() == 4 and hist["after"].sum() == 4
    assert hist["bin"].tolist() == pytest.approx([-1.5, -0.5, 0.5, 1.5, 2.5])
    assert hist["before"].tolist() == [1, 1, 2, 0, 0] and hist["after"].tolist() == [0, 0, 1, 1, 2]
