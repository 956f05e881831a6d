"""Reward scorers behind one interface: (query texts, response texts[, the responses' token ids]) -> (B,) float32
scores on the CPU. Only the reward functions read the ids (TRL's ``completion_ids``); the models score the texts."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Protocol

import torch
from transformers import PretrainedConfig

from rlhf.models.loading import context_size, load_config, load_sequence_classifier, load_tokenizer
from rlhf.models.reward_functions import RewardFunction
from rlhf.pipeline.errors import ModelError
from rlhf.pipeline.sections import ModelParams

REWARD = "reward"  # the training reward's name among the scorers (evaluation, the optimum)
VADER_POSITIVE = 0.05
"""VADER's own convention: a compound score above 0.05 reads as positive."""
LOGIT_POSITIVE = 0.0
"""A classifier's positive-label logit (or a reward model's scalar) above 0 counts as positive."""
BATCH_SIZE = 64
"""Texts per forward pass of a classifier scorer, unless its stage says otherwise (evaluate: evaluate.batch_size)."""


def positive_threshold(scorer: str) -> float:
    """The score above which a response counts as positive: VADER's 0.05 on its compound, else a logit's 0."""
    return VADER_POSITIVE if scorer == VaderScorer.name else LOGIT_POSITIVE


ResponseIds = Sequence[Sequence[int]] | None  # each response's token ids (EOS included), where the caller has them


class Scorer(Protocol):
    name: str

    def __call__(self, queries: list[str], responses: list[str], response_ids: ResponseIds = None) -> torch.Tensor: ...


class ClassifierScorer:
    """A sequence classifier's view of query + response.

    One output (a reward model): that scalar. Several (a sentiment classifier): the raw logit of the positive label,
    as the classic recipe scores with ``lvwerra/distilbert-imdb``'s POSITIVE logit.
    """

    def __init__(self, name_or_dir: str, model_params: ModelParams, positive_label: str = "POSITIVE",
                 device: torch.device | str = "cpu", batch_size: int = BATCH_SIZE, what: str = "reward.model",
                 max_tokens: int | None = None) -> None:
        self.name = what  # the params key it comes from
        self.index = check_scorer_config(name_or_dir, model_params, positive_label, what, max_tokens)
        self.model = load_sequence_classifier(name_or_dir, model_params, what=what).to(device).eval()
        # the classifier's own padding side: BERT-style models read position 0, GPT-style the last real token
        self.tokenizer = load_tokenizer(name_or_dir, model_params, what=what, padding_side=None)
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device, self.batch_size = torch.device(device), batch_size

    @torch.no_grad()
    def __call__(self, queries: list[str], responses: list[str], response_ids: ResponseIds = None) -> torch.Tensor:
        texts = [q + r for q, r in zip(queries, responses, strict=True)]
        scores = []
        for i in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[i: i + self.batch_size], padding=True, truncation=True, return_tensors="pt",
                                   max_length=min(self.tokenizer.model_max_length, context_size(self.model), 512))
            logits = self.model(**batch.to(self.device)).logits
            scores.append(logits[:, self.index].float().cpu())
        return torch.cat(scores)


def check_scorer_config(name: str, model_params: ModelParams, positive_label: str, what: str,
                        max_tokens: int | None = None) -> int:
    """The output a classifier's score is read from, found from its config alone: a model that cannot be a scorer
    is refused before its weights (or any other model's) load, as is one whose positions cannot hold ``max_tokens``
    (the longest prompt plus response it will score)."""
    config = load_config(name, model_params, what)
    check_is_classifier(config, name, what)
    positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if max_tokens is not None and positions is not None and positions < max_tokens:
        raise ModelError(f"{what}: {name} reads {positions} positions, fewer than the longest prompt + "
                         f"ppo.response_max_tokens ({max_tokens} tokens): it would score cut texts")
    return positive_index(config, positive_label, what)


def check_is_classifier(config: PretrainedConfig, name: str, what: str) -> None:
    """A causal LM (or any non-classifier) loads as a classifier with a random score head: refuse it, do not train
    against noise."""
    saved = config.architectures or []
    if saved and not any(arch.endswith("ForSequenceClassification") for arch in saved):
        raise ModelError(f"{what}: {name}: a {saved[0]}, not a sequence classifier (its score head would be random)")


def positive_index(config: object, positive_label: str, what: str) -> int:
    """One output: that scalar. Several: the output labelled ``positive_label``; two whose labels are unnamed
    (transformers' LABEL_0, LABEL_1): index 1. Named labels without it are refused: reading the other one would train
    towards the opposite sentiment."""
    if config.num_labels == 1:
        return 0
    names = [str(name) for name in (config.id2label or {}).values()]
    labels = {name.upper(): k for k, name in (config.id2label or {}).items()}
    if positive_label.upper() in labels:
        return int(labels[positive_label.upper()])
    if config.num_labels == 2 and all(re.fullmatch(r"LABEL_\d+", name) for name in names):
        return 1
    raise ModelError(f"{what}: {config.num_labels} outputs labelled {', '.join(names)}, none of them "
                     f"reward.positive_label={positive_label!r}: set it to the positive label (a reward is one output "
                     "or a named label)")


class VaderScorer:
    """The VADER lexicon's compound sentiment in [-1, 1]: a judge no pipeline stage trained."""

    name = "vader"

    def __init__(self) -> None:
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        self.analyzer = SentimentIntensityAnalyzer()

    def __call__(self, queries: list[str], responses: list[str], response_ids: ResponseIds = None) -> torch.Tensor:
        return torch.tensor([self.analyzer.polarity_scores(q + r)["compound"]
                             for q, r in zip(queries, responses, strict=True)], dtype=torch.float32)


def make_scorer(spec: str, model: ModelParams, positive_label: str, device: torch.device | str, what: str,
                max_tokens: int | None = None, batch_size: int = BATCH_SIZE) -> Scorer:
    """'vader' or a classifier (Hub id or local dir) that must hold ``max_tokens`` (prompt + response) positions,
    scoring ``batch_size`` texts a forward pass."""
    if spec == "vader":
        return VaderScorer()
    return ClassifierScorer(spec, model, positive_label, device, batch_size, what=what, max_tokens=max_tokens)


class RewardScorer:
    """The training reward with reward functions: the reward model's score (none with reward.model null) plus each
    function's scores times its weight."""

    def __init__(self, model: Scorer | None, functions: list[RewardFunction]) -> None:
        self.model, self.functions = model, functions
        self.name = model.name if model is not None else REWARD

    def __call__(self, queries: list[str], responses: list[str], response_ids: ResponseIds = None) -> torch.Tensor:
        total = self.model(queries, responses) if self.model is not None else torch.zeros(len(responses))
        for function in self.functions:
            total = total + function.weight * function(queries, responses, response_ids)
        return total


def make_reward_scorer(functions: list[RewardFunction], path: str | None, what: str, positive_label: str,
                       model: ModelParams, device: torch.device | str, max_tokens: int | None = None,
                       batch_size: int = BATCH_SIZE) -> Scorer:
    """The training reward: the model at ``path`` (None: the ``functions`` alone, loaded and tried first:
    rlhf/models/reward_functions.py), its config checked before its weights load (it must hold ``max_tokens``
    positions), plus the functions; the model scores ``batch_size`` texts a forward pass."""
    if path is None:
        return RewardScorer(None, functions)
    scorer = make_scorer(path, model, positive_label, device, what, max_tokens, batch_size)
    return RewardScorer(scorer, functions) if functions else scorer
