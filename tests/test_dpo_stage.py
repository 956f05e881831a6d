"""The dpo, ref_logprobs and sample_pairs stages: DPO through the stage learns its pairs and resumes after a kill to
the same curves and weights; the one-line errors, stale reference log-probs included; and through DVC, `method: dpo`
with sampled pairs trains without PPO, evaluate reads models/dpo, the sampled pairs are ranked as the scorer ranks
them and cached, the reference's log-probs are kept across a beta change, and a switch reruns exactly the stages
that read it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import ALL_STAGES, ROOT, dvc, set_params
from helpers import interrupted_at_call, moved_weights, projections, ran_stages, signal_pairs
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlhf.data.prompts import Prompts
from rlhf.models.loading import initial_tokenizer
from rlhf.models.scorers import make_reward_scorer
from rlhf.pipeline.errors import DataError
from rlhf.pipeline.io import DISABLED_MARKER
from rlhf.pipeline.params import initial_policy, load_params, reward_model
from rlhf.pipeline.paths import (
    DPO_DIR,
    POLICY_DIR,
    REF_LOGPROBS_DIR,
    SAMPLED_PAIRS_DIR,
    SAMPLED_TEST_PAIRS,
    SAMPLED_TRAIN_PAIRS,
    TEST_PAIRS,
    TRAIN_PAIRS,
)
from rlhf.train import dpo as dpo_library
from stages import dpo as dpo_stage
from stages import ref_logprobs as ref_stage
from stages import sample_pairs as sample_pairs_stage
from stages.dpo import DPO_CURVES, DPO_METRICS

TINY_DPO = {"dpo.batch_size": 8, "dpo.learning_rate": 1e-2, "dpo.max_length": 24, "dpo.warmup_steps": 2,
            "dpo.checkpoint_every": 2}  # 64 pairs: 8 steps, a held-out evaluation after each


@pytest.fixture
def dpo_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_gpt2_dir: Path) -> Path:
    """A folder with params.yaml (method dpo, the tiny policy), prepare's pairs (64 to train on, 32 held out) and the
    reference's log-probs of them."""
    monkeypatch.chdir(tmp_path)
    for name in ("params.yaml", "dvc.yaml"):
        shutil.copy(ROOT / name, name)
    # fp32: under bf16 autocast (model.precision auto on a bf16 CPU) a batch and a lone row round differently, by more
    # than the row-for-row check below allows; precision itself is tested in test_training
    set_params(tmp_path, **{"method": "dpo", "model.policy": str(tiny_gpt2_dir), "model.precision": "fp32",
                            **TINY_DPO})
    TRAIN_PAIRS.parent.mkdir(parents=True)
    signal_pairs(64, 0).to_parquet(TRAIN_PAIRS)
    signal_pairs(32, 1).to_parquet(TEST_PAIRS)
    ref_stage.main()
    return tmp_path


def curve(name: str) -> list[tuple[int, float]]:
    """(step, value) rows of one DVCLive curve in metrics/dpo."""
    frame = pd.read_csv(DPO_CURVES / "plots" / "metrics" / f"{name}.tsv", sep="\t")
    return list(zip(frame["step"], frame[name.rsplit("/", 1)[-1]], strict=True))


@pytest.mark.slow
def test_the_stage_learns_its_pairs_and_a_killed_run_resumes_to_the_same_outputs(dpo_dir: Path,
                                                                                 tiny_gpt2_dir: Path) -> None:
    dpo_stage.main()
    metrics = json.loads(DPO_METRICS.read_text())["dpo"]
    assert metrics["trained"] and metrics["steps"] == 8 and metrics["train_pairs"] == 64
    assert metrics["eval/rewards/accuracies"] >= 0.9 and metrics["eval/rewards/margins"] > 0
    accuracy, loss = curve("eval/rewards/accuracies"), curve("train/loss")
    assert [step for step, _ in accuracy] == list(range(8)) and accuracy[-1][1] == metrics["eval/rewards/accuracies"]
    assert sum(value for _, value in loss[-4:]) / 4 < loss[0][1]
    assert curve("train/logratios/chosen")[-1][1] > curve("train/logratios/rejected")[-1][1]
    trained = AutoModelForCausalLM.from_pretrained(DPO_DIR)
    initial = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir)
    assert not torch.equal(trained.lm_head.weight, initial.lm_head.weight)
    assert [p.name for p in Path("data/checkpoints/dpo").glob("step-*")] == ["step-000007"]  # its last, kept
    assert_a_killed_run_resumes_to(metrics, trained)


def assert_a_killed_run_resumes_to(metrics: dict, trained: torch.nn.Module) -> None:
    """A rerun of the stage killed in its step 4 (by Ctrl-C) keeps the previous outputs and its step-3 checkpoint,
    from which a rerun ends with ``metrics``, the same curves and the ``trained`` weights."""
    shutil.rmtree("data/checkpoints/dpo")  # the finished run's: the same run again would end at once
    whole = {name: curve(name) for name in ("train/loss", "eval/rewards/accuracies", "eval/rewards/margins")}
    # two calls a step (its batch, the held-out set): the 9th is in step 4
    with interrupted_at_call(dpo_library, "pair_losses", 9), pytest.raises(KeyboardInterrupt):
        dpo_stage.main()
    assert [p.name for p in Path("data/checkpoints/dpo").glob("step-*")] == ["step-000003"]
    assert json.loads(DPO_METRICS.read_text())["dpo"] == metrics, "the killed run left the previous outputs"
    dpo_stage.main()
    assert {name: curve(name) for name in whole} == whole
    resumed = AutoModelForCausalLM.from_pretrained(DPO_DIR)
    for a, b in zip(resumed.parameters(), trained.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_with_lora_the_stage_trains_adapters_against_the_initial_policy_and_saves_the_merged_model(
        dpo_dir: Path, adaptable_gpt2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    set_params(dpo_dir, **{"model.policy": str(adaptable_gpt2_dir), "model.lora.r": 4})
    ref_stage.main()  # the reference's log-probs: the initial policy's, with no adapters
    checkpoints = Path("data/checkpoints/dpo")
    calls, real = 0, dpo_library.pair_losses

    def look_at_step_1(*args: object, **kwargs: object) -> object:  # the step-1 checkpoint, before it is replaced
        nonlocal calls
        calls += 1
        if calls == 5:
            weights = load_file(checkpoints / "step-000001" / "model.safetensors")
            assert weights and all(".lora_A." in name or ".lora_B." in name for name in weights), sorted(weights)
        return real(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(dpo_library, "pair_losses", look_at_step_1)
        dpo_stage.main()
    metrics = json.loads(DPO_METRICS.read_text())["dpo"]
    assert metrics["eval/rewards/accuracies"] >= 0.9 and metrics["eval/rewards/margins"] > 0
    trained = AutoModelForCausalLM.from_pretrained(DPO_DIR)
    initial = AutoModelForCausalLM.from_pretrained(adaptable_gpt2_dir)
    assert trained.state_dict().keys() == initial.state_dict().keys()
    assert moved_weights(trained, initial) == projections(suffix=".weight")
    assert_a_killed_run_resumes_to(metrics, trained)


def test_bad_pairs_fail_in_one_line_before_a_model_loads(dpo_dir: Path) -> None:
    set_params(dpo_dir, **{"dpo.batch_size": 100, "model.policy": "./no-model-here-is-loaded-first"})
    Path("no-model-here-is-loaded-first").mkdir()
    with pytest.raises(DataError, match=r"^data/pairs/train\.parquet: 64 pairs, fewer than dpo\.batch_size=100$"):
        dpo_stage.main()
    set_params(dpo_dir, **{"dpo.pairs": "sampled"})
    SAMPLED_PAIRS_DIR.mkdir(parents=True)
    (SAMPLED_PAIRS_DIR / DISABLED_MARKER).write_text("off\n")
    with pytest.raises(DataError, match=r"^data/sampled_pairs: holds no pairs \(run the sample_pairs stage"):
        dpo_stage.main()
    assert not DPO_DIR.exists() and not DPO_METRICS.exists()


def test_the_reference_log_probs_are_the_references_row_for_row_and_read_only_for_what_they_were_computed_for(
        dpo_dir: Path, tiny_gpt2_dir: Path) -> None:
    params = load_params()
    reference = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir)
    tokenizer = initial_tokenizer(initial_policy(params), params.model)
    for path, ref in zip((TRAIN_PAIRS, TEST_PAIRS), dpo_library.read_reference(dpo_library.reference_key(params)),
                         strict=True):
        pairs = dpo_library.encode_pairs(pd.read_parquet(path), tokenizer, params.dpo.max_length, str(path))
        one_by_one = torch.tensor([[dpo_library.sequence_logprobs(
            reference, dpo_library.pair_samples(pairs, [i], tokenizer, torch.device("cpu")), "fp32")[side].item()
            for side in (0, 1)] for i in range(len(pairs))])
        assert ref.shape == (len(pairs), 2)
        torch.testing.assert_close(ref, one_by_one, atol=1e-4, rtol=0)

    set_params(dpo_dir, **{"dpo.max_length": 20, "model.policy": "./no-model-here-is-loaded-first"})
    Path("no-model-here-is-loaded-first").mkdir()
    with pytest.raises(DataError, match=r"^data/ref_logprobs/train\.parquet: the log-probs of other pairs, another "
                                        r"reference or another dpo\.max_length \(run the ref_logprobs stage again"):
        dpo_stage.main()
    set_params(dpo_dir, **{"method": "ppo"})
    ref_stage.main()
    assert [p.name for p in REF_LOGPROBS_DIR.iterdir()] == [DISABLED_MARKER]
    set_params(dpo_dir, **{"method": "dpo"})
    with pytest.raises(DataError, match=r"^data/ref_logprobs: holds no reference log-probs \(run the ref_logprobs "):
        dpo_stage.main()
    assert not DPO_DIR.exists() and not DPO_METRICS.exists()


def test_more_prompts_to_sample_than_there_are_is_refused() -> None:
    """dpo.sample_prompts beyond the prompts file was capped with a log line: the params would name prompts the
    pairs do not come from."""
    prompts = Prompts([[1, 2]] * 5, ["a"] * 5)
    with pytest.raises(DataError, match=r"^dpo.sample_prompts: 100 prompts asked, but data/prompts/train.parquet "
                                        r"holds 5$"):
        sample_pairs_stage.split(prompts, 100)
    assert sample_pairs_stage.split(prompts, 5) == ([0, 1, 2, 3], [4])


def test_another_method_writes_only_the_marker(dpo_dir: Path) -> None:
    set_params(dpo_dir, **{"method": "ppo"})
    dpo_stage.main()
    assert [p.name for p in DPO_DIR.iterdir()] == [DISABLED_MARKER]
    assert json.loads(DPO_METRICS.read_text()) == {"dpo": {"trained": False}}


@pytest.mark.slow
def test_method_dpo_on_sampled_pairs_through_dvc(project: Path, imdb_dir: Path, tiny_gpt2_dir: Path,
                                                 tiny_classifier_dir: Path) -> None:
    set_params(project, **{
        "data.source": str(imdb_dir), "model.policy": str(tiny_gpt2_dir), "reward.model": str(tiny_classifier_dir),
        "prepare.train_prompts": 20, "prepare.eval_prompts": 8, "prepare.train_pairs": 8, "prepare.test_pairs": 4,
        "ppo.response_min_tokens": 2, "ppo.response_max_tokens": 6, "evaluate.judges": ["vader"],
        "evaluate.batch_size": 8, "evaluate.examples": 2, "method": "dpo", "dpo.pairs": "sampled", **TINY_DPO,
        "dpo.checkpoint_every": 0})
    assert ran_stages(dvc(project, "repro")) == ALL_STAGES
    assert [p.name for p in (project / POLICY_DIR).iterdir()] == [DISABLED_MARKER], "ppo did not train"
    assert json.loads((project / DPO_METRICS).read_text())["dpo"]["trained"]
    assert json.loads((project / "metrics/eval.json").read_text())["kl.full_mean"] > 0, "evaluate read models/dpo"

    # every pair of one prompt's 4 completions with distinct scores, ranked as the reward scorer ranks them
    params = load_params(path=project / "params.yaml")  # no reward functions: the model alone
    scorer = make_reward_scorer([], *reward_model(params), params.reward.positive_label, params.model, "cpu")
    train, test = (pd.read_parquet(project / path) for path in (SAMPLED_TRAIN_PAIRS, SAMPLED_TEST_PAIRS))
    assert train["prompt"].nunique() == 18 and test["prompt"].nunique() == 2
    assert train.groupby("prompt").size().max() <= 6
    for side in ("chosen", "rejected"):
        rescored = scorer(train["prompt"].tolist(), train[side].tolist())
        assert rescored.tolist() == pytest.approx(train[f"{side}_score"].tolist(), abs=1e-5)
    assert (train["chosen_score"] > train["rejected_score"]).all()

    assert ran_stages(dvc(project, "repro")) == set(), "nothing is sampled or trained again"
    # evaluate (and dpo, after new pairs) follow once the outputs they read change
    # the reference's log-probs are kept; evaluate measures the objective at dpo.beta
    for updates, changed in [({"dpo.beta": 0.5}, {"dpo", "evaluate"}),
                             ({"dpo.max_length": 20}, {"ref_logprobs", "dpo"}),
                             ({"dpo.samples_per_prompt": 3}, {"sample_pairs"}),
                             ({"method": "ppo"}, {"ppo", "sample_pairs", "ref_logprobs", "dpo", "evaluate"}),
                             ({"method": "best_of_n"}, {"ppo", "sample_pairs", "ref_logprobs", "dpo", "evaluate"})]:
        before = (project / "params.yaml").read_text()
        set_params(project, **updates)
        status = json.loads(dvc(project, "status", "--json").stdout)
        assert set(status) == changed, (updates, status)
        (project / "params.yaml").write_text(before)
