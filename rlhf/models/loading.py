"""The one way every stage loads a tokenizer or a model: a Hub id or a local dir, safetensors, no remote code.

Stage scripts never call ``from_pretrained`` themselves. ``what`` arguments name the params key the path came
from, so a failure reads ``model.policy: ...`` and the user knows which line of params.yaml to fix.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from rlhf.models.hub import unreachable_hub_id
from rlhf.models.lora import add_lora, merge_adapters
from rlhf.pipeline.errors import ModelError
from rlhf.pipeline.io import atomic_path
from rlhf.pipeline.params import InitialPolicy
from rlhf.pipeline.paths import is_local
from rlhf.pipeline.sections import ModelParams

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# transformers' model classes are imported where a model loads: its modeling layer costs seconds of CPU at import,
# in every stage process, and the stages that load only a tokenizer (prepare, tokenize) never need it

log = logging.getLogger(__name__)

PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
SAFE_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
FAST_GELU = "gelu_pytorch_tanh"
def source(name: str, what: str, model_folder: bool = False) -> Path | None:
    """Where ``name`` is (paths.is_local decides): its local folder, which must exist (and, ``model_folder``, hold a
    config.json), or None for a Hub id, which must be reachable (one request, no retries) or in the Hub cache."""
    if not is_local(name):
        if (reason := unreachable_hub_id(name, "model")) is not None:
            raise ModelError(f"{what}: {name}: no such local path, and not reachable as a Hub id ({reason})")
        return None
    folder = Path(name).expanduser()
    if not folder.is_dir():
        raise ModelError(f"{what}: {name}: no such directory")
    if model_folder and not (folder / "config.json").exists():
        raise ModelError(f"{what}: {name}: not a model folder (no config.json)")
    return folder


def load_kwargs(folder: Path | None, model: ModelParams) -> dict[str, Any]:
    """from_pretrained's arguments from the model settings: the revision pins a Hub id only."""
    kwargs: dict[str, Any] = {"trust_remote_code": model.trust_remote_code}
    if folder is None and model.revision is not None:
        kwargs["revision"] = model.revision
    return kwargs


def safetensors_problem(file: Path) -> str | None:
    """Why a .safetensors file cannot be whole (None: its size is what its header describes): an 8-byte header
    length, the JSON header, then the tensors, which end where the header's last data offset says."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, not even a header"
        length = int.from_bytes(head, "little")
        if 8 + length > size:
            return f"{size} bytes, less than its {length}-byte header"
        try:
            header = json.loads(f.read(length))
            end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"),
                      default=0)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            return "unreadable header"
    expected = 8 + length + end
    return None if size == expected else f"{size} bytes, its header describes {expected}"


def check_weights(folder: Path, what: str, allow_pickle: bool) -> None:
    """A local model's weights: safetensors, or pickled ones (pytorch_model.bin) only with model.allow_pickle; a
    truncated or empty weights file fails here, naming the file, not deep inside the loader."""
    has_safe = any((folder / f).exists() for f in SAFE_WEIGHTS)
    has_pickle = any((folder / f).exists() for f in PICKLED_WEIGHTS)
    if not has_safe and has_pickle and not allow_pickle:
        raise ModelError(
            f"{what}: {folder}: only pickled weights (pytorch_model.bin), which can run arbitrary code when loaded; "
            "convert to safetensors or set model.allow_pickle: true to load them with weights_only=True"
        )
    if not has_safe and not has_pickle:
        raise ModelError(f"{what}: {folder}: no weights found (expected model.safetensors)")
    for file in sorted(folder.glob("model*.safetensors")):
        if (problem := safetensors_problem(file)) is not None:
            raise ModelError(f"{what}: {file} is truncated or corrupt ({problem})")


def load_tokenizer(name: str, model: ModelParams, what: str = "model.tokenizer",
                   padding_side: str | None = "left") -> PreTrainedTokenizerBase:
    """Load a tokenizer; give it a pad token (EOS, as the classic recipe does) when it has none.

    ``padding_side`` defaults to left (generation); None keeps the tokenizer's own.
    """
    folder = source(name, what)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, **load_kwargs(folder, model))
    except (OSError, ValueError) as e:
        reason = " ".join(str(e).split())  # the whole reason on one line: its first line can end mid-sentence
        raise ModelError(f"{what}: cannot load a tokenizer from {name!r}: {reason}") from None
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(f"{what}: {name}: the tokenizer has neither a pad nor an EOS token")
        log.info("tokenizer %s has no pad token; padding with EOS (id %d)", name, tokenizer.eos_token_id)
        tokenizer.pad_token = tokenizer.eos_token
    if padding_side is not None:
        tokenizer.padding_side = padding_side
    return tokenizer


def fast_activations(model: PreTrainedModel) -> PreTrainedModel:
    """Swap transformers' Python tanh-GELU (``gelu_new``: GPT-2's, five elementwise kernels and four temporaries)
    for torch's fused kernel of the same formula (``gelu_pytorch_tanh``); the outputs agree to float rounding. The
    config says so too, so a saved model reloads with the very kernel it was trained with. Returns ``model``."""
    from transformers.activations import ACT2FN, NewGELUActivation

    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, NewGELUActivation):
                setattr(module, name, ACT2FN[FAST_GELU])
    for key in ("activation_function", "hidden_act"):
        if getattr(model.config, key, None) == "gelu_new":
            setattr(model.config, key, FAST_GELU)
    return model


OTHER_TASKS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering", "ForMultipleChoice")


def _from_pretrained(auto_cls: Any, name: str, model: ModelParams, what: str, new_head: bool = False,
                     **kwargs: Any) -> PreTrainedModel:
    """``auto_cls.from_pretrained``, every weight of the model from the checkpoint: transformers would start the ones
    it lacks or whose shape differs at random, with a warning; only a ``new_head`` (a reward model's score head on a
    base) may be new. Weights load in fp32 whatever dtype they were saved in (unless ``dtype`` says otherwise):
    training keeps fp32 weights (bf16 only under autocast), and a half-precision policy beside its fp32 value head
    failed mid-step."""
    kwargs.setdefault("dtype", torch.float32)
    if (folder := source(name, what, model_folder=True)) is not None:
        check_weights(folder, what, model.allow_pickle)
    verbosity = hf_logging.get_verbosity()
    # transformers' load report (a table of missing, unexpected and mismatched tensors) is silenced: what of it
    # matters is checked below from the loading info, in one line; a mismatch is reported there, not raised after it
    hf_logging.set_verbosity_error()
    try:
        loaded, info = auto_cls.from_pretrained(
            name, use_safetensors=None if model.allow_pickle else True, output_loading_info=True,
            ignore_mismatched_sizes=True, **load_kwargs(folder, model), **kwargs
        )
    except (OSError, ValueError, KeyError, SafetensorError) as e:
        raise ModelError(f"{what}: cannot load a model from {name!r}: {str(e).splitlines()[0]}") from None
    finally:
        hf_logging.set_verbosity(verbosity)

    def expected(key: str) -> bool:
        return new_head and not key.startswith(loaded.base_model_prefix)

    mismatched = sorted((key, tuple(saved), tuple(shape)) for key, saved, shape in info["mismatched_keys"]
                        if not expected(key))
    if mismatched:
        key, saved, shape = mismatched[0]
        raise ModelError(f"{what}: {name}: its weights do not fit its config: {key} is {saved} in the weights, "
                         f"{shape} in the model ({len(mismatched)} such tensors): a config.json of another model")
    missing = sorted(key for key in info["missing_keys"] if not expected(key))
    if missing:
        raise ModelError(f"{what}: {name}: its weights lack {len(missing)} of the model's tensors ({missing[0]}, "
                         "...), which would start random: a truncated or mismatched checkpoint")
    return fast_activations(loaded)


def load_config(name: str, model: ModelParams, what: str) -> PretrainedConfig:
    """A model's config alone (what it is, how many outputs), to check it before loading its weights."""
    folder = source(name, what, model_folder=True)
    try:
        return AutoConfig.from_pretrained(name, **load_kwargs(folder, model))
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"{what}: cannot load a model config from {name!r}: {str(e).splitlines()[0]}") from None


def load_causal_lm(name: str, model: ModelParams, what: str = "model.policy",
                   dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load a causal LM (policy, reference, SFT base); a model saved for another task (a classifier, whose backbone
    loads into an LM head without a word) is refused."""
    from transformers import AutoModelForCausalLM

    lm = _from_pretrained(AutoModelForCausalLM, name, model, what, dtype=dtype)
    saved = lm.config.architectures or []
    if saved and all(arch.endswith(OTHER_TASKS) for arch in saved):
        raise ModelError(f"{what}: {name}: a {saved[0]}, not a causal LM")
    return lm


def load_sequence_classifier(name: str, model: ModelParams, what: str = "reward.model", new_head: bool = False,
                             **kwargs: Any) -> PreTrainedModel:
    """Load a sequence classifier (sentiment scorer, reward model, judge; ``new_head``: a reward model's base, whose
    score head is new); ``kwargs`` go to from_pretrained."""
    from transformers import AutoModelForSequenceClassification

    return _from_pretrained(AutoModelForSequenceClassification, name, model, what, new_head, **kwargs)


def check_vocab_match(tokenizer: PreTrainedTokenizerBase, lm: PreTrainedModel, what: str) -> None:
    """A tokenizer whose ids run past the model's embedding table would index out of range mid-training."""
    n_embed = lm.get_input_embeddings().num_embeddings
    if len(tokenizer) > n_embed:
        raise ModelError(
            f"{what}: the tokenizer has {len(tokenizer)} tokens but the model's embedding has only {n_embed} rows "
            "(tokenizer and model do not belong together)"
        )


def tokenizer_key(initial: InitialPolicy) -> str:
    """What messages call the initial policy's tokenizer: model.tokenizer where it is not the policy's own."""
    return initial.what if initial.path == initial.tokenizer else "model.tokenizer"


def initial_tokenizer(initial: InitialPolicy, model: ModelParams) -> PreTrainedTokenizerBase:
    """The initial policy's tokenizer; beside models/sft, a model.tokenizer set must be that same tokenizer (one that
    is not would be ignored)."""
    tokenizer = load_tokenizer(initial.tokenizer, model, what=tokenizer_key(initial))
    if initial.same_tokenizer:
        named = load_tokenizer(initial.same_tokenizer, model, what="model.tokenizer")
        if named.get_vocab() != tokenizer.get_vocab():
            raise ModelError(f"model.tokenizer: {initial.same_tokenizer} is not the tokenizer {initial.path} was "
                             "trained with (rerun the sft stage)")
    return tokenizer


def load_initial_policy(initial: InitialPolicy, model: ModelParams
                        ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The initial policy (also the frozen reference) and its tokenizer, checked against each other."""
    tokenizer = initial_tokenizer(initial, model)
    lm = load_causal_lm(initial.path, model, what=initial.what)
    check_vocab_match(tokenizer, lm, tokenizer_key(initial))
    return lm, tokenizer


def load_trainable_policy(initial: InitialPolicy, model: ModelParams
                          ) -> tuple[PreTrainedModel, PreTrainedModel | None, PreTrainedTokenizerBase]:
    """The initial policy to train, its frozen reference and their tokenizer. With model.lora.r > 0 the policy trains
    rank-r adapters and the reference is None: the policy with its adapters off (one copy of the weights)."""
    lm, tokenizer = load_initial_policy(initial, model)
    if model.lora.r:
        return add_lora(lm, model.lora), None, tokenizer
    return lm, load_causal_lm(initial.path, model, what=initial.what), tokenizer


def context_size(lm: PreTrainedModel) -> int:
    """How many positions the model can attend over (GPT-2: n_positions; most others: max_position_embeddings)."""
    config = lm.config
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None) or 10**9


def save_pretrained(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path,
                    extra: Callable[[Path], None] | None = None,
                    state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """``folder``, replaced in one rename: the model (or its ``state_dict``) and its tokenizer, loadable by
    from_pretrained, and whatever ``extra(tmp)`` writes beside them. LoRA adapters are merged into the weights first,
    in ``model`` itself: saved unmerged, their base layers' weights would be written under names from_pretrained does
    not know."""
    merge_adapters(model)
    with atomic_path(folder) as tmp:
        model.save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        if extra is not None:
            extra(tmp)
