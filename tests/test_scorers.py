"""Reward scorers: the positive label's raw logit, a reward model's scalar, VADER's compound, batching, names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import build_tiny_classifier
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlhf.models.scorers import ClassifierScorer, VaderScorer, judge_name, make_reward_scorer
from rlhf.pipeline.errors import ModelError
from rlhf.pipeline.params import defaults

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
        make_reward_scorer(params, "cpu")
