"""One run over several processes with its models sharded: PyTorch's FSDP2 (``fully_shard``), torch's distributed
checkpoint (DCP) for what a resumed run reads back.

Each transformer block (the classes a Hugging Face model names in ``_no_split_modules``) is one FSDP unit, the rest
of a model (embeddings, final norm, the tied LM head, the value head) its root's: each process holds 1/N of every
weight, gradient and optimizer moment, and a block's weights are gathered for its forward and backward alone.
Gloo on a CPU, NCCL on GPUs: the same code, its backend chosen by the launcher's process group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

# the trained weights alone: a LoRA run's frozen base is its input, as in an unsharded checkpoint
CHECKPOINT_OPTIONS = StateDictOptions(ignore_frozen_params=True)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks of every Hugging Face model inside ``model``."""
    names = {name for module in model.modules() for name in getattr(module, "_no_split_modules", None) or ()}
    return [module for module in model.modules() if type(module).__name__ in names]


def shard(models: list[nn.Module | None], device: torch.device, processes: int) -> None:
    """``fully_shard`` each block of each model, then the model itself (the root), in place, over ``processes``."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (processes,))
    for model in filter(None, models):
        for block in blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        make_root(model)


def make_root(model: FSDPModule) -> None:
    """Make the sharded ``model`` the root of its FSDP2 units now. FSDP2 takes the first unit whose forward runs as
    the root; the rollout calls a block's forward before the root's (the LM body, outside the policy's forward).
    Through FSDP2's private state (``_get_fsdp_state()._lazy_init()``), which torch has no public call for."""
    model._get_fsdp_state()._lazy_init()


@contextlib.contextmanager
def gathered(model: nn.Module | None) -> Iterator[None]:
    """Every weight of ``model`` whole inside the block, gathered once: token-by-token decoding then runs no
    collective, which it could not (each process samples its own number of tokens), and the decoder reads the
    weights directly (sharded, it captures no CUDA graph: one would hold the addresses of weights gathered afresh at
    every rollout). Sharded again on leaving; a no-op for None, a model not sharded, or inside another ``gathered``."""
    if model is None or not any(isinstance(p, DTensor) for p in model.parameters()):
        yield
        return
    units = [module for module in model.modules() if isinstance(module, FSDPModule)]
    for unit in units:
        unit.unshard()
        if unit is not model:  # the root keeps its weights after its forward anyway (FSDP2's choice for a root)
            unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            if unit is not model:
                unit.set_reshard_after_forward(True, recurse=False)
            unit.reshard()


def clip_gradients(params: list[nn.Parameter], max_grad_norm: float | None) -> torch.Tensor:
    """Scale the gradients of ``params`` (sharded or averaged over processes) to a global L2 norm of at most
    ``max_grad_norm`` (None: unscaled): their norm before, a plain tensor every process holds alike."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    if max_grad_norm is not None:
        with implicit_replication():  # the coefficient is one number every shard is scaled by
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norm)
    return norm


def scalars_replicated() -> contextlib.AbstractContextManager:
    """Around an optimizer step on sharded weights: its learning rate and ``found_inf`` are plain tensors, the same
    on every process (no effect on weights not sharded)."""
    return implicit_replication()


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes of ``model``'s weights and ``optimizer``'s state this process holds (its shards, when sharded)."""
    def held(x: torch.Tensor) -> int:
        local = x.to_local() if isinstance(x, DTensor) else x
        return local.numel() * local.element_size()

    moments = [x for state in optimizer.state.values() for x in state.values() if isinstance(x, torch.Tensor)]
    return sum(map(held, [*model.parameters(), *moments]))


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s whole state dict on the main process's CPU ({} on the others); every process must call it. A tied
    weight (GPT-2's LM head, its embedding) comes once, under its first name, as an unsharded model saves it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(p), name) != name:
            state.pop(name, None)
    return state


def save(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every process writes its shards of the trained weights and their optimizer state to ``folder`` (DCP)."""
    import torch.distributed.checkpoint as dcp

    weights, optimizer_state = get_state_dict(model, optimizer, options=CHECKPOINT_OPTIONS)
    dcp.save({"model": weights, "optimizer": optimizer_state}, checkpoint_id=folder)


def load(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``save``'s shards back into ``model`` and ``optimizer``, resharded to this run's processes."""
    import torch.distributed.checkpoint as dcp

    weights, optimizer_state = get_state_dict(model, optimizer, options=CHECKPOINT_OPTIONS)
    state = {"model": weights, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=CHECKPOINT_OPTIONS)
