"""The frontier's limit: a pool of N reference samples per eval prompt, scored once by the reward and every judge, and
from it, without training, the KL-regularised optimum pi_beta over a grid of beta and best-of-n for n = 1, 2, 4, ...,
N (rlhf/rl/optimum.py has the math). The pool is sampled as evaluate samples: each prompt at its evaluation length,
with the same sampling settings, so the optimum is measured on the trained policies' terms.

A point of the optimum is unreliable where its estimate rests on few samples: a median effective sample size below
``MIN_ESS`` (the weights have collapsed onto a handful of samples per prompt) or a KL within ``SATURATION`` nats of
log N (the most any reweighting of N samples can reach).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from rlhf.pipeline.errors import PipelineError

# The models layer (transformers: seconds to import) loads where a pool is drawn or scored, and torch (seconds too)
# where the tables are computed, not with this module: the frontier tool reads only the tables, and starts once per
# call.
if TYPE_CHECKING:
    import torch

    from rlhf.models.runs import Sampler
    from rlhf.models.scorers import Scorer

BETAS = np.geomspace(10.0, 0.01, 61)  # from next to the reference to far past any pool's saturation
MIN_ESS = 10.0
SATURATION = 1.0
ROUND_BETAS = (1.0, 0.5, 0.3, 0.2, 0.1, 0.05, 0.03)  # the grid points the frontier's chart and report name
# a pooled sample's memory, roughly: its text, token ids and columns (measured ~2.2 KiB at 16 tokens), generously
SAMPLE_BYTES, TOKEN_BYTES = 1024, 128


def check_pool_memory(prompts: int, n: int, tokens: int) -> None:
    """Refuse, before any model loads, a pool of ``prompts`` x ``n`` samples of up to ``tokens`` tokens that cannot fit
    in the memory available: the OS killed such a run, out of memory, without a word."""
    import psutil

    needed, available = prompts * n * (SAMPLE_BYTES + tokens * TOKEN_BYTES), psutil.virtual_memory().available
    if needed > available:
        raise PipelineError(f"optimum.samples_per_prompt: a pool of {prompts} prompts x {n} samples needs about "
                            f"{needed / 2**30:.0f} GiB of memory, {available / 2**30:.1f} GiB is available (lower it, "
                            "or optimum.prompts)")


def draw_pool(reference: Sampler, query_ids: list[list[int]], lengths: list[int], n: int, seed: int) -> pd.DataFrame:
    """``n`` responses of the reference to each prompt at its length: columns prompt, sample, response, length, and
    response_ids (their token ids, which ``score_pool`` passes to the reward functions and drops)."""
    run = reference.run([q for q in query_ids for _ in range(n)], [length for length in lengths for _ in range(n)],
                        seed, desc=f"sample {n} per prompt")
    ids = run.response_ids
    return pd.DataFrame({"prompt": np.repeat(np.arange(len(query_ids)), n), "sample": np.tile(np.arange(n),
                                                                                               len(query_ids)),
                         "response": run.texts, "length": [len(r) for r in ids], "response_ids": ids})


def score_pool(pool: pd.DataFrame, queries: list[str], scorers: dict[str, Scorer], batch_size: int) -> pd.DataFrame:
    """The pool with one column of scores per scorer (``reward`` and each judge's name) and without its token ids."""
    from rlhf.models.runs import score_run

    scores = score_run(scorers, [queries[p] for p in pool["prompt"]], pool["response"].tolist(), batch_size,
                       "score the pool", pool["response_ids"].tolist())
    return pool.drop(columns="response_ids").assign(**{name: values.astype(np.float32)
                                                       for name, values in scores.items()})


def round_beta(beta: float) -> float | None:
    """The round beta (ROUND_BETAS) that ``beta`` of BETAS stands for, within half a grid step (0.3 for 0.316228): each
    names one grid point; None for the rest."""
    half_step = abs(math.log(BETAS[1] / BETAS[0])) / 2
    return next((b for b in ROUND_BETAS if abs(math.log(beta / b)) < half_step), None)


def grid(pool: pd.DataFrame, column: str) -> torch.Tensor:
    """(P, N) float64 values of a pool column, a prompt per row."""
    import torch

    n = int(pool["sample"].max()) + 1
    return torch.tensor(pool.sort_values(["prompt", "sample"])[column].to_numpy(np.float64)).view(-1, n)


def reward_grid(pool: pd.DataFrame) -> torch.Tensor:
    """(P, N) the training reward's scores (``grid``), which the optimum's weights come from."""
    from rlhf.models.scorers import REWARD

    return grid(pool, REWARD)


def scorer_stats(weights: torch.Tensor, pool: pd.DataFrame, scorers: list[str]) -> dict[str, float]:
    """Each scorer's positive rate and mean under per-prompt ``weights``, averaged over prompts."""
    from rlhf.models.scorers import positive_threshold

    stats = {}
    for name in scorers:
        values = grid(pool, name)
        stats[f"{name}.positive_rate"] = (weights * (values > positive_threshold(name))).sum(-1).mean().item()
        stats[f"{name}.mean"] = (weights * values).sum(-1).mean().item()
    return stats


def curve(pool: pd.DataFrame, scorers: list[str], betas: np.ndarray = BETAS) -> pd.DataFrame:
    """One row per beta (and beta = inf, the reference): KL, the median and least effective sample size, whether the
    estimate is reliable, and every scorer's positive rate and mean; KL increasing down the table."""
    import torch

    from rlhf.rl import optimum as opt

    rewards, n = reward_grid(pool), int(pool["sample"].max()) + 1
    uniform = torch.full_like(rewards, 1.0 / n)
    rows = [{"beta": math.inf, "kl": 0.0, "ess_median": float(n), "ess_min": float(n), "reliable": True,
             **scorer_stats(uniform, pool, scorers)}]
    for beta in betas:
        weights = opt.tilted_weights(rewards, float(beta))
        ess = opt.effective_sample_size(weights)
        kl = opt.tilted_kl(rewards, float(beta)).mean().item()
        rows.append({"beta": float(beta), "kl": kl, "ess_median": ess.median().item(), "ess_min": ess.min().item(),
                     "reliable": ess.median().item() >= MIN_ESS and kl <= math.log(n) - SATURATION,
                     **scorer_stats(weights, pool, scorers)})
    return pd.DataFrame(rows)


def best_of_n(pool: pd.DataFrame, scorers: list[str]) -> pd.DataFrame:
    """One row per n = 1, 2, 4, ... up to N: the KL bound log n - (n-1)/n, the selection's KL estimate from the pool,
    and every scorer's expected positive rate and mean (exact order statistics over n-subsets of the pool)."""
    from rlhf.rl import optimum as opt
    from rlhf.rl.preference import best_of_n_kl

    rewards, n_max = reward_grid(pool), int(pool["sample"].max()) + 1
    rows = []
    for n in [2**k for k in range(int(math.log2(n_max)) + 1)]:
        weights = opt.best_of_n_weights(rewards, n)
        rows.append({"n": n, "kl_bound": best_of_n_kl(n), "kl": opt.selection_kl(weights).mean().item(),
                     **scorer_stats(weights, pool, scorers)})
    return pd.DataFrame(rows)


def at_kl(table: pd.DataFrame, kl: float) -> dict[str, float | bool] | None:
    """The optimum at ``kl`` nats: each column linearly interpolated between the two grid points around it (the KL
    rises monotonically as beta falls), ``reliable`` if both are; None beyond the curve."""
    kls = table["kl"].to_numpy()
    if not kls[0] <= kl <= kls[-1]:
        return None
    i = min(int(np.searchsorted(kls, kl, side="right")), len(kls) - 1)
    low, high = table.iloc[max(i - 1, 0)], table.iloc[i]
    t = 0.0 if high["kl"] == low["kl"] else (kl - low["kl"]) / (high["kl"] - low["kl"])
    numeric = [c for c in table.columns if c not in ("beta", "reliable")]
    return {c: float(low[c] + t * (high[c] - low[c])) for c in numeric} | {
        "reliable": bool(low["reliable"] and high["reliable"])}


def gain_fraction(curve_table: pd.DataFrame, kl: float, key: str, gain: float) -> tuple[float | None, bool]:
    """``gain``, a policy's over its reference in ``key`` (``reward.positive_rate``, ...), as a fraction of the
    optimum's gain over the pool's reference at the policy's KL; and whether that optimum point is reliable. (None,
    False) beyond the curve or where the optimum gains nothing."""
    point = at_kl(curve_table, kl)
    if point is None:
        return None, False
    best = point[key] - float(curve_table[key].iloc[0])
    return (gain / best if best > 0 else None), bool(point["reliable"])
