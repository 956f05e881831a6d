"""The PPO actor-critic: a causal LM plus a scalar value head, on the LM's own backbone or on a separate critic, or
the LM alone for the critic-free estimators."""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from rlhf.models.loading import save_pretrained
from rlhf.models.precision import full_precision, head_grad_dtype, head_logits, head_precision
from rlhf.rl.logprobs import Reference, TokenStats, head_stats

VALUE_HEAD_FILE = "value_head.safetensors"
VALUE_PARAMS = ("v_head.", "critic.")  # the value head's and a separate critic's parameters: their own lr and file


def disable_dropout(model: nn.Module) -> None:
    """PPO's ratio must be 1 for an unchanged model: dropout would make two forward passes disagree."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


class PolicyWithValueHead(nn.Module):
    """``forward`` returns the ``TokenStats`` (log-probs, entropies, with a reference its exact KL) and values (B, R)
    of the response tokens of ``query_responses``.

    ``value_model`` (ppo.critic): 'shared' puts the value head on the LM's backbone, 'detached' too but with the
    backbone's output detached (the value loss trains the head alone), 'separate' on a copy of the backbone,
    'reward' on ``reward_model``'s (a one-output classifier of the policy's tokenizer), its score head the value
    head's start; None builds no value head at all (no weights, no optimizer state) and ``forward`` returns values
    None.
    Only the positions that predict response tokens go through the LM head: on a 50k vocabulary the head is most of
    the compute, and the prompt positions' logits are never used.
    """

    def __init__(self, lm: PreTrainedModel,
                 value_model: Literal["shared", "detached", "separate", "reward"] | None = "shared",
                 reward_model: PreTrainedModel | None = None) -> None:
        super().__init__()
        self.lm, self.detached = lm, value_model == "detached"
        self.critic = (copy.deepcopy(lm.base_model) if value_model == "separate"
                       else reward_model.base_model if value_model == "reward" else None)
        hidden = (self.critic or lm).config.hidden_size
        self.v_head = nn.Linear(hidden, 1) if value_model is not None else None
        if self.v_head is not None:
            # a small head keeps the first value estimates near 0, where the whitened returns start
            nn.init.normal_(self.v_head.weight, std=1.0 / (hidden + 1) ** 0.5)
            nn.init.zeros_(self.v_head.bias)
        if value_model == "reward":  # the value of a prefix starts as the reward model's score of it
            with torch.no_grad():
                self.v_head.weight.copy_(reward_model.score.weight)

    def forward(self, query_responses: torch.Tensor, attention_mask: torch.Tensor, context_length: int,
                temperature: float = 1.0, ref: Reference | None = None) -> tuple[TokenStats, torch.Tensor | None]:
        hidden = backbone_hidden(self.lm.base_model, query_responses, attention_mask, context_length)
        stats = response_stats(self.lm, hidden, query_responses[:, context_length:], temperature, ref)
        if self.v_head is None:
            return stats, None
        if self.critic is not None:
            hidden = backbone_hidden(self.critic, query_responses, attention_mask, context_length)
        elif self.detached:
            hidden = hidden.detach()
        with full_precision(hidden.device):
            values = self.v_head(hidden.float()).squeeze(-1)
        return stats, values

    def param_groups(self, lr: float, value_lr: float, device: torch.device) -> list[dict]:
        """The trained parameters (not a LoRA run's base) as the optimizer's groups: the value head's and a separate
        critic's body at ``value_lr``, the rest at ``lr``; each its ``base_lr`` (the peak a schedule scales) and its
        ``lr`` as a tensor on ``device``, where a fused step reads it."""
        named = [(name, p) for name, p in self.named_parameters() if p.requires_grad]
        groups = [([p for name, p in named if not name.startswith(VALUE_PARAMS)], lr),
                  ([p for name, p in named if name.startswith(VALUE_PARAMS)], value_lr)]
        return [{"params": params, "base_lr": base_lr, "lr": torch.tensor(base_lr, device=device)}
                for params, base_lr in groups if params]

    def save_value_head(self, folder: Path, state: dict[str, torch.Tensor] | None = None) -> None:
        """``folder``/value_head.safetensors: the value head (and separate critic) of ``state`` (this module's state
        dict, by default its own); nothing without a value head."""
        if self.v_head is None:
            return
        state = self.state_dict() if state is None else state
        head = {k: v.contiguous() for k, v in state.items() if k.startswith(VALUE_PARAMS)}
        save_file(head, folder / VALUE_HEAD_FILE)


def checkpoint_activations(policy: PolicyWithValueHead) -> None:
    """model.gradient_checkpointing: the policy's LM body (and a separate critic) keep only each block's input in a
    training forward and recompute the block in the backward (transformers' own checkpointing, non-reentrant, which
    needs no input that requires grad and so works under LoRA too). Inference (rollout, sampling) is unchanged."""
    for model in (policy.lm, policy.critic):
        if model is None:
            continue
        # transformers 5.x renamed it (deprecating the old name, with a warning); the project runs on either
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def save_policy(policy: PolicyWithValueHead, tokenizer: PreTrainedTokenizerBase, folder: Path,
                state: dict[str, torch.Tensor] | None = None) -> None:
    """``folder``, replaced in one rename: the LM loadable by AutoModelForCausalLM, its tokenizer, and the value head
    (if any) beside them. ``state``: the policy's state dict to write instead of its own (a sharded run's, gathered
    whole)."""
    lm_state = None if state is None else {k.removeprefix("lm."): v for k, v in state.items() if k.startswith("lm.")}
    save_pretrained(policy.lm, tokenizer, folder, lambda tmp: policy.save_value_head(tmp, state), lm_state)


def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    """Left padding must not shift positions: the first real token is position 0 in every row."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def kv_cache(backbone: nn.Module) -> tuple[DynamicCache, dict[str, DynamicCache]]:
    """An empty KV cache for ``backbone``'s forward, which fills it in place, and the keyword that passes it: ``cache``
    since transformers 5.24, which deprecated ``past_key_values`` (with a warning wherever it is passed or read);
    the project runs on either. (cache, {keyword: cache})."""
    cache = DynamicCache(config=backbone.config)
    keyword = "cache" if "cache" in inspect.signature(backbone.forward).parameters else "past_key_values"
    return cache, {keyword: cache}


def backbone_hidden(backbone: nn.Module, query_responses: torch.Tensor, attention_mask: torch.Tensor,
                    context_length: int) -> torch.Tensor:
    """(B, P + R) -> (B, R, H): the hidden states at the positions that predict each response token."""
    out = backbone(input_ids=query_responses, attention_mask=attention_mask,
                   position_ids=position_ids_from(attention_mask), use_cache=False)
    return out.last_hidden_state[:, context_length - 1: -1]


def lm_head(lm: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """(B, R, H) -> (B, R, V) fp32 logits, even under bf16 autocast.

    bf16 keeps 8 bits of mantissa: between 64 and 128 its steps are 0.5 apart, so rounding GPT-2's large logits
    would move every log-prob by up to 0.25 nats, no small thing next to a PPO clip range of 0.2. The body may run
    in bf16: the head's dot products average its rounding out, and what they share across tokens cancels in the
    log-softmax. On CUDA under bf16 autocast the head's matmul runs in TF32 (``precision.head_precision``): its
    inputs keep 11 significant bits, 3 more than bf16, and the logits stay fp32 (BENCHMARKS.md, "bf16 tolerance").
    On a CPU under bf16 autocast its backward runs in bf16 (``precision.head_grad_dtype``), as the body's does.
    """
    device = hidden.device
    # read before full_precision leaves autocast; a compiled step cannot switch torch's global matmul setting inside
    # its graph, so its caller holds it around the whole step (ppo_trainer.CompiledStep)
    precision = None if torch.compiler.is_compiling() else head_precision(device)
    grad_dtype = head_grad_dtype(device)
    with full_precision(device):
        return head_logits(lm.get_output_embeddings(), hidden.float(), precision, grad_dtype=grad_dtype)


def head_at(lm: PreTrainedModel, temperature: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """``lm``'s LM head at ``temperature``: (n, H) -> (n, V) fp32 logits / temperature."""
    if temperature == 1.0:  # a logits-sized copy otherwise
        return functools.partial(lm_head, lm)
    return lambda hidden: lm_head(lm, hidden) / temperature


def response_stats(lm: PreTrainedModel, hidden: torch.Tensor, responses: torch.Tensor, temperature: float,
                   ref: Reference | None = None) -> TokenStats:
    """(B, R, H) hidden states at the positions that predict the (B, R) ``responses`` -> their ``TokenStats`` under
    ``lm``'s head at ``temperature`` (with ``ref``: and the exact KL to it), the head run in chunks of positions."""
    head = head_at(lm, temperature)
    return head_stats(head, hidden, responses, lm.get_output_embeddings().weight.shape[0], ref)
