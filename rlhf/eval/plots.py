"""Data files for ``dvc plots``: tables a stage writes as CSV next to its metrics."""

from __future__ import annotations

import numpy as np
import pandas as pd

BINS = 20


def histogram(scores: dict[str, np.ndarray], x: str, bins: int = BINS) -> pd.DataFrame:
    """Counts of each named set of scores in equal-width bins shared by all of them; column ``x`` holds the bin
    centres (the plot's x axis), then one count column per name."""
    edges = np.histogram_bin_edges(np.concatenate(list(scores.values())), bins=bins)
    return pd.DataFrame({x: np.round((edges[:-1] + edges[1:]) / 2, 4),
                         **{name: np.histogram(values, edges)[0] for name, values in scores.items()}})
