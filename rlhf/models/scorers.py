"""Reward scorers behind one interface: (query texts, response texts) -> (B,) float32 scores on the CPU."""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import PretrainedConfig

from rlhf.models.loading import load_config, load_sequence_classifier, load_tokenizer
from rlhf.pipeline.errors import ModelError
from rlhf.pipeline.params import Params
from rlhf.pipeline.paths import REWARD_DIR
from rlhf.pipeline.sections import ModelParams, judge_name

REWARD = "reward"  # the training reward's name among the scorers (evaluation, the optimum)
VADER_POSITIVE = 0.05
"""VADER's own convention: a compound score above 0.05 reads as positive."""
LOGIT_POSITIVE = 0.0
"""A classifier's positive-label logit (or a reward model's scalar) above 0 counts as positive."""


def positive_threshold(scorer: str) -> float:
    """The score above which a response counts as positive: VADER's 0.05 on its compound, else a logit's 0."""
    return VADER_POSITIVE if scorer == VaderScorer.name else LOGIT_POSITIVE


class Scorer(Protocol):
    name: str

    def __call__(self, queries: list[str], responses: list[str]) -> torch.Tensor: ...


class ClassifierScorer:
    """A sequence classifier's view of query + response.

    One output (a reward model): that scalar. Several (a sentiment classifier): the raw logit of the positive label,
    as the classic recipe scores with ``lvwerra/distilbert-imdb``'s POSITIVE logit.
    """

    def __init__(self, name_or_dir: str, model_params: ModelParams, positive_label: str = "POSITIVE",
                 device: torch.device | str = "cpu", batch_size: int = 64, what: str = "reward.model") -> None:
        self.name = judge_name(name_or_dir)
        self.index = check_scorer_config(name_or_dir, model_params, positive_label, what)
        self.model = load_sequence_classifier(name_or_dir, model_params, what=what).to(device).eval()
        # the classifier's own padding side: BERT-style models read position 0, GPT-style the last real token
        self.tokenizer = load_tokenizer(name_or_dir, model_params, what=what, padding_side=None)
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device, self.batch_size = torch.device(device), batch_size

    @torch.no_grad()
    def __call__(self, queries: list[str], responses: list[str]) -> torch.Tensor:
        texts = [q + r for q, r in zip(queries, responses, strict=True)]
        scores = []
        for i in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[i: i + self.batch_size], padding=True, truncation=True,
                                   max_length=min(self.tokenizer.model_max_length, 512), return_tensors="pt")
            logits = self.model(**batch.to(self.device)).logits
            scores.append(logits[:, self.index].float().cpu())
        return torch.cat(scores)


def check_scorer_config(name: str, model_params: ModelParams, positive_label: str, what: str) -> int:
    """The output a classifier's score is read from, found from its config alone: a model that cannot be a scorer
    is refused before its weights (or any other model's) load."""
    config = load_config(name, model_params, what)
    check_is_classifier(config, name, what)
    return positive_index(config, positive_label, what)


def check_is_classifier(config: PretrainedConfig, name: str, what: str) -> None:
    """A causal LM (or any non-classifier) loads as a classifier with a random score head: refuse it, do not train
    against noise."""
    saved = config.architectures or []
    if saved and not any(arch.endswith("ForSequenceClassification") for arch in saved):
        raise ModelError(f"{what}: {name}: a {saved[0]}, not a sequence classifier (its score head would be random)")


def positive_index(config: object, positive_label: str, what: str) -> int:
    """One output: that scalar. Several: the output labelled ``positive_label`` (two unnamed labels: index 1)."""
    if config.num_labels == 1:
        return 0
    labels = {v.upper(): k for k, v in (config.id2label or {}).items()}
    if positive_label.upper() in labels:
        return labels[positive_label.upper()]
    if config.num_labels == 2:
        return 1
    raise ModelError(f"{what}: {config.num_labels} outputs and none labelled reward.positive_label="
                     f"{positive_label!r} (labels: {', '.join(labels)}); a reward is one output or a named label")


class VaderScorer:
    """The VADER lexicon's compound sentiment in [-1, 1]: a judge no pipeline stage trained."""

    name = "vader"

    def __init__(self) -> None:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        self.analyzer = SentimentIntensityAnalyzer()

    def __call__(self, queries: list[str], responses: list[str]) -> torch.Tensor:
        return torch.tensor([self.analyzer.polarity_scores(q + r)["compound"]
                             for q, r in zip(queries, responses, strict=True)], dtype=torch.float32)


def make_scorer(spec: str, params: Params, device: torch.device | str, what: str) -> Scorer:
    """'vader' or a classifier (Hub id or local dir)."""
    if spec == "vader":
        return VaderScorer()
    return ClassifierScorer(spec, params.model, params.reward.positive_label, device, what=what)


def reward_model_path(params: Params) -> tuple[str, str]:
    """(path or id, params key) of the training reward: models/reward when reward.train, else reward.model."""
    if params.reward.train:
        if not (REWARD_DIR / "config.json").exists():
            raise ModelError(f"reward.train is true but {REWARD_DIR} holds no trained model (run the reward stage)")
        return str(REWARD_DIR), str(REWARD_DIR)
    return params.reward.model, "reward.model"


def make_reward_scorer(params: Params, device: torch.device | str) -> Scorer:
    path, what = reward_model_path(params)
    return make_scorer(path, params, device, what)
