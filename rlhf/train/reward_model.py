"""A preference reward model: a one-output sequence classifier trained with the Bradley-Terry loss.

The score is read at the last non-pad token (GPT-style classifiers) of ``text``; chosen and rejected texts of a
minibatch go through one forward pass.
"""

from __future__ import annotations

import pandas as pd
import torch
import torch.nn.functional as F
from transformers import GPT2ForSequenceClassification, PreTrainedModel, PreTrainedTokenizerBase

from rlhf.models.loading import load_config, load_sequence_classifier, load_tokenizer
from rlhf.models.precision import autocast
from rlhf.pipeline.errors import ModelError
from rlhf.pipeline.params import Params
from rlhf.pipeline.paths import PAIRS_DIR, SFT_DIR
from rlhf.train import checkpoint
from rlhf.train.batches import ShuffledBatches
from rlhf.train.fit import FitPlan, FitResult, fit
from rlhf.train.sft import scratch_model

MARGIN_PER_STAR = 0.1  # with reward.margin, chosen must beat rejected by 0.1 per star of rating difference


def init_paths(params: Params) -> tuple[str | None, str, str]:
    """(model to start from or None for scratch, tokenizer, params key) for reward.base."""
    r = params.reward
    if r.base == "sft":
        return str(SFT_DIR), str(SFT_DIR), "reward.base"
    if r.base == "scratch":
        return None, params.tokenizer_path, "model.tokenizer"
    return r.base, params.model.tokenizer or r.base, "reward.base"


def build(params: Params) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The classifier (num_labels=1, a pad token id set) and its tokenizer, right-padded."""
    path, tokenizer_path, what = init_paths(params)
    tokenizer = load_tokenizer(tokenizer_path, params.model, what=what, padding_side="right")
    if path is None:
        model = scratch_model(params.sft, len(tokenizer), tokenizer.eos_token_id, GPT2ForSequenceClassification,
                              num_labels=1, pad_token_id=tokenizer.pad_token_id)
    else:
        check_reward_base(path, params, what)
        model = load_sequence_classifier(path, params.model, what=what, new_head=True, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def check_reward_base(path: str, params: Params, what: str) -> None:
    """The reward model is ``path`` with a one-output score head: a causal LM gets a new one, a classifier must
    already have exactly one (its head cannot be reshaped)."""
    config = load_config(path, params.model, what)
    is_classifier = any(arch.endswith("ForSequenceClassification") for arch in config.architectures or [])
    if is_classifier and config.num_labels != 1:
        raise ModelError(f"{what}: {path}: a sequence classifier with {config.num_labels} outputs; reward.base must "
                         "be 'sft', 'scratch', a causal LM (it gets a one-output score head) or a one-output reward "
                         "model")


def scores(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, texts: list[str], max_length: int,
           device: torch.device, precision: str = "fp32") -> torch.Tensor:
    """(N,) reward of each text (one forward; grad flows when enabled by the caller); ``precision`` as
    ``model.precision`` (training passes it; held-out scores are fp32)."""
    batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt").to(device)
    with autocast(device, precision):
        return model(**batch).logits[:, 0].float()


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None,
                       center_coef: float = 0.0) -> torch.Tensor:
    """-log sigma(r_chosen - r_rejected [- margin]) + center_coef * (r_chosen + r_rejected)^2, averaged over pairs.

    The Bradley-Terry likelihood only sees differences, so the scores' zero is arbitrary; the centring term pins it
    to the middle of the pairs.
    """
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin
    return (-F.logsigmoid(diff) + center_coef * (chosen + rejected).square()).mean()


def run_fingerprint(params: Params) -> str:
    """What determines a reward run: the params the stage reads (not the checkpoint interval) and its inputs."""
    path, tokenizer, _ = init_paths(params)
    return checkpoint.fingerprint("reward", params, [p for p in (PAIRS_DIR, path, tokenizer) if p],  # path: None
                                  exclude=("reward.checkpoint_every",))  # from scratch


def train(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, pairs: pd.DataFrame, params: Params,
          device: torch.device, generator: torch.Generator) -> FitResult:
    """Bradley-Terry training, ``reward.epochs`` passes over the pairs, each in a fresh order drawn from
    ``generator`` (its full batches; with reward.checkpoint_every, a rerun after a kill resumes to the same result)."""
    r = params.reward
    rating_gap = (pairs.get("chosen_rating", 0) - pairs.get("rejected_rating", 0)).clip(lower=0)

    def loss(order: torch.Tensor) -> torch.Tensor:
        idx = order.numpy()
        texts = pairs["chosen"].iloc[idx].tolist() + pairs["rejected"].iloc[idx].tolist()
        both = scores(model, tokenizer, texts, r.max_length, device, params.model.precision)
        margin = (torch.tensor(rating_gap.iloc[idx].to_numpy(), dtype=torch.float32, device=device)
                  * MARGIN_PER_STAR if r.margin else None)
        return bradley_terry_loss(both[: len(idx)], both[len(idx):], margin, r.center_coef)

    plan = FitPlan("reward", r.epochs * (len(pairs) // r.batch_size), r.learning_rate, r.warmup_steps,
                   r.max_grad_norm, checkpoint_every=r.checkpoint_every,
                   fingerprint=run_fingerprint(params) if r.checkpoint_every else None)
    return fit(model, model.parameters(), loss, ShuffledBatches(len(pairs), r.batch_size, generator), plan)


@torch.no_grad()
def evaluate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, pairs: pd.DataFrame, max_length: int,
             device: torch.device, batch_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen scores, rejected scores) of held-out pairs."""
    model.eval()
    chosen, rejected = [], []
    for i in range(0, len(pairs), batch_size):
        part = pairs.iloc[i: i + batch_size]
        chosen.append(scores(model, tokenizer, part["chosen"].tolist(), max_length, device).cpu())
        rejected.append(scores(model, tokenizer, part["rejected"].tolist(), max_length, device).cpu())
    return torch.cat(chosen), torch.cat(rejected)
