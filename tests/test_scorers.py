"""Reward scorers: the positive label's raw logit, a reward model's scalar, VADER's compound, batching, names."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from conftest import build_tiny_classifier
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlhf.models.scorers import ClassifierScorer, VaderScorer, make_reward_scorer, make_scorer
from rlhf.pipeline.errors import ModelError
from rlhf.pipeline.params import defaults, reward_model
from rlhf.pipeline.sections import judge_name

QUERIES = ["The movie was", "I think", "Awful", "A"]
RESPONSES = [" great and moving.", " it was dull", " and boring, a mess", " superb film with a charming plot"]


def reference_logits(model_dir: Path) -> torch.Tensor:
    """The classifier's logits for each query + response on its own (no padding at all)."""
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        return torch.cat([model(**tokenizer(q + r, return_tensors="pt")).logits
                          for q, r in zip(QUERIES, RESPONSES, strict=True)])


@pytest.mark.parametrize("batch_size", [1, 3])
def test_positive_logit_of_a_sentiment_classifier(tiny_classifier_dir: Path, batch_size: int) -> None:
    scorer = ClassifierScorer(str(tiny_classifier_dir), defaults().model, batch_size=batch_size)
    expected = reference_logits(tiny_classifier_dir)[:, 1]  # id2label {0: NEGATIVE, 1: POSITIVE}
    assert torch.allclose(scorer(QUERIES, RESPONSES), expected, atol=1e-5)


def test_a_stage_s_batch_size_reaches_the_reward_model_and_the_judges(tiny_classifier_dir: Path) -> None:
    """evaluate scores evaluate.batch_size texts a forward pass (on a GPU: few, large launches), the same scores."""
    model, label = defaults().model, defaults().reward.positive_label
    reward = make_reward_scorer([], str(tiny_classifier_dir), "reward.model", label, model, "cpu", batch_size=3)
    judge = make_scorer(str(tiny_classifier_dir), model, label, "cpu", "evaluate.judges[0]", batch_size=3)
    rows = []
    reward.model.register_forward_hook(lambda module, args, kwargs, out: rows.append(len(kwargs["input_ids"])),
                                       with_kwargs=True)
    scores = reward(QUERIES, RESPONSES)
    assert rows == [3, 1] and judge.batch_size == 3
    assert torch.allclose(scores, reference_logits(tiny_classifier_dir)[:, 1], atol=1e-5)


def test_positive_label_is_looked_up_by_name(tmp_path: Path, tokenizer_dir: Path) -> None:
    flipped = build_tiny_classifier(tmp_path / "flipped", tokenizer_dir)
    config = AutoModelForSequenceClassification.from_pretrained(flipped).config
    config.id2label, config.label2id = {0: "POSITIVE", 1: "NEGATIVE"}, {"POSITIVE": 0, "NEGATIVE": 1}
    config.save_pretrained(flipped)
    scorer = ClassifierScorer(str(flipped), defaults().model)
    assert torch.allclose(scorer(QUERIES, RESPONSES), reference_logits(flipped)[:, 0], atol=1e-5)


def test_reward_model_scalar(tmp_path: Path, tokenizer_dir: Path) -> None:
    rm = build_tiny_classifier(tmp_path / "rm", tokenizer_dir, num_labels=1)
    scorer = ClassifierScorer(str(rm), defaults().model, batch_size=2)
    assert torch.allclose(scorer(QUERIES, RESPONSES), reference_logits(rm)[:, 0], atol=1e-5)


def test_vader_compound_and_its_sign() -> None:
    responses = ["What a wonderful, beautiful film. I loved it.", "Awful, boring, a terrible mess."]
    scores = VaderScorer()(["", ""], responses)
    assert scores[0] > 0.5 and scores[1] < -0.5 and scores.dtype == torch.float32


def test_judge_names_are_metric_friendly() -> None:
    assert judge_name("vader") == "vader"
    assert judge_name("lvwerra/distilbert-imdb") == "distilbert-imdb"
    assert judge_name("../models/my judge v2/") == "my_judge_v2"


def test_trained_reward_model_must_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    params = defaults().model_copy(update={"reward": defaults().reward.model_copy(update={"train": True})})
    with pytest.raises(ModelError, match=r"^reward.train is true but models/reward holds no trained model"):
        reward_model(params)


def relabelled(tmp_path: Path, tokenizer_dir: Path, labels: dict[int, str]) -> Path:
    folder = build_tiny_classifier(tmp_path / "relabelled", tokenizer_dir)
    config = AutoModelForSequenceClassification.from_pretrained(folder).config
    config.id2label, config.label2id = labels, {name: i for i, name in labels.items()}
    config.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(("labels", "positive"), [
    ({0: "neg", 1: "pos"}, "POSITIVE"),
    ({0: "NEGATIVE", 1: "POSITIVE"}, "POSITVE"),
], ids=["pos-neg", "typo"])
def test_named_labels_without_the_positive_one_are_refused(labels: dict[int, str], positive: str, tmp_path: Path,
                                                           tokenizer_dir: Path) -> None:
    """Reading index 1 of a model whose labels are named otherwise trained PPO towards whatever index 1 means (the
    negative label, for a neg/pos model read the other way round): refused from the config, naming its labels."""
    folder = relabelled(tmp_path, tokenizer_dir, labels)
    names = ", ".join(labels.values())
    with pytest.raises(ModelError, match=rf"^reward.model: 2 outputs labelled {names}, none of them "
                                         rf"reward.positive_label='{positive}': set it to the positive label"):
        ClassifierScorer(str(folder), defaults().model, positive)


def test_unnamed_labels_read_index_one(tmp_path: Path, tokenizer_dir: Path) -> None:
    folder = relabelled(tmp_path, tokenizer_dir, {0: "LABEL_0", 1: "LABEL_1"})
    scorer = ClassifierScorer(str(folder), defaults().model)
    assert torch.allclose(scorer(QUERIES, RESPONSES), reference_logits(folder)[:, 1], atol=1e-5)


def test_a_classifier_with_too_few_positions_is_refused_from_its_config(tmp_path: Path, tokenizer_dir: Path) -> None:
    """Scored texts past its positions raised IndexError after all the sampling: refused before its weights load,
    and texts beyond its positions are cut to them, not to the tokenizer's longer limit."""
    short = build_tiny_classifier(tmp_path / "short", tokenizer_dir)
    config = AutoModelForSequenceClassification.from_pretrained(short).config
    config.n_positions = 8
    config.save_pretrained(short)
    tensors = load_file(short / "model.safetensors")
    tensors = {key: value[:8].clone() if key.endswith("wpe.weight") else value for key, value in tensors.items()}
    save_file(tensors, short / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelError, match=rf"^judge: {re.escape(str(short))} reads 8 positions, fewer than the longest "
                                         r"prompt \+ ppo.response_max_tokens \(20 tokens\)"):
        ClassifierScorer(str(short), defaults().model, what="judge", max_tokens=20)
    scores = ClassifierScorer(str(short), defaults().model)(["a long prompt " * 10], [" and its response"])
    assert torch.isfinite(scores).all()
