"""params.yaml -> typed, validated, frozen configs: the only config source of the pipeline.

Each key is declared once below, with its type, default, constraint and doc. Every stage calls ``load_params()``
first, before any data or model is loaded. A missing or unknown key, a value of the wrong type or an impossible value
raises ``ParamsError`` with one line that names the dotted key and the rule. Which keys each stage reads is declared
once too, in ``STAGE_PARAMS`` (dvc.yaml's ``params:`` lists, the checkpoint fingerprints and ``--help`` follow it).
Overrides go through DVC (``dvc exp run -S ppo.learning_rate=1e-5``), not through a CLI layer.
"""

from __future__ import annotations

import re
import textwrap
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal

import annotated_types
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, model_validator
from pydantic.fields import FieldInfo
from ruamel.yaml import YAML, YAMLError

from stages.core.errors import ParamsError
from stages.core.paths import SPLITS, is_local

PARAMS_FILE = "params.yaml"


class Rule(ValueError):
    """A broken rule, raised inside validation and reported as ``params.yaml: <key>: <rule> (got <value>)``; ``key``
    is relative to the model that raises it ('' for the field being validated)."""

    def __init__(self, key: str, rule: str, value: Any) -> None:
        super().__init__(rule)
        self.key, self.rule, self.value = key, rule, value


def _exists_if_local(value: str, info: ValidationInfo) -> str:
    """A value written like a local path must exist under the params file's folder (a Hub id cannot be checked
    offline, and is not). Checked only when validating a params file (``parse_params`` gives the root)."""
    root = (info.context or {}).get("root")
    if root is not None and is_local(value) and not (Path(root) / Path(value).expanduser()).exists():
        raise Rule("", "local path does not exist", value)
    return value


PathOrId = Annotated[str, AfterValidator(_exists_if_local)]
"""A Hub id or a local path; a local one must exist."""


def judge_name(spec: str) -> str:
    """A stable, DVC-friendly metrics name for a scorer: 'vader', or the model's last path component, sanitized."""
    return re.sub(r"[^A-Za-z0-9_-]+", "_", Path(spec.rstrip("/")).name) or "model"


class Section(BaseModel):
    # strict: a string is never a number and a bool never an int (an int is still accepted for a float)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False,
                              use_attribute_docstrings=True)


class DataParams(Section):
    source: PathOrId = "stanfordnlp/imdb"
    """Hub dataset id, a local folder of Parquet splits, a CSV file, or an extracted aclImdb/ folder."""
    revision: str | None = None
    """Hub dataset revision (branch, tag or commit) to pin; ignored for local sources."""


class ModelParams(Section):
    policy: PathOrId = "lvwerra/gpt2-imdb"
    """Initial policy and frozen reference (Hub id or local dir), used when sft.enabled is false."""
    tokenizer: PathOrId | None = None
    """Tokenizer (Hub id or local dir); null means the policy's own."""
    revision: str | None = None
    """Hub revision pinned for every model and tokenizer loaded by id; ignored for local dirs."""
    trust_remote_code: bool = False
    """Run model code shipped inside a Hub repo. Off: only the architectures built into transformers load."""
    allow_pickle: bool = False
    """Accept pickled (.bin) checkpoints, loaded with weights_only=True. Off: safetensors only."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Training matmuls in bf16 (autocast; PPO's LM head stays fp32, TF32 on CUDA; losses and optimizer fp32) or fp32.
    auto: bf16 on CUDA and on CPUs with native bf16 matmuls (AMX / AVX-512 BF16), fp32 elsewhere."""


def _at_most(model: BaseModel, key: str, limit: str, section: str) -> None:
    if getattr(model, key) > getattr(model, limit):
        raise Rule(key, f"must be <= {section}.{limit} ({getattr(model, limit)})", getattr(model, key))


class PrepareParams(Section):
    min_review_chars: int = Field(200, ge=0)
    """Keep reviews with more than this many characters (the classic recipe's len(text) > 200)."""
    prompt_min_tokens: int = Field(2, gt=0)
    """Shortest prompt prefix, in tokens."""
    prompt_max_tokens: int = Field(8, gt=0)
    """Longest prompt prefix, in tokens; each review's length is drawn uniformly from [min, max]."""
    train_prompts: int | None = Field(None, gt=0)
    """Cap on the number of train prompts; null keeps every review that passes the filter."""
    eval_prompts: int = Field(512, gt=0)
    """Number of held-out prompts drawn from the test split."""
    pairs_source: PathOrId = "imdb"
    """'imdb' to build chosen/rejected pairs from the data source, or a local Parquet/JSONL with those columns."""
    pairs_by_rating: bool = False
    """Pair a higher star rating with a lower one (any two ratings) instead of a positive with a negative review."""
    pair_min_tokens: int = Field(8, gt=0)
    """Shortest chosen/rejected snippet, in tokens."""
    pair_max_tokens: int = Field(32, gt=0)
    """Longest chosen/rejected snippet, in tokens."""
    train_pairs: int = Field(12500, gt=0)
    """Number of training pairs (from the train split)."""
    test_pairs: int = Field(2000, gt=0)
    """Number of held-out pairs (from the test split only)."""

    @model_validator(mode="after")
    def _rules(self) -> PrepareParams:
        _at_most(self, "prompt_min_tokens", "prompt_max_tokens", "prepare")
        _at_most(self, "pair_min_tokens", "pair_max_tokens", "prepare")
        source = self.pairs_source
        if source != "imdb" and not (is_local(source) or Path(source).suffix in (".parquet", ".jsonl")):
            raise Rule("pairs_source", "must be 'imdb' or a local .parquet/.jsonl file", source)
        return self


class SftParams(Section):
    enabled: bool = False
    """Train the policy here; ppo and evaluate then use models/sft as policy and reference instead of model.policy."""
    base: PathOrId = "scratch"
    """'scratch' (a GPT-2 config from the keys below), a Hub id or a local dir to fine-tune."""
    n_layer: int = Field(6, gt=0)
    """Transformer blocks of a from-scratch model."""
    n_embd: int = Field(384, gt=0)
    """Width of a from-scratch model (a multiple of n_head)."""
    n_head: int = Field(6, gt=0)
    """Attention heads of a from-scratch model."""
    n_positions: int = Field(256, gt=0)
    """Context length of a from-scratch model; must hold block_size and prompt + response lengths."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout of a from-scratch model (residual, embedding and attention)."""
    max_tokens: int = Field(2_000_000, gt=0)
    """Training budget in tokens (steps = max_tokens // (batch_size * block_size))."""
    block_size: int = Field(128, gt=0)
    """Tokens per packed training block (reviews joined with EOS)."""
    batch_size: int = Field(32, gt=0)
    """Blocks per micro-batch."""
    gradient_accumulation_steps: int = Field(1, gt=0)
    """Micro-batches per optimizer step."""
    learning_rate: float = Field(6e-4, gt=0)
    """Peak AdamW learning rate (warmup, then cosine decay)."""
    weight_decay: float = Field(0.1, ge=0)
    """AdamW weight decay of the matrices (biases and norms: none)."""
    warmup_steps: int = Field(100, ge=0)
    """Linear warmup steps (at most half of the steps)."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient-norm clip of each optimizer step."""
    splits: list[str] = Field(["train", "unsupervised"], min_length=1)
    """Data-source splits to train on (never 'test': that is where perplexity is measured)."""
    eval_reviews: int = Field(500, gt=0)
    """Test-split reviews used for held-out perplexity."""
    checkpoint_every: int | None = Field(50, ge=0)
    """Optimizer steps per resumable checkpoint in data/checkpoints/sft/ (a rerun after a kill resumes from the
    newest); 0 or null: off."""

    @model_validator(mode="after")
    def _rules(self) -> SftParams:
        if self.n_embd % self.n_head:
            raise Rule("n_embd", f"must be divisible by sft.n_head ({self.n_head})", self.n_embd)
        if self.base == "scratch":
            _at_most(self, "block_size", "n_positions", "sft")
        if unknown := [split for split in self.splits if split not in SPLITS]:
            raise Rule("splits", f"unknown split {unknown[0]!r} (known: {', '.join(SPLITS)})", self.splits)
        if "test" in self.splits:
            raise Rule("splits", "must not contain 'test' (held out for perplexity)", self.splits)
        return self


class RewardParams(Section):
    train: bool = False
    """Train a preference reward model here; otherwise reward.model scores the responses."""
    base: PathOrId = "sft"
    """Initialisation when training: 'sft' (models/sft), 'scratch' (the sft.* shape) or a Hub id / local dir."""
    model: PathOrId = "lvwerra/distilbert-imdb"
    """Sentiment classifier whose positive logit is the reward when reward.train is false (Hub id or local dir)."""
    positive_label: str = "POSITIVE"
    """Label name of the positive class in reward.model's config (falls back to index 1 when absent)."""
    epochs: int = Field(1, gt=0)
    """Shuffled passes over the training pairs."""
    learning_rate: float = Field(5e-5, gt=0)
    """Peak AdamW learning rate (warmup, then cosine decay)."""
    batch_size: int = Field(32, gt=0)
    """Pairs per optimizer step."""
    max_length: int = Field(64, gt=0)
    """Token cap for a chosen/rejected text."""
    margin: bool = False
    """Subtract a rating-difference margin inside the Bradley-Terry loss (needs ratings in the pairs)."""
    center_coef: float = Field(0.01, ge=0)
    """Weight of mean((r_chosen + r_rejected)^2) in the loss: keeps scores centred on 0, so 'score > 0' reads as
    'more positive than the average snippet' (Eisenstein et al. 2023; TRL's center_rewards_coefficient)."""
    warmup_steps: int = Field(40, ge=0)
    """Linear warmup steps (at most half of the steps)."""
    max_grad_norm: float = Field(1.0, gt=0)
    """Gradient-norm clip of each optimizer step."""
    checkpoint_every: int | None = Field(100, ge=0)
    """Optimizer steps per resumable checkpoint in data/checkpoints/reward/ (a rerun after a kill resumes from the
    newest); 0 or null: off."""


class PpoParams(Section):
    steps: int = Field(194, gt=0)
    """PPO iterations; each samples batch_size prompts (194 x 128 is one pass over the 24,895 train prompts)."""
    learning_rate: float = Field(1.41e-5, gt=0)
    """AdamW learning rate of the policy (and value head)."""
    batch_size: int = Field(128, gt=0)
    """Samples (responses) per iteration, per process: batch_size / samples_per_prompt prompts, each answered
    samples_per_prompt times."""
    mini_batch_size: int = Field(128, gt=0)
    """Samples per forward/backward pass of the update."""
    gradient_accumulation_steps: int = Field(1, gt=0)
    """Mini-batches per optimizer step."""
    ppo_epochs: int = Field(4, gt=0)
    """Passes of the update over each batch."""
    init_kl_coef: float = Field(0.2, ge=0)
    """Initial (or, with adap_kl_ctrl false, fixed) coefficient of the KL penalty in the reward."""
    adap_kl_ctrl: bool = True
    """Adapt the KL coefficient towards target (Ziegler et al. 2019)."""
    target: float = Field(6.0, ge=0)
    """Adaptive KL controller's target KL (nats per sequence)."""
    horizon: float = Field(10000.0, gt=0)
    """Adaptive KL controller's horizon, in samples."""
    advantage_estimator: Literal["gae", "rloo", "grpo", "reinforce_pp"] = "gae"
    """gae: PPO's value head and GAE; rloo (leave-one-out baseline over each prompt's samples), grpo (reward
    normalised within each prompt's samples), reinforce_pp (REINFORCE++: discounted returns whitened over the batch):
    critic-free, no value head."""
    samples_per_prompt: int = Field(1, gt=0)
    """k: responses sampled per prompt in a batch (>= 2 for rloo and grpo, whose baseline is the prompt's other
    samples)."""
    kl_loss_coef: float = Field(0.0, ge=0)
    """grpo only: weight of GRPO's k3 KL(policy || reference) loss term (the paper: 0.04, with init_kl_coef 0 and
    adap_kl_ctrl false); 0: off."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount of GAE and of REINFORCE++'s returns."""
    lam: float = Field(0.95, ge=0, le=1)
    """Lambda of GAE."""
    cliprange: float = Field(0.2, gt=0)
    """Clip range of the policy ratio."""
    cliprange_value: float = Field(0.2, gt=0)
    """Clip range of the value prediction around its rollout value."""
    vf_coef: float = Field(0.1, ge=0)
    """Weight of the value loss."""
    kl_penalty: Literal["kl", "abs", "mse", "full", "k3"] = "kl"
    """Per-token KL estimate in the reward: kl (k1, log-ratio), abs, mse (k2), k3, or full (exact over the vocab)."""
    whiten_rewards: bool = False
    """Whiten the per-token rewards before GAE."""
    ratio_threshold: float = Field(10.0, gt=0)
    """Skip a mini-batch's update when its mean probability ratio exceeds this."""
    max_grad_norm: float | None = Field(None, gt=0)
    """Gradient-norm clip of each optimizer step (null: no clipping; the norm is still logged)."""
    use_score_scaling: bool = False
    """Divide scores by their running standard deviation."""
    use_score_norm: bool = False
    """With use_score_scaling, also subtract their running mean."""
    score_clip: float | None = Field(None, gt=0)
    """Clip the (scaled) scores to [-score_clip, score_clip] (null: off)."""
    missing_eos_penalty: float | None = Field(None, ge=0)
    """Subtracted from the score of a response that has no EOS token (null: off)."""
    response_min_tokens: int = Field(4, gt=0)
    """Shortest response; each prompt's length is drawn uniformly from [min, max]."""
    response_max_tokens: int = Field(16, gt=0)
    """Longest response, in tokens."""
    top_k: int = Field(0, ge=0)
    """Sampling: keep the k most likely tokens (0: all)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Sampling: nucleus probability mass (1: all)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (log-probabilities are taken at the same temperature)."""
    disable_dropout: bool = True
    """Switch dropout off in the policy and the reference."""
    value_model: Literal["shared", "separate"] = "shared"
    """'shared': a value head on the policy's backbone; 'separate': a critic model initialised from the policy (gae
    only)."""
    checkpoint_every: int | None = Field(10, ge=0)
    """Steps per rollout-log file and per resumable checkpoint in data/checkpoints/ppo/ (kept outside DVC's outputs,
    keyed by a fingerprint of the run; a rerun after a kill resumes from the newest). 0 or null: no checkpoints,
    rollout files of 10 steps."""
    nan_policy: Literal["stop", "skip"] = "stop"
    """On a NaN/inf score, loss or gradient: stop with a message, or skip the batch and count it."""

    @model_validator(mode="after")
    def _rules(self) -> PpoParams:
        _at_most(self, "response_min_tokens", "response_max_tokens", "ppo")
        step = self.mini_batch_size * self.gradient_accumulation_steps
        if self.batch_size % step:
            raise Rule("batch_size", f"must be a multiple of ppo.mini_batch_size x ppo.gradient_accumulation_steps "
                                     f"({step})", self.batch_size)
        self._estimator_rules()
        return self

    def _estimator_rules(self) -> None:
        estimator, k = self.advantage_estimator, self.samples_per_prompt
        if estimator in ("rloo", "grpo") and k < 2:
            raise Rule("samples_per_prompt", f"must be >= 2 with ppo.advantage_estimator {estimator} (its baseline "
                                             "is the prompt's other samples)", k)
        if self.batch_size % k:
            raise Rule("batch_size", f"must be a multiple of ppo.samples_per_prompt ({k})", self.batch_size)
        if self.kl_loss_coef > 0 and estimator != "grpo":
            raise Rule("kl_loss_coef", f"must be 0 with ppo.advantage_estimator {estimator} (a KL loss term is "
                                       "GRPO's; the others keep the KL penalty in the reward: ppo.init_kl_coef)",
                       self.kl_loss_coef)
        if self.value_model == "separate" and self.critic is None:
            raise Rule("value_model", f"must be 'shared' with ppo.advantage_estimator {estimator}, which trains no "
                                      "critic (a separate critic would never be used)", self.value_model)

    @property
    def prompts_per_step(self) -> int:
        """Prompts per iteration (per process): each is answered samples_per_prompt times."""
        return self.batch_size // self.samples_per_prompt

    @property
    def critic(self) -> Literal["shared", "separate"] | None:
        """The value model to train: value_model under gae, None for the critic-free estimators."""
        return self.value_model if self.advantage_estimator == "gae" else None

    @property
    def unused_keys(self) -> list[str]:
        """The ppo.* keys that the estimator leaves unused (the stage logs them once)."""
        unused = {"gae": [], "reinforce_pp": ["lam", "whiten_rewards"]}.get(self.advantage_estimator,
                                                                           ["gamma", "lam", "whiten_rewards"])
        if self.critic is None:
            unused = ["value_model", "vf_coef", "cliprange_value", *unused]
        return [f"ppo.{key}" for key in unused]


class EvaluateParams(Section):
    judges: list[PathOrId] = ["vader"]
    """Extra scorers: 'vader' (lexicon, no download) or any sentiment classifier (Hub id or local dir); metrics keys
    judge.<name>.* use 'vader' or the model's last path component, sanitized ('lvwerra/distilbert-imdb' ->
    'distilbert-imdb')."""
    greedy: bool = False
    """Also run a greedy-decoding pass of both models and report its scores (keys policy_greedy.*, ...)."""
    batch_size: int = Field(64, gt=0)
    """Prompts per generate/score/forward batch."""
    examples: int = Field(12, ge=0)
    """Before/after examples in the Markdown report."""

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
    seed: int = Field(0, ge=0)
    """Seed of every random generator (each output derives its own from it)."""
    data: DataParams = DataParams()
    model: ModelParams = ModelParams()
    prepare: PrepareParams = PrepareParams()
    sft: SftParams = SftParams()
    reward: RewardParams = RewardParams()
    ppo: PpoParams = PpoParams()
    evaluate: EvaluateParams = EvaluateParams()

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
        return self


# ---------------------------------------------------------------------------------------------------------------------
# which params each stage reads: dotted keys, or a section name for all of its keys

STAGE_PARAMS: dict[str, tuple[str, ...]] = {
    "prepare": ("seed", "data.source", "data.revision", "model.policy", "model.tokenizer", "model.revision",
                "model.trust_remote_code", "sft.enabled", "sft.base", "prepare"),
    "sft": ("seed", "data", "model", "sft"),
    # sft.base: the tokenizer of a from-scratch reward model (params.tokenizer_path)
    "reward": ("seed", "model", "sft.enabled", "sft.base", "sft.n_layer", "sft.n_embd", "sft.n_head",
               "sft.n_positions", "reward.train", "reward.base", "reward.epochs", "reward.learning_rate",
               "reward.batch_size", "reward.max_length", "reward.margin", "reward.center_coef",
               "reward.warmup_steps", "reward.max_grad_norm", "reward.checkpoint_every"),
    # prompt_max_tokens: ppo checks that the longest prompt plus response fits the policy's positions
    "ppo": ("seed", "model", "sft.enabled", "prepare.prompt_max_tokens", "reward.train", "reward.model",
            "reward.positive_label", "ppo"),
    "evaluate": ("seed", "model.policy", "model.tokenizer", "model.revision", "model.trust_remote_code",
                 "model.allow_pickle", "sft.enabled", "reward.train", "reward.model", "reward.positive_label",
                 "ppo.response_min_tokens", "ppo.response_max_tokens", "ppo.top_k", "ppo.top_p", "ppo.temperature",
                 "evaluate"),
}
"""What each stage reads, the one list behind dvc.yaml's ``params:`` (a test compares them), the checkpoint
fingerprints (``stage_params``) and each stage's ``--help``."""


def _section(field: FieldInfo) -> type[Section] | None:
    tp = field.annotation
    return tp if isinstance(tp, type) and issubclass(tp, Section) else None


def declaration(dotted: str) -> FieldInfo:
    """The declaration of a dotted key ('ppo.steps') or section ('ppo')."""
    model: type[Section] = Params
    *parents, last = dotted.split(".")
    for name in parents:
        model = _section(model.model_fields[name])
    return model.model_fields[last]


def dotted_keys(model: type[Section] = Params, prefix: str = "") -> list[str]:
    """Every leaf key, dotted, in declaration order ('seed', 'data.source', ...)."""
    keys = []
    for name, field in model.model_fields.items():
        section = _section(field)
        keys += dotted_keys(section, f"{prefix}{name}.") if section else [prefix + name]
    return keys


def stage_params(params: Params, stage: str, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """The values of the params ``stage`` reads, as {dotted key: value} (JSON-ready), minus ``exclude``."""
    values = {}
    for entry in STAGE_PARAMS[stage]:
        value: Any = params
        for name in entry.split("."):
            value = getattr(value, name)
        if isinstance(value, Section):
            values |= {f"{entry}.{key}": v for key, v in value.model_dump().items()}
        else:
            values[entry] = value
    return {key: value for key, value in values.items() if key not in set(exclude)}


def describe_params(stage: str) -> str:
    """``stage``'s params, one entry each with its doc, wrapped (for ``--help``)."""
    entries = []
    for entry in STAGE_PARAMS[stage]:
        field = declaration(entry)
        section = _section(field)
        doc = ("every key: " + ", ".join(section.model_fields) if section
               else " ".join((field.description or "").split()))
        entries.append(textwrap.fill(doc, 119, initial_indent=f"  {entry:<28}", subsequent_indent=" " * 30))
    return "\n".join(entries)


# ---------------------------------------------------------------------------------------------------------------------
# reading and error messages


def read_yaml(path: Path | str) -> Any:
    """A YAML file as DVC reads it (see ``parse_yaml``). Every YAML the stages and the recipe runners read goes
    through here."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ParamsError(f"{path}: not found (run from the project root)") from None
    return parse_yaml(text, str(path))


def parse_yaml(text: str, where: str) -> Any:
    """YAML text as DVC reads params (ruamel.yaml's safe loader; DVC writes ``-S`` values back with ruamel too): YAML
    1.2, so ``1e-5``, ``5e-05``, ``3E-4``, ``.5`` and ``1_000`` are numbers, a quoted ``'5e-05'`` stays a string, and
    ``yes``/``on`` are strings, not booleans. ``where`` names the text in the one-line error."""
    try:
        return YAML(typ="safe").load(text)
    except YAMLError as e:
        problem, mark = getattr(e, "problem", None), getattr(e, "problem_mark", None)
        line = f"line {mark.line + 1}: " if mark is not None else ""
        raise ParamsError(f"{where}: not valid YAML: {line}{problem or str(e).strip().splitlines()[0]}") from None


def _check_keys(raw: Any, model: type[Section], prefix: str = "") -> None:
    """Unknown keys, then missing ones: params.yaml is DVC's cache key, so every key must be written out (a key left
    to the code's default would change results without DVC noticing)."""
    if not isinstance(raw, dict):
        return  # validation names the wrong type
    known = model.model_fields
    for key in raw:
        if key not in known:
            raise ParamsError(f"params.yaml: {prefix}{key}: unknown key (known: {', '.join(sorted(known))})")
    for name, field in known.items():
        if name not in raw:
            default = "a section" if _section(field) else f"default: {field.default!r}"
            raise ParamsError(f"params.yaml: {prefix}{name}: missing (params.yaml is the DVC cache key: every key "
                              f"must be written out; {default})")
        if section := _section(field):
            _check_keys(raw[name], section, f"{prefix}{name}.")


def _range(field: FieldInfo) -> str:
    """'must be > 0', 'must be in [0, 1)' from a field's declared bounds."""
    low = high = None
    for bound in field.metadata:
        if isinstance(bound, annotated_types.Gt | annotated_types.Ge):
            low = ("(", bound.gt) if isinstance(bound, annotated_types.Gt) else ("[", bound.ge)
        elif isinstance(bound, annotated_types.Lt | annotated_types.Le):
            high = (")", bound.lt) if isinstance(bound, annotated_types.Lt) else ("]", bound.le)
    if low and high:
        return f"must be in {low[0]}{low[1]:g}, {high[1]:g}{high[0]}"
    if low:
        return f"must be {'>' if low[0] == '(' else '>='} {low[1]:g}"
    return f"must be {'<' if high[0] == ')' else '<='} {high[1]:g}"


def _quoted_number_hint(value: Any, number: tuple[type, ...]) -> str:
    """' (a string): write it without quotes' when ``value`` is a quoted spelling of the wanted kind of number."""
    try:
        unquoted = parse_yaml(value, "") if isinstance(value, str) else None
    except ParamsError:
        return ""
    ok = isinstance(unquoted, number) and not isinstance(unquoted, bool)
    return " (a string): write it without quotes" if ok else ""


TYPE_RULES = {"int_type": "must be an integer", "float_type": "must be a number", "bool_type": "must be a bool",
              "string_type": "must be a str", "model_type": "must be a mapping",
              "finite_number": "must be a finite number", "too_short": "must not be empty"}


def _message(error: dict[str, Any]) -> str:
    """One pydantic error as ``params.yaml: <dotted key>: <rule> (got <value>)``."""
    loc, value, kind = error["loc"], error["input"], error["type"]
    names = [part for part in loc if isinstance(part, str)]
    key = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    field = declaration(".".join(names)) if names else None
    hint = ""
    if kind == "value_error" and isinstance(error["ctx"]["error"], Rule):
        rule_error = error["ctx"]["error"]
        key = ".".join(filter(None, [key, rule_error.key]))
        rule, value = rule_error.rule, rule_error.value
    elif kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        rule = _range(field)
    elif kind == "literal_error":
        rule = "must be one of " + ", ".join(map(str, typing.get_args(field.annotation)))
    elif kind == "list_type":
        (item,) = typing.get_args(field.annotation)
        rule = f"must be a list of {typing.get_args(item)[0].__name__ if typing.get_args(item) else item.__name__}"
    elif kind in TYPE_RULES:
        rule = TYPE_RULES[kind]
        if kind in ("int_type", "float_type"):
            hint = _quoted_number_hint(value, (int,) if kind == "int_type" else (int, float))
    else:
        rule = error["msg"][0].lower() + error["msg"][1:]
    return f"params.yaml: {key + ': ' if key else ''}{rule} (got {value!r}{hint})"


def parse_params(raw: Any, root: Path | str = ".") -> Params:
    """Validate a params mapping (as read from params.yaml) into ``Params``; relative paths resolve against root."""
    raw = {} if raw is None else raw
    _check_keys(raw, Params)
    try:
        return Params.model_validate(raw, context={"root": Path(root)})
    except ValidationError as e:
        raise ParamsError(_message(e.errors()[0])) from None


def load_params(path: Path | str = PARAMS_FILE) -> Params:
    """Read and validate params.yaml (relative paths in it resolve against its folder)."""
    path = Path(path)
    return parse_params(read_yaml(path), path.parent)
