"""LoRA adapters (Hu et al. 2021, through peft) injected in place: the LM stays the transformers model it was (its
``base_model``, LM head, forward and ``save_pretrained``), its targeted projections now peft layers that add
``scaling * B A x`` to the frozen ``W x``. The reference policy is the same model with its adapters off, as TRL 0.11's
PPOTrainer (``disable_adapter``) and verl (``ref_in_actor``) do: one copy of the weights in memory.

peft is imported only where adapters are added (its import costs seconds); a process that never imported it holds no
adapter, so the other helpers look no further.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from rlhf.pipeline.errors import ModelError
from rlhf.pipeline.sections import LoraParams

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def add_lora(lm: PreTrainedModel, lora: LoraParams) -> PreTrainedModel:
    """``lm``, in place, with rank-``lora.r`` adapters on ``lora.target_modules`` (null: every linear layer but the LM
    head, peft's 'all-linear': the attention and MLP projections) and every other weight frozen. B starts at 0, so
    the adapted model equals ``lm`` exactly until the first update."""
    from peft import LoraConfig, inject_adapter_in_model

    check_rank(lm, lora)
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=lora.target_modules or "all-linear",
                        # GPT-2's Conv1D stores its weight as (in, out), transposed from nn.Linear's
                        fan_in_fan_out=any(isinstance(m, Conv1D) for m in lm.modules()))
    try:
        inject_adapter_in_model(config, lm)
    except ValueError as e:  # no module of that name, or one peft cannot adapt
        raise ModelError(f"model.lora.target_modules: {str(e).splitlines()[0]}") from None
    for name, layer in lora_layers(lm):
        base = layer.get_base_layer()
        # the LM head of GPT-2 (and most LMs) is tied to the input embedding: a merged adapter would change both
        if not isinstance(base, nn.Linear | Conv1D) or layer is lm.get_output_embeddings():
            raise ModelError(f"model.lora.target_modules: {name} ({type(base).__name__}) is not an attention or MLP "
                             "projection, the layers LoRA adapts here (null: all of them)")
    return lm


def check_rank(lm: PreTrainedModel, lora: LoraParams) -> None:
    """A rank-r adapter of a layer holds r x (in + out) weights whose product has rank at most min(in, out): an r
    above that only wastes memory, and a huge one failed allocating them. The layers are those peft would adapt (a
    name or name suffix of ``lora.target_modules``; null: every projection but the LM head)."""
    head, targets = lm.get_output_embeddings(), lora.target_modules
    layers = [(name, module) for name, module in lm.named_modules()
              if isinstance(module, nn.Linear | Conv1D) and module is not head
              and (targets is None or any(name == t or name.endswith(f".{t}") for t in targets))]
    if layers:
        name, smallest = min(layers, key=lambda item: min(item[1].weight.shape))
        if lora.r > (rank := min(smallest.weight.shape)):
            shape = " x ".join(map(str, smallest.weight.shape))
            raise ModelError(f"model.lora.r: {lora.r} is above the rank of {name} ({shape}: at most {rank})")


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every LoRA layer of ``model``."""
    if "peft" not in sys.modules:
        return []
    from peft.tuners.lora import LoraLayer

    return [(name, module) for name, module in model.named_modules() if isinstance(module, LoraLayer)]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` with every adapter off inside the block: the model it was before ``add_lora`` (bit for bit), the
    reference policy of a LoRA run."""
    layers = [layer for _, layer in lora_layers(model)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def adapters_on(model: nn.Module) -> tuple[bool, ...]:
    """Which LoRA layers of ``model`` add their adapter now."""
    return tuple(adapter(layer) is not None for _, layer in lora_layers(model))


def adapter(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(A, B, scaling) of a LoRA layer's adapter where it adds to the layer's output now (enabled, not merged into
    the weight); None otherwise, and for a plain layer."""
    if not hasattr(module, "lora_A") or module.disable_adapters or module.merged:
        return None
    (name,) = module.active_adapters
    return module.lora_A[name].weight, module.lora_B[name].weight, module.scaling[name]


def base_layer(module: nn.Module) -> nn.Module:
    """The layer a LoRA layer adapts; a plain layer itself."""
    return module.get_base_layer() if hasattr(module, "lora_A") else module


def merge_adapters(model: nn.Module) -> nn.Module:
    """Every adapter merged into its weight (W + scaling B A) and the plain layer put back, in place: ``model``
    computes the same function (to float rounding) as a transformers model without adapters, which
    ``save_pretrained`` writes as from_pretrained loads it. Returns ``model``; one without adapters is left as is."""
    for name, layer in lora_layers(model):
        layer.merge()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer.get_base_layer())
    if hasattr(model, "peft_config"):  # set by peft on the model it adapted
        del model.peft_config
    return model
