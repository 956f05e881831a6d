"""Data files for ``dvc plots``: tables a stage writes as CSV next to its metrics."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

BINS = 20


def histogram(scores: dict[str, np.ndarray], x: str, bins: int = BINS, reference: str | None = None) -> pd.DataFrame:
    """Counts of each named set of scores in equal-width bins shared by all of them; column ``x`` holds the bin
    centres (the plot's x axis), then one count column per name.

    With ``reference`` (a name), the bins are that set's: ``bins`` bins over its range, extended at the same width
    until they hold every score. Runs that share the reference's scores (the same reference model, prompts and seed)
    then share the bins, whatever the other sets hold, so their histograms compare bin for bin."""
    if reference is None:
        edges = np.histogram_bin_edges(np.concatenate(list(scores.values())), bins=bins)
    else:
        grid = np.histogram_bin_edges(scores[reference], bins=bins)
        width, everything = grid[1] - grid[0], np.concatenate(list(scores.values()))
        below = math.ceil((grid[0] - everything.min()) / width - 1e-9)
        above = math.ceil((everything.max() - grid[-1]) / width - 1e-9)
        edges = grid[0] + width * np.arange(-max(below, 0), bins + max(above, 0) + 1)
        # grid[0] + k * width rounds: np.histogram would drop a score a rounding below the first edge or above the last
        edges[0], edges[-1] = min(edges[0], everything.min()), max(edges[-1], everything.max())
    return pd.DataFrame({x: np.round((edges[:-1] + edges[1:]) / 2, 4),
                         **{name: np.histogram(values, edges)[0] for name, values in scores.items()}})
