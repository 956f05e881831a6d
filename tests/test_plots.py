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


def test_two_runs_with_the_same_reference_share_its_bins() -> None:
    """The evaluation's histogram takes its bins from the reference's scores, the same in every run that shares the
    reference: a policy that moved further only adds bins of the same width, and the reference's counts stay put."""
    rng = np.random.default_rng(0)
    reference = rng.normal(0.0, 1.0, 200)
    near, far = reference + 0.1, reference + 5.0
    a = histogram({"before": reference, "after": near}, x="bin", bins=10, reference="before")
    b = histogram({"before": reference, "after": far}, x="bin", bins=10, reference="before")
    assert a["after"].sum() == b["after"].sum() == 200 and len(b) > len(a) >= 10
    shared = a.merge(b, on="bin", suffixes=("_a", "_b"))
    assert len(shared) == len(a)  # every bin of a is a bin of b, at the same centre
    assert shared["before_a"].tolist() == shared["before_b"].tolist() and shared["before_a"].sum() == 200
    assert np.diff(b["bin"]).tolist() == pytest.approx([np.diff(a["bin"])[0]] * (len(b) - 1), abs=1e-3)


def test_every_score_is_counted_whatever_the_edges_round_to() -> None:
    """The reference's bins, extended at the same width, hold its extreme scores exactly (recomputed as first edge +
    k x width, the last edge rounded below the largest score, which np.histogram then dropped in many draws)."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        reference = rng.normal(size=6).astype(np.float32).astype(np.float64)
        for after in (reference, reference * 3 + 1):
            hist = histogram({"before": reference, "after": after}, x="bin", reference="before")
            assert hist["before"].sum() == hist["after"].sum() == 6
