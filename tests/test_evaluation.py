"""Evaluation math against brute-force references, the judges' naming and positive-rate rules, the report."""

from __future__ import annotations

import math
import unicodedata

import numpy as np
import pandas as pd
import pytest
import torch

from rlhf.eval.evaluation import distinct_n, eval_metrics, markdown_report, perplexity, score_stats, sequence_kl
from rlhf.models.scorers import REWARD, positive_threshold
from rlhf.pipeline.sections import judge_name
from rlhf.rl import logprobs as lp


def brute_force_kl(logits, ref_logits, responses, mask):
    """Loop over every real response position; softmax with plain math.log/exp, no torch reductions."""
    kl, kl_full = [], []
    for b in range(logits.shape[0]):
        sampled = exact = 0.0
        for t in range(logits.shape[1]):
            if not mask[b, t]:
                continue
            p = [math.exp(x) for x in logits[b, t].tolist()]
            q = [math.exp(x) for x in ref_logits[b, t].tolist()]
            p = [x / sum(p) for x in p]
            q = [x / sum(q) for x in q]
            y = int(responses[b, t])
            sampled += math.log(p[y]) - math.log(q[y])
            exact += sum(pv * (math.log(pv) - math.log(qv)) for pv, qv in zip(p, q, strict=True))
        kl.append(sampled)
        kl_full.append(exact)
    return torch.tensor(kl), torch.tensor(kl_full)


def sequence_kl_of(logits, ref_logits, responses, mask):
    """``sequence_kl`` of two models' (B, T, V) logits."""
    logprobs, ref_logprobs = lp.logprobs_from_logits(logits, responses), lp.logprobs_from_logits(ref_logits, responses)
    return sequence_kl(logprobs, ref_logprobs, lp.full_kl(logits, ref_logits), mask)


def test_sequence_kl_matches_brute_force_on_ragged_masks() -> None:
    g = torch.Generator().manual_seed(0)
    B, T, V = 4, 6, 11
    logits, ref_logits = torch.randn(B, T, V, generator=g) * 2, torch.randn(B, T, V, generator=g) * 2
    responses = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 4:] = False  # right padding (stopped at EOS)
    mask[2, :2] = False  # left padding
    mask[3, :] = False  # empty response

    kl, kl_full = sequence_kl_of(logits, ref_logits, responses, mask)
    expected_kl, expected_kl_full = brute_force_kl(logits, ref_logits, responses, mask)

    torch.testing.assert_close(kl, expected_kl, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(kl_full, expected_kl_full, rtol=1e-4, atol=1e-5)
    assert kl[3] == 0 and kl_full[3] == 0


def test_sampled_kl_is_an_unbiased_estimate_of_the_exact_kl() -> None:
    g = torch.Generator().manual_seed(1)
    V, N = 7, 40_000
    logits, ref_logits = torch.randn(1, 1, V, generator=g), torch.randn(1, 1, V, generator=g)
    samples = torch.multinomial(logits[0, 0].softmax(-1), N, replacement=True, generator=g).view(N, 1)
    kl, kl_full = sequence_kl_of(logits.expand(N, 1, V), ref_logits.expand(N, 1, V), samples, torch.ones(N, 1))
    exact = kl_full[0].item()
    assert exact > 0.05
    assert kl.mean().item() == pytest.approx(exact, rel=0.05)
    assert torch.allclose(kl_full, kl_full[0])


def test_kl_is_zero_for_identical_models() -> None:
    B, T, V = 3, 5, 13
    logits = torch.randn(B, T, V)
    kl, kl_full = sequence_kl_of(logits, logits.clone(), torch.randint(0, V, (B, T)), torch.ones(B, T))
    assert torch.allclose(kl, torch.zeros(B), atol=1e-6)
    assert torch.allclose(kl_full, torch.zeros(B), atol=1e-6)


def test_perplexity_is_token_weighted() -> None:
    # 1 token at NLL 0 and 3 tokens at NLL 1 each: exp(3 / 4), not the mean of per-sample perplexities
    assert perplexity(np.array([0.0, 3.0]), np.array([1, 3])) == pytest.approx(math.exp(0.75))


def test_distinct_n() -> None:
    responses = [[1, 2, 1, 2], [3], []]
    assert distinct_n(responses, 1) == pytest.approx(3 / 5)  # {1, 2, 3} of 5 tokens
    assert distinct_n(responses, 2) == pytest.approx(2 / 3)  # (1,2) (2,1) (1,2)
    assert distinct_n([[5], []], 2) == 0.0


@pytest.mark.parametrize(("spec", "name"), [
    ("vader", "vader"),
    ("lvwerra/distilbert-imdb", "distilbert-imdb"),
    ("models/my.clf/", "my_clf"),
    ("./judges/sst2 (v2)", "sst2_v2_"),
])
def test_judge_name_is_a_dvc_friendly_basename(spec: str, name: str) -> None:
    assert judge_name(spec) == name


def test_vader_positive_rule_is_compound_above_0_05() -> None:
    compound = np.array([0.05, 0.0501, -0.3, 0.9])
    assert score_stats(compound, positive_threshold("vader"))["positive_rate"] == 0.5


@pytest.mark.parametrize("scorer", [REWARD, "distilbert-imdb"])
def test_logit_positive_rule_is_score_above_0(scorer: str) -> None:
    logits = np.array([0.0, 1e-6, -2.0, 0.03])
    stats = score_stats(logits, positive_threshold(scorer))
    assert stats["positive_rate"] == 0.5
    assert stats["median"] == pytest.approx(5e-7)  # mean of the middle two, 0 and 1e-6


def run_scores(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {REWARD: rng.normal(size=n), "vader": rng.uniform(-1, 1, size=n)}


def test_eval_metrics_keys_are_flat_and_stable() -> None:
    runs = ["policy", "reference", "policy_greedy", "reference_greedy"]
    scores = {run: run_scores(20, i) for i, run in enumerate(runs)}
    stats = {"policy": {"kl": np.arange(10.0), "kl_full": np.arange(10.0) / 2, "ref_nll": np.array([3.0, 1.0]),
                        "n_tokens": np.array([1, 3])},
             "reference": {"ref_nll": np.array([0.0]), "n_tokens": np.array([4])}}
    metrics = eval_metrics(scores, stats, {"policy": [[1, 2, 1, 2]], "reference": [[1, 2, 3]]})

    expected = set()
    for run in runs:
        expected |= {f"reward.{run}_mean", f"reward.{run}_median", f"reward.{run}_positive_rate",
                     f"judge.vader.{run}_mean", f"judge.vader.{run}_median", f"judge.vader.{run}_positive_rate"}
    expected |= {"kl.mean", "kl.median", "kl.p90", "kl.full_mean", "kl.full_median", "kl.full_p90",
                 "fluency.ref_perplexity", "fluency.reference_ref_perplexity", "diversity.distinct1",
                 "diversity.distinct2", "diversity.reference_distinct1", "diversity.reference_distinct2"}
    assert set(metrics) == expected
    assert all(isinstance(v, float) for v in metrics.values())
    assert metrics["reward.policy_positive_rate"] == np.mean(scores["policy"][REWARD] > 0)
    assert metrics["judge.vader.reference_positive_rate"] == np.mean(scores["reference"]["vader"] > 0.05)
    assert metrics["kl.p90"] == pytest.approx(8.1) and metrics["kl.full_mean"] == pytest.approx(2.25)
    assert metrics["diversity.distinct2"] == pytest.approx(2 / 3) and metrics["diversity.reference_distinct2"] == 1.0
    assert metrics["fluency.ref_perplexity"] == pytest.approx(math.e)
    assert metrics["fluency.reference_ref_perplexity"] == 1.0


def report_of(before: list[str], after: list[str], examples: int) -> tuple[str, dict[str, float]]:
    """The report (and metrics) of prompts q0, q1, ... answered ``before`` and ``after``, with random scores."""
    n = len(before)
    scores = {"policy": run_scores(n, 0), "reference": run_scores(n, 1)}
    stats = {"policy": {"kl": np.ones(n), "kl_full": np.ones(n), "ref_nll": np.ones(n), "n_tokens": np.ones(n)},
             "reference": {"ref_nll": np.ones(n), "n_tokens": np.ones(n)}}
    metrics = eval_metrics(scores, stats, {"policy": [[1, 2]], "reference": [[1, 1]]})
    samples = pd.DataFrame({
        "query": [f"q{i}" for i in range(n)], "response_before": before, "response_after": after,
        "reward_before": scores["reference"][REWARD], "reward_after": scores["policy"][REWARD]})
    return markdown_report(samples, metrics, [REWARD, "vader"], examples=examples, context="ctx",
                           after="PPO policy"), metrics


def test_markdown_report_tables() -> None:
    report, metrics = report_of(["a | b"] + ["x"] * 4, ["line\nbreak"] + ["y"] * 4, examples=3)

    summary = next(line for line in report.splitlines() if line.startswith("| reward |"))
    assert f"{metrics['reward.policy_mean']:.3f}" in summary
    assert f"{metrics['reward.reference_positive_rate']:.3f}" in summary
    assert "| vader |" in report and "ctx" in report
    example_rows = [line for line in report.splitlines() if line.startswith("| q") and "query" not in line]
    assert len(example_rows) == 3
    assert example_rows[0].startswith("| q0 | a \\| b | line break |")
    assert all(line.count(" | ") == 4 for line in example_rows)


def test_control_characters_of_responses_are_shown_escaped_in_the_report() -> None:
    """A response's terminal escapes, NUL, bidi override or line separator went raw into report.md: colouring a
    terminal that prints it, reordering or breaking its table. Each shows as its escape (a separator as a space)."""
    report, _ = report_of(["\x1b[31mred\x1b[0m and a\x00b", "tab\there | \\ pipe"],
                          ["\u202eevil\u202c text", "line\u2028sep\x85next\x7f"], examples=2)

    assert not [c for c in report if c != "\n" and (unicodedata.category(c) == "Cc" or c in "\u202e\u202c\u2028")]
    rows = [line for line in report.splitlines() if line.startswith(("| q0 ", "| q1 "))]
    assert rows[0].startswith("| q0 | \\\\x1b[31mred\\\\x1b[0m and a\\\\x00b | \\\\u202eevil\\\\u202c text | ")
    assert rows[1].startswith("| q1 | tab here \\| \\\\ pipe | line sep next\\\\x7f | ")
    assert all(line.count(" | ") == 4 for line in rows)
