"""The params, declared once: each key's type, constraint and doc, and the rules between keys. The keys every stage
shares and the sections of the stages whose libraries take them are declared here; a stage's record names its own
section (``Stage(section=...)``), and ``params_model()`` puts them together, in pipeline order. Defaults live in one
place only, the project's params.yaml (every key must be written there: it is DVC's cache key), so nothing here has a
default; ``rlhf.pipeline.params.defaults()`` reads them for tests and benchmarks.

A broken rule is a ``Rule`` naming the key; rlhf/pipeline/messages.py turns it into one line.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, create_model, model_validator

from rlhf.pipeline.paths import SPLITS, is_local
from rlhf.pipeline.registry import policies, stage, stage_names
from rlhf.pipeline.sections import PathOrId, Rule, Schedule, Section, at_most, judge_name

BEST_OF_N = "best_of_n"  # the method that trains nothing: evaluate samples the reference N times


class DataParams(Section):
    source: PathOrId
    """Hub dataset id, a local folder of Parquet splits, a CSV file, or an extracted aclImdb/ folder."""
    revision: str | None
    """Hub dataset revision (branch, tag or commit) to pin; ignored for local sources."""


class ModelParams(Section):
    policy: PathOrId
    """Initial policy and frozen reference (Hub id or local dir), used when sft.enabled is false."""
    tokenizer: PathOrId | None
    """Tokenizer (Hub id or local dir); null means the policy's own."""
    revision: str | None
    """Hub revision pinned for every model and tokenizer loaded by id; ignored for local dirs."""
    trust_remote_code: bool
    """Run model code shipped inside a Hub repo. Off: only the architectures built into transformers load."""
    allow_pickle: bool
    """Accept pickled (.bin) checkpoints, loaded with weights_only=True. Off: safetensors only."""
    precision: Literal["auto", "fp32", "bf16"]
    """Training matmuls in bf16 (autocast; PPO's LM head stays fp32, TF32 on CUDA; losses and optimizer fp32) or fp32.
    auto: bf16 on CUDA and on CPUs with native bf16 matmuls (AMX / AVX-512 BF16), fp32 elsewhere."""


class PrepareParams(Section):
    min_review_chars: int = Field(ge=0)
    """Keep reviews with more than this many characters (the classic recipe's len(text) > 200)."""
    prompt_min_tokens: int = Field(gt=0)
    """Shortest prompt prefix, in tokens."""
    prompt_max_tokens: int = Field(gt=0)
    """Longest prompt prefix, in tokens; each review's length is drawn uniformly from [min, max]."""
    train_prompts: int | None = Field(gt=0)
    """Cap on the number of train prompts; null keeps every review that passes the filter."""
    eval_prompts: int = Field(gt=0)
    """Number of held-out prompts drawn from the test split."""
    pairs_source: PathOrId
    """'imdb' to build chosen/rejected pairs from the data source, or a local Parquet/JSONL with those columns."""
    pairs_by_rating: bool
    """Pair a higher star rating with a lower one (any two ratings) instead of a positive with a negative review."""
    pair_min_tokens: int = Field(gt=0)
    """Shortest chosen/rejected snippet, in tokens."""
    pair_max_tokens: int = Field(gt=0)
    """Longest chosen/rejected snippet, in tokens."""
    train_pairs: int = Field(gt=0)
    """Number of training pairs (from the train split)."""
    test_pairs: int = Field(gt=0)
    """Number of held-out pairs (from the test split only)."""

    @model_validator(mode="after")
    def _rules(self) -> PrepareParams:
        at_most(self, "prompt_min_tokens", "prompt_max_tokens", "prepare")
        at_most(self, "pair_min_tokens", "pair_max_tokens", "prepare")
        source = self.pairs_source
        if source != "imdb" and not (is_local(source) or Path(source).suffix in (".parquet", ".jsonl")):
            raise Rule("pairs_source", "must be 'imdb' or a local .parquet/.jsonl file", source)
        return self


class SftParams(Schedule):
    enabled: bool
    """Train the policy here; ppo and evaluate then use models/sft as policy and reference instead of model.policy."""
    base: PathOrId
    """'scratch' (a GPT-2 config from the keys below), a Hub id or a local dir to fine-tune."""
    n_layer: int = Field(gt=0)
    """Transformer blocks of a from-scratch model."""
    n_embd: int = Field(gt=0)
    """Width of a from-scratch model (a multiple of n_head)."""
    n_head: int = Field(gt=0)
    """Attention heads of a from-scratch model."""
    n_positions: int = Field(gt=0)
    """Context length of a from-scratch model; must hold block_size and prompt + response lengths."""
    dropout: float = Field(ge=0, lt=1)
    """Dropout of a from-scratch model (residual, embedding and attention)."""
    max_tokens: int = Field(gt=0)
    """Training budget in tokens (steps = max_tokens // (batch_size * block_size))."""
    block_size: int = Field(gt=0)
    """Tokens per packed training block (reviews joined with EOS)."""
    batch_size: int = Field(gt=0)
    """Blocks per micro-batch."""
    gradient_accumulation_steps: int = Field(gt=0)
    """Micro-batches per optimizer step."""
    weight_decay: float = Field(ge=0)
    """AdamW weight decay of the matrices (biases and norms: none)."""
    splits: list[str] = Field(min_length=1)
    """Data-source splits to train on (never 'test': that is where perplexity is measured)."""
    eval_reviews: int = Field(gt=0)
    """Test-split reviews used for held-out perplexity."""

    @model_validator(mode="after")
    def _rules(self) -> SftParams:
        if self.n_embd % self.n_head:
            raise Rule("n_embd", f"must be divisible by sft.n_head ({self.n_head})", self.n_embd)
        if self.base == "scratch":
            at_most(self, "block_size", "n_positions", "sft")
        if unknown := [split for split in self.splits if split not in SPLITS]:
            raise Rule("splits", f"unknown split {unknown[0]!r} (known: {', '.join(SPLITS)})", self.splits)
        if "test" in self.splits:
            raise Rule("splits", "must not contain 'test' (held out for perplexity)", self.splits)
        return self


class RewardParams(Schedule):
    train: bool
    """Train a preference reward model here; otherwise reward.model scores the responses."""
    base: PathOrId
    """Initialisation when training: 'sft' (models/sft), 'scratch' (the sft.* shape) or a Hub id / local dir."""
    model: PathOrId
    """Sentiment classifier whose positive logit is the reward when reward.train is false (Hub id or local dir)."""
    positive_label: str
    """Label name of the positive class in reward.model's config (falls back to index 1 when absent)."""
    epochs: int = Field(gt=0)
    """Shuffled passes over the training pairs."""
    batch_size: int = Field(gt=0)
    """Pairs per optimizer step."""
    max_length: int = Field(gt=0)
    """Token cap for a chosen/rejected text."""
    margin: bool
    """Subtract a rating-difference margin inside the Bradley-Terry loss (needs ratings in the pairs)."""
    center_coef: float = Field(ge=0)
    """Weight of mean((r_chosen + r_rejected)^2) in the loss: keeps scores centred on 0, so 'score > 0' reads as
    'more positive than the average snippet' (Eisenstein et al. 2023; TRL's center_rewards_coefficient)."""

    def check_with(self, params: Any) -> None:
        if self.train and self.base == "sft" and not params.sft.enabled:
            raise Rule("reward.base", "is 'sft' but sft.enabled is false (enable sft or name another base)",
                       self.base)


class EvaluateParams(Section):
    judges: list[PathOrId]
    """Extra scorers: 'vader' (lexicon, no download) or any sentiment classifier (Hub id or local dir); metrics keys
    judge.<name>.* use 'vader' or the model's last path component, sanitized ('lvwerra/distilbert-imdb' ->
    'distilbert-imdb')."""
    greedy: bool
    """Also run a greedy-decoding pass of both models and report its scores (keys policy_greedy.*, ...)."""
    batch_size: int = Field(gt=0)
    """Prompts per generate/score/forward batch."""
    examples: int = Field(ge=0)
    """Before/after examples in the Markdown report."""
    best_of_n: int = Field(ge=1)
    """N of method best_of_n: responses sampled from the reference per eval prompt, the reward scorer's best kept."""

    @property
    def judge_names(self) -> list[str]:
        """The metrics name of each judge, in order (unique: validation refuses two judges with one name)."""
        return [judge_name(spec) for spec in self.judges]

    @model_validator(mode="after")
    def _rules(self) -> EvaluateParams:
        names = self.judge_names
        for i, name in enumerate(names):
            if name in names[:i]:
                raise Rule(f"judges[{i}]", f"judge name {name!r} repeats evaluate.judges[{names.index(name)}] (names "
                                           "are the model's basename; list each judge once)", self.judges[i])
        return self


class Params(Section):
    """The whole of params.yaml: the keys every stage shares here, and one section per stage that declares one
    (``Stage(section=...)``), added by ``params_model()``."""

    seed: int = Field(ge=0)
    """Seed of every random generator (each output derives its own from it)."""
    method: str
    """How the evaluated policy is made from the initial one: the name of the stage that trains it (ppo: RL against
    the reward scorer; dpo: DPO or IPO on preference pairs) or best_of_n (no training: the reward scorer's best of
    evaluate.best_of_n reference samples). The other methods' stages write only a marker."""
    data: DataParams
    model: ModelParams

    @property
    def tokenizer_path(self) -> str:
        """The tokenizer every stage uses: model.tokenizer, else the SFT base / policy it belongs to."""
        if self.model.tokenizer is not None:
            return self.model.tokenizer
        if self.sft.enabled and self.sft.base != "scratch":
            return self.sft.base
        return self.model.policy

    @model_validator(mode="after")
    def _rules(self) -> Params:
        if self.method not in methods():
            raise Rule("method", "must be one of " + ", ".join(methods()), self.method)
        for name in type(self).model_fields:
            if isinstance(section := getattr(self, name), Section):
                section.check_with(self)
        return self


def methods() -> list[str]:
    """The values of ``method``: each stage that trains a policy, and best_of_n (evaluate alone)."""
    return [*policies(), BEST_OF_N]


@functools.cache
def params_model() -> type[Params]:
    """``Params`` with every stage's own section, in pipeline order (imports the stage scripts)."""
    sections = {name: (record.section, ...) for name in stage_names() if (record := stage(name)).section}
    return create_model("Params", __base__=Params, __doc__=Params.__doc__, **sections)
