"""The params, declared once: each key's type, constraint and doc, and the rules between keys. Defaults live in one
place only, the project's params.yaml (every key must be written there: it is DVC's cache key), so nothing here has a
default; ``rlhf.pipeline.params.defaults()`` reads them for tests and benchmarks.

A broken rule is a ``Rule`` naming the key; rlhf/pipeline/messages.py turns it into one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from rlhf.pipeline.dpo_params import DpoParams
from rlhf.pipeline.paths import is_local
from rlhf.pipeline.sections import PathOrId, Rule, Section, at_most, judge_name
from rlhf.rl.estimators import ESTIMATORS


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


class SftParams(Section):
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
    learning_rate: float = Field(gt=0)
    """Peak AdamW learning rate (warmup, then cosine decay)."""
    weight_decay: float = Field(ge=0)
    """AdamW weight decay of the matrices (biases and norms: none)."""
    warmup_steps: int = Field(ge=0)
    """Linear warmup steps (at most half of the steps)."""
    max_grad_norm: float = Field(gt=0)
    """Gradient-norm clip of each optimizer step."""
    splits: list[str] = Field(min_length=1)
    """Data-source splits to train on (never 'test': that is where perplexity is measured)."""
    eval_reviews: int = Field(gt=0)
    """Test-split reviews used for held-out perplexity."""
    checkpoint_every: int | None = Field(ge=0)
    """Optimizer steps per resumable checkpoint in data/checkpoints/sft/ (a rerun after a kill resumes from the
    newest); 0 or null: off."""

    @model_validator(mode="after")
    def _rules(self) -> SftParams:
        if self.n_embd % self.n_head:
            raise Rule("n_embd", f"must be divisible by sft.n_head ({self.n_head})", self.n_embd)
        if self.base == "scratch":
            at_most(self, "block_size", "n_positions", "sft")
        if "test" in self.splits:
            raise Rule("splits", "must not contain 'test' (held out for perplexity)", self.splits)
        return self


class RewardParams(Section):
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
    learning_rate: float = Field(gt=0)
    """Peak AdamW learning rate (warmup, then cosine decay)."""
    batch_size: int = Field(gt=0)
    """Pairs per optimizer step."""
    max_length: int = Field(gt=0)
    """Token cap for a chosen/rejected text."""
    margin: bool
    """Subtract a rating-difference margin inside the Bradley-Terry loss (needs ratings in the pairs)."""
    center_coef: float = Field(ge=0)
    """Weight of mean((r_chosen + r_rejected)^2) in the loss: keeps scores centred on 0, so 'score > 0' reads as
    'more positive than the average snippet' (Eisenstein et al. 2023; TRL's center_rewards_coefficient)."""
    warmup_steps: int = Field(ge=0)
    """Linear warmup steps (at most half of the steps)."""
    max_grad_norm: float = Field(gt=0)
    """Gradient-norm clip of each optimizer step."""
    checkpoint_every: int | None = Field(ge=0)
    """Optimizer steps per resumable checkpoint in data/checkpoints/reward/ (a rerun after a kill resumes from the
    newest); 0 or null: off."""


class PpoParams(Section):
    steps: int = Field(gt=0)
    """PPO iterations; each samples batch_size prompts (194 x 128 is one pass over the 24,895 train prompts)."""
    learning_rate: float = Field(gt=0)
    """AdamW learning rate of the policy (and value head)."""
    batch_size: int = Field(gt=0)
    """Samples (responses) per iteration, per process: batch_size / samples_per_prompt prompts, each answered
    samples_per_prompt times."""
    mini_batch_size: int = Field(gt=0)
    """Samples per forward/backward pass of the update."""
    gradient_accumulation_steps: int = Field(gt=0)
    """Mini-batches per optimizer step."""
    ppo_epochs: int = Field(gt=0)
    """Passes of the update over each batch."""
    init_kl_coef: float = Field(ge=0)
    """Initial (or, with adap_kl_ctrl false, fixed) coefficient of the KL penalty in the reward."""
    adap_kl_ctrl: bool
    """Adapt the KL coefficient towards target (Ziegler et al. 2019)."""
    target: float = Field(ge=0)
    """Adaptive KL controller's target KL (nats per sequence)."""
    horizon: float = Field(gt=0)
    """Adaptive KL controller's horizon, in samples."""
    advantage_estimator: Literal[tuple(ESTIMATORS)]  # type: ignore[valid-type]
    """gae: PPO's value head and GAE; rloo (leave-one-out baseline over each prompt's samples), grpo (reward
    normalised within each prompt's samples), reinforce_pp (REINFORCE++: discounted returns whitened over the batch):
    critic-free, no value head (rlhf/rl/estimators.py)."""
    samples_per_prompt: int = Field(gt=0)
    """k: responses sampled per prompt in a batch (>= 2 for rloo and grpo, whose baseline is the prompt's other
    samples)."""
    kl_loss_coef: float = Field(ge=0)
    """grpo only: weight of GRPO's k3 KL(policy || reference) loss term (the paper: 0.04, with init_kl_coef 0 and
    adap_kl_ctrl false); 0: off."""
    gamma: float = Field(ge=0, le=1)
    """Discount of GAE and of REINFORCE++'s returns."""
    lam: float = Field(ge=0, le=1)
    """Lambda of GAE."""
    cliprange: float = Field(gt=0)
    """Clip range of the policy ratio."""
    cliprange_value: float = Field(gt=0)
    """Clip range of the value prediction around its rollout value."""
    vf_coef: float = Field(ge=0)
    """Weight of the value loss."""
    kl_penalty: Literal["kl", "abs", "mse", "full", "k3"]
    """Per-token KL estimate in the reward: kl (k1, log-ratio), abs, mse (k2), k3, or full (exact over the vocab)."""
    whiten_rewards: bool
    """Whiten the per-token rewards before GAE."""
    ratio_threshold: float = Field(gt=0)
    """Skip a mini-batch's update when its mean probability ratio exceeds this."""
    max_grad_norm: float | None = Field(gt=0)
    """Gradient-norm clip of each optimizer step (null: no clipping; the norm is still logged)."""
    use_score_scaling: bool
    """Divide scores by their running standard deviation."""
    use_score_norm: bool
    """With use_score_scaling, also subtract their running mean."""
    score_clip: float | None = Field(gt=0)
    """Clip the (scaled) scores to [-score_clip, score_clip] (null: off)."""
    missing_eos_penalty: float | None = Field(ge=0)
    """Subtracted from the score of a response that has no EOS token (null: off)."""
    response_min_tokens: int = Field(gt=0)
    """Shortest response; each prompt's length is drawn uniformly from [min, max]."""
    response_max_tokens: int = Field(gt=0)
    """Longest response, in tokens."""
    top_k: int = Field(ge=0)
    """Sampling: keep the k most likely tokens (0: all)."""
    top_p: float = Field(gt=0, le=1)
    """Sampling: nucleus probability mass (1: all)."""
    temperature: float = Field(gt=0)
    """Sampling temperature (log-probabilities are taken at the same temperature)."""
    disable_dropout: bool
    """Switch dropout off in the policy and the reference."""
    value_model: Literal["shared", "separate"]
    """'shared': a value head on the policy's backbone; 'separate': a critic model initialised from the policy (gae
    only)."""
    checkpoint_every: int | None = Field(ge=0)
    """Steps per rollout-log file and per resumable checkpoint in data/checkpoints/ppo/ (kept outside DVC's outputs,
    keyed by a fingerprint of the run; a rerun after a kill resumes from the newest). 0 or null: no checkpoints,
    rollout files of 10 steps."""
    nan_policy: Literal["stop", "skip"]
    """On a NaN/inf score, loss or gradient: stop with a message, or skip the batch and count it."""

    @model_validator(mode="after")
    def _rules(self) -> PpoParams:
        at_most(self, "response_min_tokens", "response_max_tokens", "ppo")
        step = self.mini_batch_size * self.gradient_accumulation_steps
        if self.batch_size % step:
            raise Rule("batch_size", f"must be a multiple of ppo.mini_batch_size x ppo.gradient_accumulation_steps "
                                     f"({step})", self.batch_size)
        self._estimator_rules()
        return self

    def _estimator_rules(self) -> None:
        name, k = self.advantage_estimator, self.samples_per_prompt
        estimator = ESTIMATORS[name]
        if k < estimator.min_samples_per_prompt:
            raise Rule("samples_per_prompt", f"must be >= {estimator.min_samples_per_prompt} with "
                                             f"ppo.advantage_estimator {name} (its baseline is the prompt's other "
                                             "samples)", k)
        if self.batch_size % k:
            raise Rule("batch_size", f"must be a multiple of ppo.samples_per_prompt ({k})", self.batch_size)
        if self.kl_loss_coef > 0 and not estimator.kl_loss:
            raise Rule("kl_loss_coef", f"must be 0 with ppo.advantage_estimator {name} (a KL loss term is "
                                       "GRPO's; the others keep the KL penalty in the reward: ppo.init_kl_coef)",
                       self.kl_loss_coef)
        if self.value_model == "separate" and not estimator.trains_critic:
            raise Rule("value_model", f"must be 'shared' with ppo.advantage_estimator {name}, which trains no "
                                      "critic (a separate critic would never be used)", self.value_model)

    @property
    def prompts_per_step(self) -> int:
        """Prompts per iteration (per process): each is answered samples_per_prompt times."""
        return self.batch_size // self.samples_per_prompt

    @property
    def critic(self) -> Literal["shared", "separate"] | None:
        """The value model to train: value_model where the estimator trains a critic, else None."""
        return self.value_model if ESTIMATORS[self.advantage_estimator].trains_critic else None

    @property
    def unused_keys(self) -> list[str]:
        """The ppo.* keys that the estimator leaves unused (the stage logs them once)."""
        return [f"ppo.{key}" for key in ESTIMATORS[self.advantage_estimator].unused_keys]


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
    seed: int = Field(ge=0)
    """Seed of every random generator (each output derives its own from it)."""
    method: Literal["ppo", "dpo", "best_of_n"]
    """How the evaluated policy is made from the initial one: ppo (RL against the reward scorer, the ppo stage), dpo
    (DPO or IPO on preference pairs, the dpo stage) or best_of_n (no training: the reward scorer's best of
    evaluate.best_of_n reference samples). The other methods' stages write only a marker."""
    data: DataParams
    model: ModelParams
    prepare: PrepareParams
    sft: SftParams
    reward: RewardParams
    ppo: PpoParams
    dpo: DpoParams
    evaluate: EvaluateParams

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
        r, s = self.reward, self.sft
        if r.train and r.base == "sft" and not s.enabled:
            raise Rule("reward.base", "is 'sft' but sft.enabled is false (enable sft or name another base)", r.base)
        longest = self.prepare.prompt_max_tokens + self.ppo.response_max_tokens
        if s.enabled and s.base == "scratch" and longest > s.n_positions:
            raise Rule("ppo.response_max_tokens", f"prompt_max_tokens + response_max_tokens ({longest}) must fit "
                                                  f"sft.n_positions ({s.n_positions})", self.ppo.response_max_tokens)
        if s.enabled and s.base == "scratch" and self.dpo.max_length > s.n_positions:
            raise Rule("dpo.max_length", f"must fit sft.n_positions ({s.n_positions})", self.dpo.max_length)
        return self
