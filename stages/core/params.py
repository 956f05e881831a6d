"""params.yaml -> typed, validated, frozen configs: the only config source of the pipeline.

Every stage calls ``load_params()`` first, before any data or model is loaded. An unknown key, a value of the wrong
type or an impossible value raises ``ParamsError`` with one line that names the dotted key and the rule.
Overrides go through DVC (``dvc exp run -S ppo.learning_rate=1e-5``), not through a CLI layer.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from stages.core.errors import ParamsError

PARAMS_FILE = "params.yaml"


@dataclass(frozen=True)
class DataParams:
    source: str = "stanfordnlp/imdb"
    """Hub dataset id, a local folder of Parquet splits, a CSV file, or an extracted aclImdb/ folder."""
    revision: str | None = None
    """Hub dataset revision (branch, tag or commit) to pin; ignored for local sources."""


@dataclass(frozen=True)
class ModelParams:
    policy: str = "lvwerra/gpt2-imdb"
    """Initial policy and frozen reference (Hub id or local dir), used when sft.enabled is false."""
    tokenizer: str | None = None
    """Tokenizer (Hub id or local dir); null means the policy's own."""
    revision: str | None = None
    """Hub revision pinned for every model and tokenizer loaded by id; ignored for local dirs."""
    trust_remote_code: bool = False
    """Run model code shipped inside a Hub repo. Off: only the architectures built into transformers load."""
    allow_pickle: bool = False
    """Accept pickled (.bin) checkpoints, loaded with weights_only=True. Off: safetensors only."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Training matmuls in bf16 (autocast; LM head, losses and optimizer stay fp32) or fp32. auto: bf16 on CUDA and
    on CPUs with native bf16 matmuls (AMX / AVX-512 BF16), fp32 elsewhere."""


@dataclass(frozen=True)
class PrepareParams:
    min_review_chars: int = 200
    """Keep reviews with more than this many characters (the classic recipe's len(text) > 200)."""
    prompt_min_tokens: int = 2
    """Shortest prompt prefix, in tokens."""
    prompt_max_tokens: int = 8
    """Longest prompt prefix, in tokens; each review's length is drawn uniformly from [min, max]."""
    train_prompts: int | None = None
    """Cap on the number of train prompts; null keeps every review that passes the filter."""
    eval_prompts: int = 512
    """Number of held-out prompts drawn from the test split."""
    pairs_source: str = "imdb"
    """'imdb' to build chosen/rejected pairs from the data source, or a local Parquet/JSONL with those columns."""
    pairs_by_rating: bool = False
    """Pair a higher star rating with a lower one (any two ratings) instead of a positive with a negative review."""
    pair_min_tokens: int = 8
    """Shortest chosen/rejected snippet, in tokens."""
    pair_max_tokens: int = 32
    """Longest chosen/rejected snippet, in tokens."""
    train_pairs: int = 12500
    """Number of training pairs (from the train split)."""
    test_pairs: int = 2000
    """Number of held-out pairs (from the test split only)."""


@dataclass(frozen=True)
class SftParams:
    enabled: bool = False
    """Train the policy here; ppo and evaluate then use models/sft as policy and reference instead of model.policy."""
    base: str = "scratch"
    """'scratch' (a GPT-2 config from the keys below), a Hub id or a local dir to fine-tune."""
    n_layer: int = 6
    n_embd: int = 384
    n_head: int = 6
    n_positions: int = 256
    """Context length of a from-scratch model; must hold block_size and prompt + response lengths."""
    dropout: float = 0.0
    max_tokens: int = 2_000_000
    """Training budget in tokens (steps = max_tokens // (batch_size * block_size))."""
    block_size: int = 128
    """Tokens per packed training block (reviews joined with EOS)."""
    batch_size: int = 32
    gradient_accumulation_steps: int = 1
    learning_rate: float = 6e-4
    weight_decay: float = 0.1
    warmup_steps: int = 100
    """Linear warmup steps (at most half the steps), then cosine decay to 10% of learning_rate."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global norm before each optimizer step."""
    splits: list[str] = field(default_factory=lambda: ["train", "unsupervised"])
    """Data-source splits to train on (never 'test': that is where perplexity is measured)."""
    eval_reviews: int = 500
    """Test-split reviews used for held-out perplexity."""
    checkpoint_every: int | None = 50
    """Optimizer steps per resumable checkpoint in data/checkpoints/sft/ (a rerun after a kill resumes from the
    newest); 0 or null: off."""


@dataclass(frozen=True)
class RewardParams:
    train: bool = False
    """Train a preference reward model here; otherwise reward.model scores the responses."""
    base: str = "sft"
    """Initialisation when training: 'sft' (models/sft), 'scratch' (the sft.* shape) or a Hub id / local dir."""
    model: str = "lvwerra/distilbert-imdb"
    """Sentiment classifier whose positive logit is the reward when reward.train is false (Hub id or local dir)."""
    positive_label: str = "POSITIVE"
    """Label name of the positive class in reward.model's config (falls back to index 1 when absent)."""
    epochs: int = 1
    learning_rate: float = 5e-5
    warmup_steps: int = 40
    """Linear warmup steps (at most half the steps), then cosine decay to 10% of learning_rate."""
    max_grad_norm: float = 1.0
    """Gradients are clipped to this global norm before each optimizer step."""
    batch_size: int = 32
    max_length: int = 64
    """Token cap for a chosen/rejected text."""
    margin: bool = False
    """Subtract a rating-difference margin inside the Bradley-Terry loss (needs ratings in the pairs)."""
    center_coef: float = 0.01
    """Weight of mean((r_chosen + r_rejected)^2) in the loss: keeps scores centred on 0, so 'score > 0' reads as
    'more positive than the average snippet' (Eisenstein et al. 2023; TRL's center_rewards_coefficient)."""
    checkpoint_every: int | None = 100
    """Optimizer steps per resumable checkpoint in data/checkpoints/reward/ (a rerun after a kill resumes from the
    newest); 0 or null: off."""


@dataclass(frozen=True)
class PpoParams:
    steps: int = 194
    """PPO iterations; each samples batch_size prompts (194 x 128 is one pass over the 24,895 train prompts)."""
    learning_rate: float = 1.41e-5
    batch_size: int = 128
    mini_batch_size: int = 128
    gradient_accumulation_steps: int = 1
    ppo_epochs: int = 4
    init_kl_coef: float = 0.2
    adap_kl_ctrl: bool = True
    target: float = 6.0
    """Adaptive KL controller's target KL (nats per sequence)."""
    horizon: float = 10000.0
    gamma: float = 1.0
    lam: float = 0.95
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    kl_penalty: Literal["kl", "abs", "mse", "full", "k3"] = "kl"
    """Per-token KL estimate in the reward: kl (k1, log-ratio), abs, mse (k2), k3, or full (exact over the vocab)."""
    whiten_rewards: bool = False
    ratio_threshold: float = 10.0
    """Skip a mini-batch's update when its mean probability ratio exceeds this."""
    max_grad_norm: float | None = None
    use_score_scaling: bool = False
    use_score_norm: bool = False
    score_clip: float | None = None
    missing_eos_penalty: float | None = None
    """Subtracted from the score of a response that has no EOS token (null: off)."""
    response_min_tokens: int = 4
    response_max_tokens: int = 16
    top_k: int = 0
    top_p: float = 1.0
    temperature: float = 1.0
    disable_dropout: bool = True
    value_model: Literal["shared", "separate"] = "shared"
    """'shared': a value head on the policy's backbone; 'separate': a critic model initialised from the policy."""
    checkpoint_every: int | None = 10
    """Steps per rollout-log file and per resumable checkpoint in data/checkpoints/ppo/ (kept outside DVC's outputs,
    keyed by a fingerprint of the run; a rerun after a kill resumes from the newest). 0 or null: no checkpoints,
    rollout files of 10 steps."""
    nan_policy: Literal["stop", "skip"] = "stop"
    """On a NaN/inf score, loss or gradient: stop with a message, or skip the batch and count it."""


@dataclass(frozen=True)
class EvaluateParams:
    judges: list[str] = field(default_factory=lambda: ["vader"])
    """Extra scorers: 'vader' (lexicon, no download) or any sentiment classifier (Hub id or local dir); metrics keys
    judge.<name>.* use 'vader' or the model's last path component, sanitized ('lvwerra/distilbert-imdb' ->
    'distilbert-imdb')."""
    greedy: bool = False
    """Also run a greedy-decoding pass of both models and report its scores (keys policy_greedy.*, ...)."""
    batch_size: int = 64
    """Prompts per generate/score/forward batch."""
    examples: int = 12
    """Before/after examples in the Markdown report."""


@dataclass(frozen=True)
class Params:
    seed: int = 0
    data: DataParams = field(default_factory=DataParams)
    model: ModelParams = field(default_factory=ModelParams)
    prepare: PrepareParams = field(default_factory=PrepareParams)
    sft: SftParams = field(default_factory=SftParams)
    reward: RewardParams = field(default_factory=RewardParams)
    ppo: PpoParams = field(default_factory=PpoParams)
    evaluate: EvaluateParams = field(default_factory=EvaluateParams)

    @property
    def tokenizer_path(self) -> str:
        """The tokenizer every stage uses: model.tokenizer, else the SFT base / policy it belongs to."""
        if self.model.tokenizer is not None:
            return self.model.tokenizer
        if self.sft.enabled and self.sft.base != "scratch":
            return self.sft.base
        return self.model.policy


# ---------------------------------------------------------------------------------------------------------------------
# validation


def _fail(key: str, rule: str, value: Any) -> typing.NoReturn:
    raise ParamsError(f"params.yaml: {key}: {rule} (got {value!r})")


def _check_type(key: str, tp: Any, value: Any) -> Any:
    """Return ``value`` coerced to ``tp`` (int -> float only), or fail naming the key and the expected type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check_type(key, inner, value)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            _fail(key, f"must be one of {', '.join(map(str, choices))}", value)
        return value
    if origin is list:
        (inner,) = typing.get_args(tp)
        if not isinstance(value, list):
            _fail(key, f"must be a list of {inner.__name__}", value)
        return [_check_type(f"{key}[{i}]", inner, v) for i, v in enumerate(value)]
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            _fail(key, "must be a number", value)
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(key, "must be an integer", value)
        return value
    if not isinstance(value, tp):
        _fail(key, f"must be a {tp.__name__}", value)
    return value


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        _fail(prefix.rstrip("."), "must be a mapping", raw)
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            raise ParamsError(f"params.yaml: {prefix}{key}: unknown key (known: {', '.join(sorted(names))})")
    values = {}
    for name in names & raw.keys():
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            values[name] = _build(tp, raw[name], f"{prefix}{name}.")
        else:
            values[name] = _check_type(f"{prefix}{name}", tp, raw[name])
    return cls(**values)


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _require(ok: bool, key: str, rule: str, value: Any) -> None:
    if not ok:
        _fail(key, rule, value)


def _positive(section: Any, prefix: str, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        _require(value is None or value > 0, _key(prefix, name), "must be > 0", value)


def _non_negative(section: Any, prefix: str, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        _require(value is None or value >= 0, _key(prefix, name), "must be >= 0", value)


def _in_unit_interval(section: Any, prefix: str, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        _require(0.0 <= value <= 1.0, _key(prefix, name), "must be in [0, 1]", value)


def _is_local(path: str) -> bool:
    """A value that can only mean a local path: relative/absolute path syntax rather than a Hub 'org/name' id."""
    return path.startswith((".", "/", "~")) or path.count("/") > 1 or path.endswith((".parquet", ".csv", ".jsonl"))


def _existing_path(key: str, value: str | None, root: Path) -> None:
    """A value written like a local path must exist (a Hub id cannot be checked offline, and is not)."""
    if value is not None and _is_local(value) and not (root / Path(value).expanduser()).exists():
        _fail(key, "local path does not exist", value)


def _validate(p: Params, root: Path) -> None:
    _non_negative(p, "", "seed")

    _existing_path("data.source", p.data.source, root)
    _existing_path("model.policy", p.model.policy, root)
    _existing_path("model.tokenizer", p.model.tokenizer, root)

    pr = p.prepare
    _non_negative(pr, "prepare", "min_review_chars")
    _positive(pr, "prepare", "prompt_min_tokens", "prompt_max_tokens", "train_prompts", "eval_prompts",
              "pair_min_tokens", "pair_max_tokens", "train_pairs", "test_pairs")
    _require(pr.prompt_min_tokens <= pr.prompt_max_tokens, "prepare.prompt_min_tokens",
             f"must be <= prepare.prompt_max_tokens ({pr.prompt_max_tokens})", pr.prompt_min_tokens)
    _require(pr.pair_min_tokens <= pr.pair_max_tokens, "prepare.pair_min_tokens",
             f"must be <= prepare.pair_max_tokens ({pr.pair_max_tokens})", pr.pair_min_tokens)
    if pr.pairs_source != "imdb":
        _require(_is_local(pr.pairs_source) or Path(pr.pairs_source).suffix in (".parquet", ".jsonl"),
                 "prepare.pairs_source", "must be 'imdb' or a local .parquet/.jsonl file", pr.pairs_source)
        _existing_path("prepare.pairs_source", pr.pairs_source, root)

    s = p.sft
    if s.base != "scratch":
        _existing_path("sft.base", s.base, root)
    _positive(s, "sft", "n_layer", "n_embd", "n_head", "n_positions", "max_tokens", "block_size", "batch_size",
              "gradient_accumulation_steps", "learning_rate", "eval_reviews", "max_grad_norm")
    _non_negative(s, "sft", "weight_decay", "warmup_steps", "checkpoint_every")
    _require(0.0 <= s.dropout < 1.0, "sft.dropout", "must be in [0, 1)", s.dropout)
    _require(s.n_embd % s.n_head == 0, "sft.n_embd", f"must be divisible by sft.n_head ({s.n_head})", s.n_embd)
    if s.base == "scratch":
        _require(s.block_size <= s.n_positions, "sft.block_size",
                 f"must be <= sft.n_positions ({s.n_positions})", s.block_size)
    _require(len(s.splits) > 0, "sft.splits", "must name at least one split", s.splits)
    _require("test" not in s.splits, "sft.splits", "must not contain 'test' (held out for perplexity)", s.splits)

    r = p.reward
    if r.base not in ("sft", "scratch"):
        _existing_path("reward.base", r.base, root)
    _require(not (r.train and r.base == "sft" and not s.enabled), "reward.base",
             "is 'sft' but sft.enabled is false (enable sft or name another base)", r.base)
    _existing_path("reward.model", r.model, root)
    _positive(r, "reward", "epochs", "learning_rate", "batch_size", "max_length", "max_grad_norm")
    _non_negative(r, "reward", "center_coef", "checkpoint_every", "warmup_steps")

    o = p.ppo
    _positive(o, "ppo", "steps", "learning_rate", "batch_size", "mini_batch_size", "gradient_accumulation_steps",
              "ppo_epochs", "horizon", "cliprange", "cliprange_value", "ratio_threshold", "max_grad_norm",
              "score_clip", "response_min_tokens", "response_max_tokens", "temperature")
    _non_negative(o, "ppo", "init_kl_coef", "target", "vf_coef", "top_k", "checkpoint_every", "missing_eos_penalty")
    _in_unit_interval(o, "ppo", "gamma", "lam")
    _require(0.0 < o.top_p <= 1.0, "ppo.top_p", "must be in (0, 1]", o.top_p)
    _require(o.response_min_tokens <= o.response_max_tokens, "ppo.response_min_tokens",
             f"must be <= ppo.response_max_tokens ({o.response_max_tokens})", o.response_min_tokens)
    step = o.mini_batch_size * o.gradient_accumulation_steps
    _require(o.batch_size % step == 0, "ppo.batch_size",
             f"must be a multiple of ppo.mini_batch_size x ppo.gradient_accumulation_steps ({step})", o.batch_size)
    if s.enabled and s.base == "scratch":
        longest = pr.prompt_max_tokens + o.response_max_tokens
        _require(longest <= s.n_positions, "ppo.response_max_tokens",
                 f"prompt_max_tokens + response_max_tokens ({longest}) must fit sft.n_positions ({s.n_positions})",
                 o.response_max_tokens)

    e = p.evaluate
    _positive(e, "evaluate", "batch_size")
    _non_negative(e, "evaluate", "examples")
    for i, judge in enumerate(e.judges):
        if judge != "vader":
            _existing_path(f"evaluate.judges[{i}]", judge, root)


def parse_params(raw: Any, root: Path | str = ".") -> Params:
    """Validate a params mapping (as read from params.yaml) into ``Params``; relative paths resolve against root."""
    params = _build(Params, raw, "")
    _validate(params, Path(root))
    return params


def load_params(path: Path | str = PARAMS_FILE) -> Params:
    """Read and validate params.yaml (relative paths in it resolve against its folder)."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ParamsError(f"{path}: not found (run stages from the project root)") from None
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    return parse_params(raw, path.parent)
