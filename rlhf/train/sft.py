"""Causal-LM training on IMDb text: packed blocks, next-token loss (trained by rlhf/train/fit.py), perplexity."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedModel, PreTrainedTokenizerBase

from rlhf.models.loading import context_size, fast_activations, load_causal_lm
from rlhf.models.lora import add_lora
from rlhf.models.precision import autocast, head_logits, mixed_precision, to_device
from rlhf.pipeline.errors import DataError, ModelError, ParamsError
from rlhf.pipeline.params import Params
from rlhf.pipeline.paths import TOKENS_DIR
from rlhf.pipeline.sections import SftParams
from rlhf.rl.logprobs import cross_entropy
from rlhf.train import checkpoint
from rlhf.train.batches import RandomBatches
from rlhf.train.compiled import CompiledStep, compiles, saved_state
from rlhf.train.fit import FitPlan, FitResult, fit

log = logging.getLogger(__name__)


def build_model(params: Params, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A from-scratch GPT-2 of the sft.* shape, or the sft.base checkpoint to fine-tune, with LoRA adapters where
    model.lora.r > 0 (a from-scratch model trains every weight: a random init has nothing to adapt)."""
    s, lora = params.sft, params.model.lora
    if s.base == "scratch":
        if lora.r:
            log.info("sft: sft.base is scratch, so every weight trains (model.lora.r adapts pretrained models)")
        return scratch_model(s, len(tokenizer), tokenizer.eos_token_id)
    lm = load_causal_lm(s.base, params.model, what="sft.base")
    if s.block_size > context_size(lm):
        raise ModelError(f"sft.block_size: {s.block_size} exceeds sft.base's {context_size(lm)} positions")
    return add_lora(lm, lora) if lora.r else lm


def scratch_model(s: SftParams, vocab_size: int, eos_token_id: int, head: type[PreTrainedModel] = GPT2LMHeadModel,
                  **config: Any) -> PreTrainedModel:
    """A randomly initialised GPT-2 of the sft.* shape: the sft stage's LM, or (``head``, ``config``: e.g.
    GPT2ForSequenceClassification, num_labels=1) the reward stage's model from scratch. Its attention is SDPA's,
    which without a padding mask runs as ``is_causal`` with no mask tensor: on CUDA in bf16, the flash kernels."""
    gpt2 = GPT2Config(
        vocab_size=vocab_size, n_positions=s.n_positions, n_embd=s.n_embd, n_layer=s.n_layer, n_head=s.n_head,
        resid_pdrop=s.dropout, embd_pdrop=s.dropout, attn_pdrop=s.dropout,
        bos_token_id=eos_token_id, eos_token_id=eos_token_id, attn_implementation="sdpa", **config,
    )
    return fast_activations(head(gpt2))


def pack(stream: np.ndarray, block_size: int, what: str) -> torch.Tensor:
    """(N, block_size) blocks of a token stream (rlhf/data/tokens.py's), the tokens past the last whole block left
    out; ``what`` names the stream when it holds less than one block."""
    n_blocks = len(stream) // block_size
    if n_blocks == 0:
        raise DataError(f"{what} holds {len(stream)} tokens, fewer than one sft.block_size={block_size}")
    return torch.from_numpy(stream[: n_blocks * block_size].astype(np.int64)).view(n_blocks, block_size)


def label_blocks(labels: np.ndarray, s: SftParams) -> torch.Tensor | None:
    """The training tokens' review labels packed as their blocks are, where sft.sentiment_coef trains on them (None:
    off); with no labelled review among them, an error before any model loads."""
    if not s.sentiment_coef:
        return None
    if not (labels >= 0).any():
        raise ParamsError(f"sft.sentiment_coef: {s.sentiment_coef} needs labelled reviews, and sft.splits "
                          f"({', '.join(s.splits)}) hold none; set it to 0 or train on a labelled split",
                          "sft.sentiment_coef")
    return pack(labels, s.block_size, "the training labels")


def review_label_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean logistic loss of per-token sentiment ``logits`` against their review's ``labels`` (1 positive, 0
    negative), over the labelled tokens only (-1: unlabelled; none labelled: 0)."""
    labelled = labels >= 0
    losses = F.binary_cross_entropy_with_logits(logits.float(), labels.clamp(min=0).float(), reduction="none")
    return (losses * labelled).sum() / labelled.sum().clamp(min=1)  # no boolean indexing: static shapes to compile


def next_token_loss(lm: PreTrainedModel, batch: torch.Tensor, precision: str = "fp32",
                    labels: torch.Tensor | None = None, sentiment_coef: float = 0.0) -> torch.Tensor:
    """Mean -log p(token | the tokens before it) over every token of the (B, T) blocks but the first of each; with
    ``labels`` (B, T), plus ``sentiment_coef`` x ``review_label_loss`` of ``lm.sentiment_head`` on every position's
    last hidden state (sft.sentiment_coef).

    The LM head runs on the T - 1 positions that predict a token, under ``model.precision``'s autocast (bf16
    logits under bf16). Eagerly, ``logprobs.cross_entropy`` takes them without an (N, V) fp32 copy: Hugging Face's own
    loss upcasts all T positions' logits and keeps several such copies, 40% of a CPU training step at the offline-cpu
    shape (BENCHMARKS.md). Under torch.compile (``compiled_loss``) it is the plain cross-entropy, which the compiler
    fuses into a few passes over the logits with no fp32 copy either (its row-chunk loop would only split them).
    """
    with autocast(batch.device, precision):
        # use_cache (GPT-2's default; the cache only holds what backward keeps anyway): without a cache, transformers
        # checks the positions for packed sequences, a host wait per forward eagerly and, under torch.compile, a mask
        # tensor in place of is_causal, which rules out SDPA's flash kernels
        hidden = lm.base_model(input_ids=batch, use_cache=True).last_hidden_state
        logits = head_logits(lm.get_output_embeddings(), hidden[:, :-1])  # (B, T - 1, V)
        sentiment = None if labels is None else lm.sentiment_head(hidden).squeeze(-1)
    if torch.compiler.is_compiling():
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
    else:
        loss = cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    return loss if sentiment is None else loss + sentiment_coef * review_label_loss(sentiment, labels)


def compiled_step(params: Params, device: torch.device) -> CompiledStep | None:
    """The training step's compiled state where sft.compile compiles it on ``device`` (None: eager); an sft.compile
    of true that cannot run here is an error, raised before anything trains."""
    if not compiles(params.sft.compile, device, "sft.compile"):
        return None
    return CompiledStep("sft.compile", params.sft.compile,
                        "bf16" if mixed_precision(device, params.model.precision) else "fp32")


def compiled_loss(step: CompiledStep, trained: list[torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``next_token_loss`` under torch.compile, whose backward is compiled with it: one graph (no break), its
    elementwise work (LayerNorm, GELU, residual adds, the loss) fused into few kernels. Shapes are static (every
    micro-batch is sft.batch_size x sft.block_size): one compilation, on the first step, whose forward and backward
    ``step`` checks against the eager step's loss (the gradients of ``trained`` and the RNGs put back after); that
    first micro-batch's loss is the eager one, and so is every later one where the check failed."""
    compiled = torch.compile(next_token_loss, fullgraph=True, dynamic=False)

    def loss(lm: PreTrainedModel, batch: torch.Tensor, precision: str, *sentiment: Any) -> torch.Tensor:
        # model.precision's auto resolved out here: its CPU probe is a call torch.compile cannot trace
        resolved = "bf16" if mixed_precision(batch.device, precision) else "fp32"
        if step.compiled is None:
            def compiled_run() -> torch.Tensor:
                value = compiled(lm, batch, resolved, *sentiment)
                value.backward()  # compiles the backward too, inside the check
                return value

            return step.first_use(compiled_run, lambda: next_token_loss(lm, batch, resolved, *sentiment),
                                  lambda value: {"loss": value.item()}, lambda: saved_state(trained))
        run = compiled if step.compiled else next_token_loss
        return run(lm, batch, resolved, *sentiment)

    return loss


@torch.no_grad()
def perplexity(lm: PreTrainedModel, blocks: torch.Tensor, batch_size: int, device: torch.device) -> float:
    """exp(mean next-token loss over every predicted token of the blocks)."""
    lm.eval()
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0  # summed on the device: one read at the end
    for i in range(0, len(blocks), batch_size):
        batch = to_device(blocks[i: i + batch_size], device)
        loss = next_token_loss(lm, batch)  # fp32: a metric, not worth bf16's rounding
        n = batch.numel() - len(batch)  # the first token of each block is never predicted
        total, count = total + loss.double() * n, count + n
    return math.exp(total.item() / count)


def run_fingerprint(params: Params) -> str:
    """What determines an sft run: the params the stage reads (not its checkpoint interval) and the local inputs: the
    token ids it trains on (not data.source, which the tokenize stage read), the tokenizer and the models."""
    inputs = [str(TOKENS_DIR), params.model.tokenizer or "", params.model.policy, params.sft.base]
    # compiled and eager steps train alike (a run's first-use check holds them to it): either resumes the other
    return checkpoint.fingerprint("sft", params, [p for p in inputs if p],
                                  exclude=("sft.checkpoint_every", "sft.compile"))


def tokens_per_step(s: SftParams) -> int:
    return s.batch_size * s.block_size * s.gradient_accumulation_steps


def train(lm: PreTrainedModel, blocks: torch.Tensor, params: Params, device: torch.device,
          generator: torch.Generator, step: CompiledStep | None = None,
          labels: torch.Tensor | None = None) -> FitResult:
    """Next-token training on blocks drawn at random (from ``generator``) until the sft.max_tokens budget is spent;
    ``step``: the compiled step's state (``compiled_step``; None: eager). With sft.sentiment_coef, ``labels`` are
    the blocks' tokens' review labels, predicted by a linear head trained alongside and dropped at the end.

    Weight decay applies to the matrices only (not to biases and LayerNorm gains); with sft.checkpoint_every, a
    rerun after a kill resumes to the same result (rlhf/train/fit.py).
    """
    s = params.sft
    if s.sentiment_coef:
        lm.sentiment_head = torch.nn.Linear(lm.config.hidden_size, 1).to(device)
    trained = [p for p in lm.parameters() if p.requires_grad]  # every one but a LoRA model's frozen base
    decay = [p for p in trained if p.dim() >= 2]
    no_decay = [p for p in trained if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]

    step_loss = next_token_loss
    if step is not None:
        log.info("sft: the training step compiles in its first call (sft.compile: %s)", s.compile)
        step_loss = compiled_loss(step, trained)

    def loss(idx: torch.Tensor) -> torch.Tensor:
        batch = to_device(blocks[idx], device)
        if not s.sentiment_coef:
            return step_loss(lm, batch, params.model.precision)
        return step_loss(lm, batch, params.model.precision, to_device(labels[idx], device), s.sentiment_coef)

    plan = FitPlan("sft", s.max_tokens // tokens_per_step(s), s.learning_rate, s.warmup_steps,
                   s.max_grad_norm, s.gradient_accumulation_steps, betas=(0.9, 0.95),
                   checkpoint_every=s.checkpoint_every, fingerprint=run_fingerprint(params) if s.checkpoint_every
                   else None)
    result = fit(lm, groups, loss, RandomBatches(len(blocks), s.batch_size, generator), plan)
    if s.sentiment_coef:
        del lm.sentiment_head
    return result
