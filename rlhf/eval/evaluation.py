"""Evaluation of the final policy against the reference: sampling both on the same prompts through the training
code path (rlhf.models.rollout), scoring, sequence KL, fluency, diversity, the flat metrics, the before/after report.

Runs are named after the model that sampled them: ``reference`` (the initial policy, "before") and ``policy`` (the
trained policy of ``method``, "after"; for best_of_n the reward scorer's best of N reference responses), plus
``reference_greedy`` / ``policy_greedy`` when evaluate.greedy is on. Scorers are the
training reward (named ``reward``) and the judges of evaluate.judges, named by ``params.judge_name``: ``vader``,
or a model id/dir's last path component with every run of characters outside [A-Za-z0-9_-] replaced by ``_``
("lvwerra/distilbert-imdb" -> "distilbert-imdb", "models/my.clf/" -> "my_clf").
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.data.prompts import Prompts
from rlhf.models.rollout import SamplingParams, evaluation_lengths, forward, reference_at
from rlhf.models.runs import Run, Sampler, best_of_n_run, score_run
from rlhf.models.scorers import REWARD, Scorer, positive_threshold
from rlhf.pipeline.params import Params
from rlhf.rl.ppo import kl_penalty
from rlhf.rl.preference import best_of_n_kl

GREEDY = SamplingParams(top_k=1, top_p=1.0, temperature=1.0)
"""Sampling from the top-1 token is greedy decoding, through the same generate() as training."""
SIDES = {"reference": "before", "policy": "after",
         "reference_greedy": "before_greedy", "policy_greedy": "after_greedy"}
"""Run name (metrics keys) -> column suffix in samples.parquet."""


def score_stats(scores: np.ndarray, threshold: float) -> dict[str, float]:
    """Mean, median and the fraction of scores strictly above ``threshold``."""
    return {"mean": float(np.mean(scores)), "median": float(np.median(scores)),
            "positive_rate": float(np.mean(scores > threshold))}


def spread_stats(values: np.ndarray) -> dict[str, float]:
    """Mean, median and 90th percentile of a per-sample quantity (KL has a long right tail)."""
    return {"mean": float(np.mean(values)), "median": float(np.median(values)),
            "p90": float(np.percentile(values, 90))}


def score_key(scorer: str, run: str, stat: str) -> str:
    """Flat metrics key, named after its scorer: the training reward's ``reward.<run>_<stat>``
    (``reward.policy_positive_rate``), a judge's ``judge.<name>.<run>_<stat>`` (``judge.vader.reference_mean``)."""
    return f"{REWARD if scorer == REWARD else 'judge.' + scorer}.{run}_{stat}"


def score_column(scorer: str, run: str) -> str:
    """samples.parquet column of a score: ``reward_after``, ``judge_vader_before``, ``reward_after_greedy``."""
    return f"{scorer if scorer == REWARD else 'judge_' + scorer}_{SIDES[run]}"


def sequence_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, full_kl: torch.Tensor,
                mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence KL(pi || pi_ref) on responses sampled from pi: (sampled estimate, exact), each (B,).

    logprobs, ref_logprobs: (B, T) log pi and log pi_ref of each response token; full_kl: (B, T) the KL over the
    vocabulary at each position (``rollout.forward``'s kl, the same per-token term as ``ppo.kl_penalty="full"``);
    mask: (B, T). Sampled: sum_t log pi(y_t) - log pi_ref(y_t), unbiased for the sequence KL. Exact: sum_t full_kl.
    """
    mask = mask.float()
    return (kl_penalty(logprobs, ref_logprobs, "kl") * mask).sum(1), (full_kl * mask).sum(1)


def perplexity(nll: np.ndarray, n_tokens: np.ndarray) -> float:
    """Token-weighted perplexity exp(sum NLL / sum tokens) over a set of responses."""
    return float(np.exp(np.sum(nll) / max(np.sum(n_tokens), 1)))


def distinct_n(sequences: Sequence[Sequence[int]], n: int) -> float:
    """Distinct-n (Li et al., 2016): unique n-grams / all n-grams over every response's tokens (0 when none)."""
    ngrams = [tuple(seq[i:i + n]) for seq in sequences for i in range(len(seq) - n + 1)]
    return len(set(ngrams)) / len(ngrams) if ngrams else 0.0


def eval_metrics(scores: dict[str, dict[str, np.ndarray]], stats: dict[str, dict[str, np.ndarray]],
                 response_ids: dict[str, Sequence[Sequence[int]]], best_of: int | None = None) -> dict[str, float]:
    """The flat, stable keys of metrics/eval.json.

    scores[run][scorer]: per-sample scores of every run; stats[run] (``response_stats``) and response_ids[run] for
    the sampled runs ``policy`` (with its KL) and ``reference``. ``best_of``: N when the policy run is best-of-N,
    which has no sampled or exact KL but the analytic bound, ``kl.best_of_n_bound``.
    """
    metrics: dict[str, float] = {}
    for run, by_scorer in scores.items():
        for scorer, values in by_scorer.items():
            for stat, value in score_stats(values, positive_threshold(scorer)).items():
                metrics[score_key(scorer, run, stat)] = value
    if best_of is not None:
        metrics["kl.best_of_n_bound"] = best_of_n_kl(best_of)
    else:
        for stat, value in spread_stats(stats["policy"]["kl"]).items():
            metrics[f"kl.{stat}"] = value
        for stat, value in spread_stats(stats["policy"]["kl_full"]).items():
            metrics[f"kl.full_{stat}"] = value
    for run, prefix in (("policy", ""), ("reference", "reference_")):
        metrics[f"fluency.{prefix}ref_perplexity"] = perplexity(stats[run]["ref_nll"], stats[run]["n_tokens"])
        for n in (1, 2):
            metrics[f"diversity.{prefix}distinct{n}"] = distinct_n(response_ids[run], n)
    return metrics


@torch.no_grad()
def response_stats(run: Run, reference: PreTrainedModel, temperature: float,
                   policy: PreTrainedModel | None = None) -> dict[str, np.ndarray]:
    """Per response: the reference's NLL (``ref_nll``) and ``n_tokens``; given the policy that sampled the run, also
    its sequence ``kl`` / ``kl_full`` against the reference.

    The NLL is under the reference's own distribution (temperature 1), a fluency measure; the KL is between the two
    models at the sampling temperature, the distributions the responses come from (as in training).
    """
    out: dict[str, list[torch.Tensor]] = {"ref_nll": [], "n_tokens": [], "kl": [], "kl_full": []}
    for samples in run.batches:
        mask = samples.response_mask
        out["ref_nll"].append(-(forward(reference, samples, 1.0).logprobs * mask).sum(1))
        out["n_tokens"].append(mask.sum(1))
        if policy is not None:
            pol = forward(policy, samples, temperature, reference_at(reference, samples, temperature))
            kl, kl_full = sequence_kl(pol.logprobs, pol.ref_logprobs, pol.kl, mask)
            out["kl"].append(kl)
            out["kl_full"].append(kl_full)
    return {k: torch.cat(v).float().cpu().numpy() for k, v in out.items() if v}


def samples_table(queries: list[str], runs: dict[str, Run], scores: dict[str, dict[str, np.ndarray]],
                  policy_stats: dict[str, np.ndarray]) -> pd.DataFrame:
    """data/eval/samples.parquet: one row per prompt, every response and score before/after, the policy's KL."""
    table: dict[str, object] = {"query": queries}
    table |= {f"response_{SIDES[run]}": r.texts for run, r in runs.items()}
    table |= {score_column(scorer, run): scores[run][scorer] for scorer in scores["policy"] for run in scores}
    return pd.DataFrame(table | {key: policy_stats[key] for key in ("kl", "kl_full") if key in policy_stats})


def evaluate_policy(policy: PreTrainedModel | None, reference: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                    scorers: dict[str, Scorer], prompts: Prompts, params: Params) -> tuple[dict[str, float],
                                                                                           pd.DataFrame]:
    """Sample both models on the same prompts with the same lengths and seed, score, measure; (metrics, samples).
    ``policy`` None: the policy run is the reward scorer's best of evaluate.best_of_n reference responses (whose
    greedy run is the reference's: N greedy decodes are one)."""
    cfg, e = params.ppo, params.evaluate
    lengths = evaluation_lengths(len(prompts), cfg.response_min_tokens, cfg.response_max_tokens, params.seed)
    sampling = SamplingParams.of(cfg)
    runs: dict[str, Run] = {}
    for suffix, mode in {"": sampling, **({"_greedy": GREEDY} if e.greedy else {})}.items():
        sampler = Sampler(reference, tokenizer, mode, e.batch_size)
        runs[f"reference{suffix}"] = sampler.run(prompts.input_ids, lengths, params.seed, f"sample reference{suffix}")
        if policy is not None:
            runs[f"policy{suffix}"] = Sampler(policy, tokenizer, mode, e.batch_size).run(
                prompts.input_ids, lengths, params.seed, f"sample policy{suffix}")
        else:
            runs[f"policy{suffix}"] = runs[f"reference{suffix}"] if suffix else best_of_n_run(
                sampler, scorers[REWARD], prompts.queries, e.best_of_n, runs["reference"])
    scores = {run: score_run(scorers, prompts.queries, r.texts, e.batch_size, f"score {run}", r.response_ids)
              for run, r in runs.items()}
    stats = {"policy": response_stats(runs["policy"], reference, cfg.temperature, policy),
             "reference": response_stats(runs["reference"], reference, cfg.temperature)}
    metrics = eval_metrics(scores, stats, {run: runs[run].response_ids for run in stats},
                           e.best_of_n if policy is None else None)
    return metrics, samples_table(prompts.queries, runs, scores, stats["policy"])


LINE_BREAKS = set("\n\r\t\v\f\x1c\x1d\x1e\x85\u2028\u2029")  # str.splitlines' line boundaries, and tab
# the bidirectional embeddings, overrides and isolates: they reorder how the text after them is shown
BIDI_CONTROLS = set("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def _visible(char: str) -> str:
    """A character of a response as a report shows it: a line break or tab as a space, any other control character
    (a terminal escape, NUL, a bidi override) as its escape, ``\\x1b``; the rest as it is."""
    if char in LINE_BREAKS:
        return " "
    if unicodedata.category(char) == "Cc" or char in BIDI_CONTROLS:
        return "\\" + ascii(char)[1:-1]  # the backslash itself escaped, as every backslash of a cell is
    return char


def _cell(value: object) -> str:
    """A Markdown table cell: one line, backslashes and pipes escaped, control characters made visible
    (``_visible``), floats to 3 decimals."""
    if isinstance(value, float | np.floating):
        return f"{value:.3f}"
    return "".join(map(_visible, str(value).replace("\\", "\\\\").replace("|", "\\|")))


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]


def kl_rows(metrics: dict[str, float]) -> list[list[object]]:
    """The report's KL rows: sampled and exact, or for best-of-N the analytic bound, said to be one."""
    if "kl.best_of_n_bound" in metrics:
        return [["KL(best-of-N ‖ reference): the analytic bound log N - (N-1)/N, not a sample estimate", "",
                 metrics["kl.best_of_n_bound"]]]
    return [[f"KL(policy ‖ reference), {name}: mean / median / p90", "",
             " / ".join(f"{metrics[f'kl.{prefix}{s}']:.3f}" for s in ("mean", "median", "p90"))]
            for name, prefix in (("sampled", ""), ("exact", "full_"))]


def markdown_report(samples: pd.DataFrame, metrics: dict[str, float], scorers: Sequence[str], examples: int,
                    context: str, after: str) -> str:
    """Before (reference) vs after (``after``: 'PPO policy', ...): a summary per scorer, KL/fluency/diversity, and
    the classic notebook's table of example queries with both responses and their rewards."""
    runs = [run for run in SIDES if score_key(REWARD, run, "mean") in metrics]
    header = ["score"] + [f"{stat} ({SIDES[run].replace('_', ' ')})" for stat in ("mean", "median", "positive")
                          for run in runs]
    rows = [[scorer] + [metrics[score_key(scorer, run, stat)] for stat in ("mean", "median", "positive_rate")
                        for run in runs] for scorer in scorers]
    lines = [f"# Evaluation: before (reference) vs after ({after})", "", context, "", "## Scores", ""]
    lines += _table(header, rows)
    lines += ["", "Positive: the share of responses scoring above 0 (a logit or a reward), or above 0.05 (VADER's "
              "compound).", "", "## KL, fluency, diversity", ""]
    lines += _table(["metric", "before", "after"], [
        *kl_rows(metrics),
        ["reference model's perplexity of the responses", metrics["fluency.reference_ref_perplexity"],
         metrics["fluency.ref_perplexity"]],
        ["distinct-1", metrics["diversity.reference_distinct1"], metrics["diversity.distinct1"]],
        ["distinct-2", metrics["diversity.reference_distinct2"], metrics["diversity.distinct2"]],
    ])
    lines += ["", f"## Examples (first {min(examples, len(samples))} of {len(samples)})", ""]
    columns = ["query", "response_before", "response_after", "reward_before", "reward_after"]
    lines += _table(["query", "response (before)", "response (after)", "reward (before)", "reward (after)"],
                    samples[columns].head(examples).itertuples(index=False))
    return "\n".join(lines) + "\n"
