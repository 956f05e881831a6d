"""Every key of params.yaml, declared once (the ppo section in ppo_params.py): its type, bound and doc (what
``--help`` prints), the rules between keys, and ``Params``, the whole file. No defaults: params.yaml holds them, every
key written out (it is DVC's cache key). A new stage's section is declared here and listed in ``Params``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, ValidationInfo, model_validator

from rlhf.pipeline.paths import SPLITS, is_local
from rlhf.pipeline.ppo_params import PpoParams
from rlhf.pipeline.section import Rule, Section, at_most


def _exists_if_local(value: str, info: ValidationInfo) -> str:
    """A value written like a local path must exist under the params file's folder (``context['root']``)."""
    root = (info.context or {}).get("root")
    if root is not None and is_local(value) and not (Path(root) / Path(value).expanduser()).exists():
        raise Rule("", "local path does not exist", value)
    return value


PathOrId = Annotated[str, AfterValidator(_exists_if_local)]  # a Hub id (not checkable offline) or a local path


def judge_name(spec: str) -> str:
    """A scorer's metrics name: 'vader', or the model's last path component, sanitized."""
    return re.sub(r"[^A-Za-z0-9_-]+", "_", Path(spec.rstrip("/")).name) or "model"


class Schedule(Section):
    """The keys of every stage trained by the one fit loop (rlhf/train/fit.py)."""

    learning_rate: float = Field(gt=0)
    """Peak AdamW learning rate (warmup, then cosine decay)."""
    warmup_steps: int = Field(ge=0)
    """Linear warmup steps (at most half of the steps)."""
    max_grad_norm: float = Field(gt=0)
    """Gradient-norm clip of each optimizer step."""
    checkpoint_every: int | None = Field(ge=0)
    """Optimizer steps per resumable checkpoint in data/checkpoints/<stage>/ (a rerun after a kill resumes from the
    newest); 0 or null: off."""


class DataParams(Section):
    source: PathOrId
    """Hub dataset id, a local folder of Parquet splits, a CSV/JSONL/Parquet file, or an extracted aclImdb/ folder."""
    revision: str | None
    """Hub dataset revision (branch, tag or commit) to pin; ignored for local sources."""


class LoraParams(Section):
    r: int = Field(ge=0)
    """LoRA rank. 0: ppo, dpo and sft train every weight and ppo holds a frozen copy as reference. r > 0: they train
    rank-r adapters only (peft), the reference is the same model with its adapters off, checkpoints hold the adapters
    and models/* are saved merged. sft from scratch trains every weight whatever r says."""
    alpha: float = Field(gt=0)
    """The adapters' update is scaled by alpha / r."""
    dropout: float = Field(ge=0, lt=1)
    """Dropout on the adapters' input; ppo (with ppo.disable_dropout) and dpo switch it off like every dropout."""
    target_modules: list[str] | None = Field(min_length=1)
    """Names (or name suffixes) of the linear projections to adapt, e.g. [c_attn]; null: every attention and MLP
    projection (GPT-2: c_attn, c_proj, c_fc), all linear layers but the LM head."""


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
    gradient_checkpointing: bool
    """ppo: keep only each transformer block's input from the update's forward and recompute the rest in the backward
    (the policy's and a separate critic's blocks): the same gradients, activation memory of one block instead of every
    block, for about one more forward of the body (BENCHMARKS.md#activation-checkpointing)."""
    lora: LoraParams


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
    """Train the policy here; ppo, dpo and evaluate then use models/sft as policy and reference, not model.policy."""
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
    """Training budget in tokens: max_tokens // (batch_size * block_size * gradient_accumulation_steps) steps."""
    block_size: int = Field(ge=2)
    """Tokens per packed training block (reviews joined with EOS); a block of n gives n - 1 next-token targets."""
    batch_size: int = Field(gt=0)
    """Blocks per micro-batch."""
    gradient_accumulation_steps: int = Field(gt=0)
    """Micro-batches per optimizer step."""
    weight_decay: float = Field(ge=0)
    """AdamW weight decay of the matrices (biases and norms: none)."""
    sentiment_coef: float = Field(ge=0)
    """Weight of an auxiliary loss: a linear head on the last hidden state predicts, at each token, its review's
    label (positive or negative; unlabelled reviews left out) by logistic loss; the head is dropped after training
    and the reported train_loss includes the term. 0: off. A body that knows the sentiment gives the reward model
    and PPO features the reward is easier to read from (docs/experiments.md)."""
    splits: list[str] = Field(min_length=1)
    """Data-source splits to train on (never 'test': that is where perplexity is measured)."""
    eval_reviews: int = Field(gt=0)
    """Test-split reviews used for held-out perplexity."""
    compile: bool | Literal["auto"]
    """torch.compile the training step (forward, loss and backward), the same loss to float rounding: true, false, or
    auto: on CUDA only (on a CPU compiling takes minutes, which only a long bf16 run repays: docs/gpu.md). Its first
    use is checked against the eager step: where it fails or differs, auto trains eagerly, true stops."""

    @model_validator(mode="after")
    def _rules(self) -> SftParams:
        if self.n_embd % self.n_head:
            raise Rule("n_embd", f"must be divisible by sft.n_head ({self.n_head})", self.n_embd)
        if self.base == "scratch":
            at_most(self, "block_size", "n_positions", "sft")
        step = self.batch_size * self.block_size * self.gradient_accumulation_steps
        if self.max_tokens < step:
            raise Rule("max_tokens", "must be at least one optimizer step's tokens, sft.batch_size x sft.block_size "
                                     f"x sft.gradient_accumulation_steps ({step})", self.max_tokens)
        if unknown := [split for split in self.splits if split not in SPLITS]:
            raise Rule("splits", f"unknown split {unknown[0]!r} (known: {', '.join(SPLITS)})", self.splits)
        if "test" in self.splits:
            raise Rule("splits", "must not contain 'test' (held out for perplexity)", self.splits)
        return self


def _module_callable(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", value):
        raise Rule("", "must be 'module:callable' (e.g. rewards.text:repetition_penalty)", value)
    return value


class RewardFunctionParams(Section):
    function: Annotated[str, AfterValidator(_module_callable)]
    """'module:callable', called as f(queries, responses) with two lists of strings, or by TRL's convention,
    f(prompts=, completions=, completion_ids=, **kwargs) (docs/ppo.md#reward-functions), returning one float per
    response; the module importable from the project root (rewards/text.py is rewards.text) or installed."""
    weight: float
    """Its weight in the training reward."""


class RewardParams(Schedule):
    train: bool
    """Train a preference reward model here; otherwise reward.model scores the responses."""
    base: PathOrId
    """Initialisation when training: 'sft' (models/sft), 'scratch' (the sft.* shape) or a Hub id / local dir."""
    model: PathOrId | None
    """Sentiment classifier whose positive logit is the reward when reward.train is false (Hub id or local dir);
    null: no model, the reward functions alone."""
    positive_label: str
    """Label name of the positive class in reward.model's (and the judges') config; a two-label model whose labels are
    unnamed (LABEL_0, LABEL_1) reads index 1."""
    functions: list[RewardFunctionParams]
    """Python reward functions, added to the model's score times their weights: the training reward of ppo, best-of-N
    and sampled DPO pairs, evaluate's reward column and the optimum's pool. Each is tried on a few prompts before a
    stage loads a model: one that cannot be imported, raises, returns the wrong count or a NaN stops the stage. Its
    module file must be among the stage's deps in dvc.yaml (rewards/ is) unless it is installed."""
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

    @model_validator(mode="after")
    def _rules(self) -> RewardParams:
        if not self.train and self.model is None and not self.functions:
            raise Rule("model", "is null with reward.train false and no reward.functions: nothing would score the "
                                "responses", self.model)
        return self


class DpoParams(Schedule):
    loss: Literal["dpo", "ipo"]
    """dpo: -log sigmoid(beta h) (Rafailov et al. 2023), with label_smoothing the conservative cDPO; ipo:
    (h - 1 / (2 tau))^2 (Azar et al. 2023); h: the chosen minus the rejected log-ratio log pi / pi_ref."""
    beta: float = Field(gt=0)
    """DPO's KL coefficient: small lets the policy move far from the reference."""
    label_smoothing: float = Field(ge=0, lt=0.5)
    """cDPO: the probability that a pair's label is flipped (0: plain DPO; 0.5 would learn nothing)."""
    tau: float = Field(gt=0)
    """IPO's regularisation strength: the target log-ratio margin is 1 / (2 tau) nats per sequence."""
    rpo_alpha: float = Field(ge=0)
    """Weight of the chosen response's NLL per token added to each pair's loss (RPO, Pang et al. 2024: 1; TRL's
    rpo_alpha): holds the chosen response's likelihood up. 0: off."""
    pairs: Literal["prepare", "sampled"]
    """prepare: prepare's data/pairs (the reward model's pairs); sampled: samples_per_prompt completions per train
    prompt from the initial policy, ranked by the reward scorer (data/sampled_pairs, the DPO paper's IMDb setup)."""
    samples_per_prompt: int = Field(ge=2)
    """k: completions sampled per prompt for sampled pairs; every two with different scores make a pair."""
    sample_prompts: int | None = Field(gt=0)
    """Train prompts sampled for sampled pairs (the first ones; a tenth of them held out for test pairs); null: all."""
    batch_size: int = Field(gt=0)
    """Pairs per optimizer step."""
    epochs: int = Field(gt=0)
    """Shuffled passes over the training pairs."""
    max_length: int = Field(gt=0)
    """Token cap of prompt + response; responses are cut to fit."""


class EvaluateParams(Section):
    judges: list[PathOrId]
    """Extra scorers: 'vader' (lexicon) or any sentiment classifier (Hub id or local dir); metrics keys judge.<name>.*,
    the name 'vader' or the model's last path component ('lvwerra/distilbert-imdb': distilbert-imdb)."""
    greedy: bool
    """Also run a greedy-decoding pass of both models and report its scores (keys reward.policy_greedy_*, ...)."""
    batch_size: int = Field(gt=0)
    """Prompts per generate/score/forward batch."""
    examples: int = Field(ge=0)
    """Before/after examples in the Markdown report."""
    best_of_n: int = Field(ge=1)
    """N of method best_of_n: responses sampled from the reference per eval prompt, the reward scorer's best kept."""

    @property
    def judge_names(self) -> list[str]:
        return [judge_name(spec) for spec in self.judges]

    @model_validator(mode="after")
    def _rules(self) -> EvaluateParams:
        names = self.judge_names
        for i, name in enumerate(names):
            if name in names[:i]:
                raise Rule(f"judges[{i}]", f"judge name {name!r} repeats evaluate.judges[{names.index(name)}] (names "
                                           "are the model's basename; list each judge once)", self.judges[i])
        return self


class OptimumParams(Section):
    samples_per_prompt: int = Field(ge=0)
    """N: reference samples per eval prompt in the pool the optimum and best-of-n are estimated from (0: off). The
    estimate holds up to about log N - 1 nats of KL (the optimum stage marks the points beyond)."""
    prompts: int | None = Field(gt=0)
    """Eval prompts pooled (the first ones); null: all of them. Fewer make the pool cheaper, but a point's gain is
    measured over every eval prompt and the optimum's over these: its share is then off by how much more there is to
    gain on these prompts than on all."""


class Params(Section):
    """The whole of params.yaml."""

    seed: int = Field(ge=0, lt=2**32)
    """Seed of every random generator (each output derives its own from it); below 2**32, as NumPy's seeds are."""
    method: Literal["ppo", "dpo", "best_of_n"]
    """How the evaluated policy is made: ppo (RL against the reward scorer), dpo (DPO or IPO on preference pairs) or
    best_of_n (no training: the reward scorer's best of evaluate.best_of_n reference samples). The other methods'
    stages write only a marker."""
    data: DataParams
    model: ModelParams
    prepare: PrepareParams
    sft: SftParams
    reward: RewardParams
    ppo: PpoParams
    dpo: DpoParams
    evaluate: EvaluateParams
    optimum: OptimumParams

    @property
    def tokenizer_path(self) -> str:
        """model.tokenizer, else the SFT base or the policy it belongs to."""
        if self.model.tokenizer is not None:
            return self.model.tokenizer
        return self.sft.base if self.sft.enabled and self.sft.base != "scratch" else self.model.policy

    @model_validator(mode="after")
    def _rules(self) -> Params:
        """The rules between sections."""
        reward, sft, scratch = self.reward, self.sft, self.sft.enabled and self.sft.base == "scratch"
        if reward.train and reward.base == "sft" and not sft.enabled:
            raise Rule("reward.base", "is 'sft' but sft.enabled is false (enable sft or name another base)",
                       reward.base)
        if self.model.lora.r and self.ppo.critic in ("separate", "reward"):
            raise Rule("ppo.value_model", "must be 'shared' with model.lora.r > 0 (a separate critic would hold a "
                                          "second full copy of the weights, what LoRA saves)", self.ppo.value_model)
        if self.model.lora.r and self.ppo.shard:
            raise Rule("ppo.shard", "must be false with model.lora.r > 0 (merging the adapters into sharded weights "
                                    "is not built; LoRA keeps the trained state small anyway)",
                       self.ppo.shard)
        if self.ppo.critic == "reward" and not reward.train:
            raise Rule("ppo.value_model", "'reward' needs reward.train: true (the critic starts from models/reward)",
                       self.ppo.value_model)
        longest = self.prepare.prompt_max_tokens + self.ppo.response_max_tokens
        if scratch and longest > sft.n_positions:
            raise Rule("ppo.response_max_tokens", f"prompt_max_tokens + response_max_tokens ({longest}) must fit "
                                                  f"sft.n_positions ({sft.n_positions})", self.ppo.response_max_tokens)
        if scratch and self.dpo.max_length > sft.n_positions:
            raise Rule("dpo.max_length", f"must fit sft.n_positions ({sft.n_positions})", self.dpo.max_length)
        return self
