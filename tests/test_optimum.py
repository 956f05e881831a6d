"""The frontier's limit: the tilted-distribution and best-of-n estimators against references written from their
definitions, the optimum's tables on a pool built in the test, and the optimum stage on tiny models."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import ROOT, set_params

from rlhf.eval import objective as objective_module
from rlhf.eval import optimum
from rlhf.pipeline.errors import PipelineError
from rlhf.pipeline.paths import OPTIMUM_BEST_OF_N, OPTIMUM_CURVE, OPTIMUM_METRICS, OPTIMUM_POOL, POLICY_DIR
from rlhf.rl import optimum as opt
from stages.evaluate import EVAL_METRICS, EVAL_SAMPLES

# --- the math ------------------------------------------------------------------------------------------------------


def test_the_pool_estimates_are_exact_on_a_pool_holding_the_reference_in_proportion() -> None:
    """A reference over three answers with probabilities 1/2, 1/4, 1/4 is pooled exactly by [a, a, b, c]: the
    self-normalised weights then give pi_beta and its KL exactly, as computed from the definition."""
    r = {"a": 0.3, "b": 1.0, "c": -2.0}
    ref = {"a": 0.5, "b": 0.25, "c": 0.25}
    pool = torch.tensor([[r["a"], r["a"], r["b"], r["c"]]], dtype=torch.float64)
    for beta in (2.0, 0.5, 0.1):
        z = sum(ref[y] * math.exp(r[y] / beta) for y in r)
        pi = {y: ref[y] * math.exp(r[y] / beta) / z for y in r}
        kl = sum(pi[y] * math.log(pi[y] / ref[y]) for y in r)
        assert opt.tilted_kl(pool, beta).item() == pytest.approx(kl, rel=1e-12)
        weights = opt.tilted_weights(pool, beta)[0]
        assert (weights[0] + weights[1]).item() == pytest.approx(pi["a"], rel=1e-12)
        assert weights[2].item() == pytest.approx(pi["b"], rel=1e-12)


def test_the_optimal_objective_is_the_tilted_policy_s_and_beats_every_other() -> None:
    """J*_beta = beta log E_ref[exp(r / beta)] is E[r] - beta KL of pi_beta, computed from the definition on a pool
    holding the reference in proportion, and no other policy over the three answers does better."""
    r = {"a": 0.3, "b": 1.0, "c": -2.0}
    ref = {"a": 0.5, "b": 0.25, "c": 0.25}
    pool = torch.tensor([[r["a"], r["a"], r["b"], r["c"]]], dtype=torch.float64)

    def objective(pi: dict[str, float], beta: float) -> float:
        return sum(pi[y] * r[y] for y in r) - beta * sum(pi[y] * math.log(pi[y] / ref[y]) for y in r if pi[y] > 0)

    for beta in (2.0, 0.5, 0.1):
        z = sum(ref[y] * math.exp(r[y] / beta) for y in r)
        tilted = {y: ref[y] * math.exp(r[y] / beta) / z for y in r}
        assert opt.optimal_objective(pool, beta).item() == pytest.approx(objective(tilted, beta), rel=1e-12)
        for pi in ({"a": 0.2, "b": 0.7, "c": 0.1}, {"a": 0.0, "b": 1.0, "c": 0.0}, ref):
            assert objective(pi, beta) < opt.optimal_objective(pool, beta).item()
    assert opt.objective_fraction(0.5, 0.5, 0.8) == 0.0 and opt.objective_fraction(0.8, 0.5, 0.8) == 1.0
    assert opt.objective_fraction(0.6, 0.5, 0.7) == pytest.approx(0.5)
    assert opt.objective_fraction(0.6, 0.5, 0.5) is None  # nothing to gain


def test_tilted_kl_is_the_kl_of_the_weights_from_uniform_and_saturates_at_log_n() -> None:
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(5, 9, generator=g, dtype=torch.float64)
    for beta in (3.0, 0.3, 0.03):
        w = opt.tilted_weights(rewards, beta)
        assert torch.allclose(opt.tilted_kl(rewards, beta), (w * torch.log(9 * w)).sum(-1), rtol=1e-10, atol=1e-12)
    assert (opt.tilted_kl(rewards, 1e-4) <= math.log(9) + 1e-12).all()
    assert opt.tilted_kl(rewards, 1e-4).mean().item() == pytest.approx(math.log(9), rel=1e-6)


def test_effective_sample_size_runs_from_one_to_n() -> None:
    assert opt.effective_sample_size(torch.full((2, 8), 1 / 8)).tolist() == [8.0, 8.0]
    assert opt.effective_sample_size(torch.eye(4)[:1]).tolist() == [1.0]


def best_of_n_reference(rewards: list[float], n: int) -> list[float]:
    """Every n-subset equally likely; its best is the highest reward, a tie going to the later sample."""
    wins = [0] * len(rewards)
    subsets = list(itertools.combinations(range(len(rewards)), n))
    for subset in subsets:
        wins[max(subset, key=lambda i: (rewards[i], i))] += 1
    return [w / len(subsets) for w in wins]


@pytest.mark.parametrize("n", [1, 2, 3, 6])
def test_best_of_n_weights_are_the_order_statistics_of_subsets(n: int) -> None:
    rows = [[0.5, -1.0, 2.0, 0.1, 0.7, -0.3], [1.0, 1.0, 0.0, 1.0, -2.0, 3.0]]  # the second with ties
    got = opt.best_of_n_weights(torch.tensor(rows, dtype=torch.float64), n)
    for row, probabilities in zip(rows, got.tolist(), strict=True):
        assert probabilities == pytest.approx(best_of_n_reference(row, n), abs=1e-12)
    with pytest.raises(ValueError, match="must be in"):
        opt.best_of_n_weights(torch.tensor(rows), 7)


def test_selection_kl_of_best_of_one_is_zero_and_of_best_of_all_is_log_n() -> None:
    rewards = torch.randn(3, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert opt.selection_kl(opt.best_of_n_weights(rewards, 1)).abs().max().item() < 1e-12
    assert opt.selection_kl(opt.best_of_n_weights(rewards, 16)).tolist() == pytest.approx([math.log(16)] * 3)


# --- the tables ----------------------------------------------------------------------------------------------------


def synthetic_pool(prompts: int = 4, n: int = 64, seed: int = 0) -> pd.DataFrame:
    """A pool whose judge agrees with the reward most of the time."""
    g = np.random.default_rng(seed)
    reward = g.normal(size=prompts * n)
    return pd.DataFrame({"prompt": np.repeat(np.arange(prompts), n), "sample": np.tile(np.arange(n), prompts),
                         "response": "x", "length": 4, "reward": reward,
                         "vader": np.tanh(reward + g.normal(scale=0.5, size=prompts * n))})


def test_the_curve_starts_at_the_pool_rises_with_kl_and_marks_where_it_stops_holding() -> None:
    pool = synthetic_pool()
    table = optimum.curve(pool, ["reward", "vader"])
    first = table.iloc[0]
    assert first["kl"] == 0 and first["reward.positive_rate"] == pytest.approx((pool["reward"] > 0).mean())
    assert first["vader.mean"] == pytest.approx(pool["vader"].mean())
    assert (np.diff(table["kl"]) > 0).all() and (np.diff(table["reward.mean"]) > 0).all()
    log_n = math.log(64)
    expected = (table["ess_median"] >= optimum.MIN_ESS) & (table["kl"] <= log_n - optimum.SATURATION)
    assert (table["reliable"] == expected).all() and table["reliable"].any() and not table["reliable"].all()
    assert table["kl"].max() < log_n


def test_best_of_n_from_the_pool_starts_at_the_reference_and_ends_at_the_best() -> None:
    pool = synthetic_pool()
    table = optimum.best_of_n(pool, ["reward", "vader"])
    assert table["n"].tolist() == [1, 2, 4, 8, 16, 32, 64]
    assert table.iloc[0]["reward.mean"] == pytest.approx(pool["reward"].mean())
    assert table.iloc[0]["kl"] == pytest.approx(0, abs=1e-12)
    best = pool.groupby("prompt")["reward"].max().mean()
    assert table.iloc[-1]["reward.mean"] == pytest.approx(best) and table.iloc[-1]["kl"] == pytest.approx(
        math.log(64))
    # n drawn from N without replacement: near the analytic bound of independent draws while n << N
    assert (np.diff(table["kl"]) > 0).all() and abs(table.iloc[1]["kl"] - table.iloc[1]["kl_bound"]) < 0.02


def test_a_point_is_measured_against_the_optimum_at_its_own_kl() -> None:
    table = optimum.curve(synthetic_pool(), ["reward", "vader"])
    middle = table.iloc[20]
    point = optimum.at_kl(table, float(middle["kl"]))
    assert point["reward.positive_rate"] == pytest.approx(middle["reward.positive_rate"])
    halfway = optimum.at_kl(table, float((table.iloc[20]["kl"] + table.iloc[21]["kl"]) / 2))
    assert halfway["reward.mean"] == pytest.approx((table.iloc[20]["reward.mean"] + table.iloc[21]["reward.mean"]) / 2)
    gain = float(middle["reward.positive_rate"] - table.iloc[0]["reward.positive_rate"])
    fraction, reliable = optimum.gain_fraction(table, float(middle["kl"]), "reward.positive_rate", gain / 2)
    assert fraction == pytest.approx(0.5) and reliable == bool(middle["reliable"])
    assert optimum.gain_fraction(table, 100.0, "reward.positive_rate", 0.1) == (None, False)


def test_a_policy_s_objective_share_by_hand() -> None:
    """One prompt, a pool of rewards 0 and 1, beta 1: the reference's J is 0.5; the optimum puts e / (1 + e) on the
    1, for J* = log((1 + e) / 2) at KL sum_i w_i log(2 w_i). A policy with that reward and KL gets its whole share, one
    with reward 0.75 at KL 0.125 (J 0.625) (0.625 - 0.5) / (J* - 0.5), one with the reference's J none."""
    pool = pd.DataFrame({"prompt": [0, 0], "sample": [0, 1], "reward": [0.0, 1.0]})
    objective = objective_module.Objective.of(pool, 1.0)
    w = math.e / (1 + math.e)
    optimal, kl = math.log((1 + math.e) / 2), w * math.log(2 * w) + (1 - w) * math.log(2 * (1 - w))
    assert (objective.reference, objective.optimal, objective.optimal_kl) == pytest.approx((0.5, optimal, kl))
    assert not objective.reliable  # two samples hold no estimate
    share = objective.share(np.array([[w, w]]), np.array([[kl - 0.1, kl + 0.1]]))
    assert share["optimum.objective_fraction"] == pytest.approx(1.0)
    assert share["optimum.objective_gain"] == share["optimum.objective_optimum_gain"] == pytest.approx(optimal - 0.5)
    assert objective.share(np.array([[0.75]]), np.array([[0.125]]))["optimum.objective_fraction"] == pytest.approx(
        0.125 / (optimal - 0.5))
    assert objective.share(np.array([[1.0, 0.5]]), np.array([[0.25, 0.25]]))["optimum.objective_fraction"] == 0.0


# --- the stage -----------------------------------------------------------------------------------------------------


@pytest.fixture
def optimum_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_gpt2_dir: Path,
                tiny_classifier_dir: Path, tokenizer_dir: Path) -> Path:
    """A folder with the tiny policy, a tiny classifier as reward, 6 eval prompts and models/policy = the reference."""
    from conftest import write_prompts

    monkeypatch.chdir(tmp_path)
    for name in ("params.yaml", "dvc.yaml"):
        shutil.copy(ROOT / name, name)
    set_params(tmp_path, **{"model.policy": str(tiny_gpt2_dir), "reward.model": str(tiny_classifier_dir),
                            "evaluate.judges": ["vader"], "evaluate.batch_size": 4, "ppo.response_min_tokens": 2,
                            "ppo.response_max_tokens": 6, "optimum.samples_per_prompt": 1})
    write_prompts(tmp_path, tokenizer_dir, n=6)
    shutil.copy("data/prompts/train.parquet", "data/prompts/eval.parquet")
    shutil.copytree(tiny_gpt2_dir, POLICY_DIR)
    return tmp_path


def test_the_pool_is_sampled_as_evaluate_samples(optimum_dir: Path) -> None:
    """With one sample per prompt, the pool is evaluate's reference run, response for response and score for score:
    same lengths, seed, batches and sampling."""
    from stages import evaluate
    from stages import optimum as stage

    stage.main()
    evaluate.main()
    pool = pd.read_parquet(OPTIMUM_POOL)
    samples = pd.read_parquet(EVAL_SAMPLES)
    assert pool["response"].tolist() == samples["response_before"].tolist()
    assert pool["reward"].tolist() == pytest.approx(samples["reward_before"].tolist(), abs=1e-6)
    assert pool["vader"].tolist() == pytest.approx(samples["judge_vader_before"].tolist(), abs=1e-6)
    reference = json.loads(EVAL_METRICS.read_text())["reward.reference_positive_rate"]
    assert pd.read_csv(OPTIMUM_CURVE).iloc[0]["reward.positive_rate"] == pytest.approx(reference)


def test_the_stage_pools_n_per_prompt_and_writes_only_a_marker_when_off(optimum_dir: Path) -> None:
    from stages import optimum as stage

    set_params(optimum_dir, **{"optimum.samples_per_prompt": 8, "optimum.prompts": 4})
    stage.main()
    pool = pd.read_parquet(OPTIMUM_POOL)
    assert len(pool) == 32 and pool.groupby("prompt").size().tolist() == [8] * 4
    assert set(pool.columns) == {"prompt", "sample", "response", "length", "reward", "vader"}
    curve = pd.read_csv(OPTIMUM_CURVE)
    assert curve.iloc[0]["kl"] == 0 and (np.diff(curve["kl"]) > 0).all()
    assert pd.read_csv(OPTIMUM_BEST_OF_N)["n"].tolist() == [1, 2, 4, 8]
    assert json.loads(OPTIMUM_METRICS.read_text())["optimum"]["samples"] == 8

    set_params(optimum_dir, **{"optimum.samples_per_prompt": 0})
    stage.main()
    assert sorted(p.name for p in OPTIMUM_POOL.parent.iterdir()) == ["DISABLED"]
    assert json.loads(OPTIMUM_METRICS.read_text()) == {"optimum": {"sampled": False}}


def test_a_pool_larger_than_memory_is_refused_before_a_model_loads(optimum_dir: Path) -> None:
    """optimum.samples_per_prompt 10**9 was killed by the OS, out of memory, without a word, once its models loaded."""
    from stages import optimum as stage

    set_params(optimum_dir, **{"optimum.samples_per_prompt": 10**9, "reward.model": "not-a-model"})  # loads last
    with pytest.raises(PipelineError, match=r"^optimum.samples_per_prompt: a pool of 6 prompts x 1000000000 samples "
                                            r"needs about \d+ GiB of memory, [\d.]+ GiB is available"):
        stage.main()


def test_evaluate_measures_the_objective_against_the_pool_and_the_reference_gains_nothing(optimum_dir: Path) -> None:
    """models/policy is the reference, answering each pooled prompt as often as the pool (POLICY_SAMPLES) with the
    pool's seed, lengths and batches: its samples are the pool's, so its objective is the reference's exactly (KL 0,
    share 0). Without a beta (the adaptive KL controller) there is no objective to measure."""
    from stages import evaluate
    from stages import optimum as stage

    n = objective_module.POLICY_SAMPLES
    set_params(optimum_dir, **{"optimum.samples_per_prompt": n, "optimum.prompts": 2, "ppo.adap_kl_ctrl": False,
                               "ppo.init_kl_coef": 0.3})
    stage.main()
    evaluate.main()
    metrics = json.loads(EVAL_METRICS.read_text())
    pool = pd.read_parquet(OPTIMUM_POOL)
    assert metrics["optimum.objective_beta"] == 0.3 and metrics["optimum.objective_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["optimum.objective_gain"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["optimum.objective_fraction"] == pytest.approx(0.0, abs=1e-5)
    expected = objective_module.Objective.of(pool, 0.3)
    assert metrics["optimum.objective_optimum_gain"] == pytest.approx(expected.optimal - expected.reference)
    assert metrics["optimum.objective_reliable"] == expected.reliable

    set_params(optimum_dir, **{"ppo.adap_kl_ctrl": True})
    evaluate.main()
    assert not any(key.startswith("optimum.objective") for key in json.loads(EVAL_METRICS.read_text()))
