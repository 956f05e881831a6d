"""The evaluate stage on tiny local models: same prompts, seeds and lengths for both models, the outputs, bad input."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import NEUTRAL_WORDS, POSITIVE_WORDS, ROOT, build_tiny_gpt2, set_params
from helpers import eos_only_gpt2
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf.models.rollout import response_lengths
from rlhf.models.scorers import ClassifierScorer, VaderScorer
from rlhf.pipeline.errors import DataError, ModelError, ParamsError
from rlhf.pipeline.params import defaults
from rlhf.pipeline.paths import DPO_DIR, EVAL_PROMPTS, POLICY_DIR
from rlhf.pipeline.sections import judge_name
from stages.evaluate import EVAL_HISTOGRAM, EVAL_METRICS, EVAL_REPORT, EVAL_SAMPLES, main

N_PROMPTS = 6


@pytest.fixture
def stage_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_gpt2_dir: Path,
              tiny_classifier_dir: Path) -> Path:
    """A folder with params.yaml (tiny models), data/prompts/eval.parquet and models/policy = the initial policy."""
    monkeypatch.chdir(tmp_path)
    for name in ("params.yaml", "dvc.yaml"):
        shutil.copy(ROOT / name, name)
    set_params(tmp_path, **{
        "model.policy": str(tiny_gpt2_dir), "reward.model": str(tiny_classifier_dir),
        "evaluate.judges": ["vader", str(tiny_classifier_dir)], "evaluate.batch_size": 4, "evaluate.examples": 3,
        "ppo.response_min_tokens": 2, "ppo.response_max_tokens": 6,
    })
    tokenizer = AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    queries = [f"{NEUTRAL_WORDS[i].capitalize()} {POSITIVE_WORDS[i]} {NEUTRAL_WORDS[i + 1]}" for i in range(N_PROMPTS)]
    EVAL_PROMPTS.parent.mkdir(parents=True)
    pd.DataFrame({"query": queries, "input_ids": [tokenizer(q)["input_ids"] for q in queries],
                  "review_id": [f"r{i}" for i in range(N_PROMPTS)], "label": [1] * N_PROMPTS}).to_parquet(EVAL_PROMPTS)
    shutil.copytree(tiny_gpt2_dir, POLICY_DIR)
    return tmp_path


def test_a_policy_equal_to_the_reference_samples_the_same_responses_with_zero_kl(
        stage_dir: Path, tiny_classifier_dir: Path) -> None:
    main()

    metrics = json.loads(EVAL_METRICS.read_text())
    assert list(metrics) == sorted(metrics)
    clf = judge_name(str(tiny_classifier_dir))
    for key in ["reward.policy_mean", "reward.policy_positive_rate", "reward.reference_mean",
                "reward.reference_positive_rate", "kl.mean", "kl.full_mean", "kl.p90",
                f"judge.{clf}.policy_positive_rate", "judge.vader.reference_positive_rate", "fluency.ref_perplexity",
                "diversity.distinct2"]:
        assert isinstance(metrics[key], float), key
    assert all(0 <= value <= 1 for key, value in metrics.items() if key.endswith("positive_rate"))
    assert all(abs(metrics[key]) < 1e-4 for key in ("kl.mean", "kl.full_mean", "kl.p90"))  # the reference's own
    assert 0 < metrics["diversity.distinct2"] <= 1
    assert not any(key.endswith("_greedy") or "_greedy_" in key for key in metrics)

    samples = pd.read_parquet(EVAL_SAMPLES)
    assert len(samples) == N_PROMPTS
    # same prompts, seed and per-prompt lengths: an unchanged policy answers exactly as the reference did
    assert (samples["response_before"] == samples["response_after"]).all()
    for score in ["reward", "judge_vader", f"judge_{clf}"]:
        assert samples[f"{score}_before"].tolist() == samples[f"{score}_after"].tolist()
    assert samples["kl"].abs().max() < 1e-4 and samples["kl_full"].abs().max() < 1e-4
    assert metrics["reward.policy_mean"] == metrics["reward.reference_mean"]
    assert metrics["fluency.ref_perplexity"] == metrics["fluency.reference_ref_perplexity"] > 1

    histogram = pd.read_csv(EVAL_HISTOGRAM)
    assert histogram["before"].sum() == histogram["after"].sum() == N_PROMPTS
    report = EVAL_REPORT.read_text()
    assert f"| {samples['query'][0]} | " in report and f"| {samples['query'][3]} | " not in report  # 3 examples
    assert f"| {clf} |" in report and "| vader |" in report


def test_a_changed_policy_has_positive_kl_and_greedy_runs_decode_greedily(
        stage_dir: Path, tokenizer_dir: Path) -> None:
    shutil.rmtree(POLICY_DIR)
    build_tiny_gpt2(POLICY_DIR, tokenizer_dir, seed=1)
    set_params(stage_dir, **{"evaluate.greedy": True})
    main()

    metrics = json.loads(EVAL_METRICS.read_text())
    samples = pd.read_parquet(EVAL_SAMPLES)
    assert metrics["kl.full_mean"] > 0 and (samples["kl_full"] > 0).all()
    assert {"reward.policy_greedy_mean", "reward.reference_greedy_positive_rate",
            "judge.vader.policy_greedy_positive_rate"} <= set(metrics)
    assert {"response_before_greedy", "response_after_greedy", "reward_after_greedy"} <= set(samples.columns)

    # the greedy pass is plain greedy decoding: Hugging Face's own do_sample=False gives the same text
    lengths = response_lengths(N_PROMPTS, 2, 6, torch.Generator().manual_seed(0))
    tokenizer = AutoTokenizer.from_pretrained(POLICY_DIR)
    policy = AutoModelForCausalLM.from_pretrained(POLICY_DIR)
    prompts = pd.read_parquet(EVAL_PROMPTS)
    for i in range(N_PROMPTS):
        out = policy.generate(torch.tensor([list(prompts["input_ids"][i])]), do_sample=False,
                              max_new_tokens=lengths[i], pad_token_id=tokenizer.eos_token_id)
        query_length = len(prompts["input_ids"][i])
        expected = tokenizer.decode(out[0, query_length:], skip_special_tokens=True)
        assert samples["response_after_greedy"][i] == expected, i


def test_a_policy_whose_every_response_is_empty_is_said_once(stage_dir: Path, tiny_gpt2_dir: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A policy that answers EOS at once: every response empty, which evaluate said nothing of."""
    shutil.rmtree(POLICY_DIR)
    eos_only_gpt2(tiny_gpt2_dir, POLICY_DIR)
    caplog.set_level("INFO")
    main()
    assert (pd.read_parquet(EVAL_SAMPLES)["response_after"] == "").all()
    said = [r.message for r in caplog.records if "every response" in r.message]
    assert len(said) == 1 and said[0].startswith("evaluate: every response of the policy run (after) is empty"), said


def outputs_untouched() -> bool:
    return EVAL_METRICS.read_text() == "previous run" and not EVAL_SAMPLES.exists() and not EVAL_REPORT.exists()


@pytest.fixture
def previous_metrics(stage_dir: Path) -> None:
    EVAL_METRICS.parent.mkdir(parents=True, exist_ok=True)
    EVAL_METRICS.write_text("previous run")


def test_a_judge_that_cannot_load_fails_first_naming_its_key(stage_dir: Path, previous_metrics: None) -> None:
    Path("not-a-model").mkdir()
    set_params(stage_dir, **{"evaluate.judges": ["vader", "not-a-model"]})
    with pytest.raises(ModelError, match=r"^evaluate\.judges\[1\]: not-a-model: not a model folder"):
        main()
    assert outputs_untouched()


def test_a_hub_judge_that_cannot_be_fetched_fails_naming_its_key(stage_dir: Path, previous_metrics: None) -> None:
    set_params(stage_dir, **{"evaluate.judges": ["nobody/no-such-classifier"]})
    with pytest.raises(ModelError, match=r"^evaluate\.judges\[0\]: nobody/no-such-classifier: no such local path, "
                                          r"and not reachable as a Hub id"):
        main()
    assert outputs_untouched()


def test_two_judges_with_the_same_name_fail(stage_dir: Path, tiny_classifier_dir: Path) -> None:
    copy = stage_dir / "other" / tiny_classifier_dir.name
    shutil.copytree(tiny_classifier_dir, copy)
    set_params(stage_dir, **{"evaluate.judges": [str(tiny_classifier_dir), str(copy)]})
    with pytest.raises(ParamsError, match=r"evaluate\.judges\[1\]: judge name .* repeats evaluate\.judges\[0\]"):
        main()


def test_missing_prompts_fail_naming_the_file(stage_dir: Path, previous_metrics: None) -> None:
    EVAL_PROMPTS.unlink()
    with pytest.raises(DataError, match=r"^data/prompts/eval\.parquet: missing \(run the prepare stage first\)"):
        main()
    assert outputs_untouched()


def test_missing_policy_fails_naming_it(stage_dir: Path, previous_metrics: None) -> None:
    shutil.rmtree(POLICY_DIR)
    with pytest.raises(ModelError, match=r"^models/policy: no trained policy here \(run the ppo stage\)"):
        main()
    assert outputs_untouched()


def test_eval_prompts_from_another_tokenizer_fail_naming_the_row(stage_dir: Path, previous_metrics: None) -> None:
    prompts = pd.read_parquet(EVAL_PROMPTS)
    prompts.at[2, "input_ids"] = [5, 9999]
    prompts.to_parquet(EVAL_PROMPTS)
    with pytest.raises(DataError, match=r"^data/prompts/eval\.parquet: row 2: token id 9999 outside the tokenizer's "
                                        r"400 ids"):
        main()
    assert outputs_untouched()


def test_method_dpo_evaluates_models_dpo(stage_dir: Path, tiny_gpt2_dir: Path, tokenizer_dir: Path) -> None:
    shutil.rmtree(POLICY_DIR)
    build_tiny_gpt2(POLICY_DIR, tokenizer_dir, seed=1)  # a PPO policy unlike the reference: evaluate must not read it
    shutil.copytree(tiny_gpt2_dir, DPO_DIR)
    set_params(stage_dir, **{"method": "dpo"})
    main()
    metrics = json.loads(EVAL_METRICS.read_text())
    assert metrics["kl.full_mean"] < 1e-4 and metrics["reward.policy_mean"] == metrics["reward.reference_mean"]
    assert "after (DPO policy)" in EVAL_REPORT.read_text()

    shutil.rmtree(DPO_DIR)
    with pytest.raises(ModelError, match=r"^models/dpo: no trained policy here \(run the dpo stage\)"):
        main()


def best_of(stage_dir: Path, n: int) -> tuple[dict[str, float], pd.DataFrame]:
    set_params(stage_dir, **{"method": "best_of_n", "evaluate.best_of_n": n})
    main()
    return json.loads(EVAL_METRICS.read_text()), pd.read_parquet(EVAL_SAMPLES)


def test_best_of_one_is_the_reference(stage_dir: Path) -> None:
    shutil.rmtree(POLICY_DIR)  # best-of-N trains no policy and reads none
    metrics, samples = best_of(stage_dir, 1)
    assert (samples["response_after"] == samples["response_before"]).all()
    for key, value in metrics.items():
        if ".policy_" in key and "_policy_" not in key:
            assert value == metrics[key.replace(".policy_", ".reference_")], key
    assert metrics["fluency.ref_perplexity"] == metrics["fluency.reference_ref_perplexity"]
    assert metrics["diversity.distinct2"] == metrics["diversity.reference_distinct2"]
    assert metrics["kl.best_of_n_bound"] == 0 and "kl.mean" not in metrics and "kl" not in samples


def test_best_of_n_keeps_the_reward_s_best_and_every_judge_scores_it(stage_dir: Path,
                                                                     tiny_classifier_dir: Path) -> None:
    shutil.rmtree(POLICY_DIR)
    _, one = best_of(stage_dir, 1)
    metrics, four = best_of(stage_dir, 4)
    assert (four["query"] == one["query"]).all() and (four["response_before"] == one["response_before"]).all()
    assert (four["reward_after"] >= one["reward_after"]).all() and (four["reward_after"] > one["reward_after"]).any()
    assert metrics["kl.best_of_n_bound"] == pytest.approx(math.log(4) - 3 / 4)
    assert metrics["reward.policy_mean"] > metrics["reward.reference_mean"]
    # the judges score the chosen responses, not the reference's
    vader = VaderScorer()(four["query"].tolist(), four["response_after"].tolist())
    assert four["judge_vader_after"].tolist() == pytest.approx(vader.tolist())
    clf = ClassifierScorer(str(tiny_classifier_dir), defaults().model)
    chosen = clf(four["query"].tolist(), four["response_after"].tolist())
    assert four[f"judge_{judge_name(str(tiny_classifier_dir))}_after"].tolist() == pytest.approx(chosen.tolist(),
                                                                                                   abs=1e-5)
    report = EVAL_REPORT.read_text()
    assert "after (best of 4 reference samples)" in report and "the analytic bound log N - (N-1)/N" in report
