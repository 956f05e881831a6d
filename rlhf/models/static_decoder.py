"""GPT-2 decoding on preallocated buffers: a static KV cache, the attention mask and position ids updated in place,
the blocks' matmuls called directly. A step is a few dozen operator calls with no host sync, so on CUDA it can be
captured in a CUDA graph (rlhf/models/decoding.py's ``GraphedDecoder``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Model

from rlhf.models.lora import adapter, base_layer
from rlhf.models.policy import kv_cache, lm_head, position_ids_from
from rlhf.models.sampling import SamplingParams, sample_tokens


def static_decoding_supports(lm: PreTrainedModel) -> bool:
    """GPT-2 blocks whose attention is SDPA's or eager's plain softmax(QK^T * scaling) V."""
    config = lm.config
    return (isinstance(lm.base_model, GPT2Model) and not config.add_cross_attention
            and config._attn_implementation in ("sdpa", "eager")
            and not (config._attn_implementation == "eager" and config.reorder_and_upcast_attn))


def compute_dtype(lm: PreTrainedModel) -> torch.dtype:
    """The dtype the blocks' matmuls run in: autocast's where it is on (the caller's mixed precision), else the
    weights' own."""
    device = lm.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else lm.dtype


class Linear:
    """A GPT-2 ``Conv1D`` (y = b + x W, W of shape (in, out)) with its weights in the compute dtype, plus its LoRA
    adapter's scaling * (x A^T) B^T where the layer has one on (rlhf/models/lora.py).

    Cast once per decoder instead of by autocast at every step (autocast caches casts only of weights that require
    grad: a frozen reference model paid one cast per weight per token). The same ``addmm`` as ``Conv1D``, and for an
    adapter the same two ``linear`` calls as peft, on the same rounded operands, so the outputs match Hugging Face's
    bit for bit.
    """

    def __init__(self, layer: nn.Module, dtype: torch.dtype) -> None:
        conv, lora = base_layer(layer), adapter(layer)
        self.sources = (conv.weight, conv.bias, *(lora[:2] if lora else ()))
        self.scaling = lora[2] if lora else None
        self.casts = [p.detach().to(dtype) for p in self.sources]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias, *lora = self.casts
        y = torch.addmm(bias, x, weight)
        if self.scaling is None:
            return y
        a, b = lora
        return y + F.linear(F.linear(x, a), b) * self.scaling

    def refresh(self) -> None:
        """Copy the model's current weights into the casts (a no-op where no cast was needed)."""
        for cast, source in zip(self.casts, self.sources, strict=True):
            if cast.data_ptr() != source.data_ptr():
                cast.copy_(source)


class StaticDecoder:
    """GPT-2 decoding of a batch of ``batch_size`` rows on buffers allocated once for ``max_len`` tokens a row.

    Slot ``s`` of the KV cache holds the keys and values of the ``s``-th token of each row: the left-padded query's
    (from the prompt's forward pass), then the sampled ones', which ``tokens`` (B, T) holds from slot P on.
    ``slot`` (1,) is the slot of the token fed next, ``positions`` (B,) its position id, ``bias`` (B, 1, 1, T) the
    attention mask, 0 on the slots attended (real query tokens and everything fed so far) and -inf elsewhere: additive
    and in the compute dtype, what SDPA would otherwise make of a boolean mask in every layer.

    ``trim``: attention reads only the slots filled so far (their count kept in Python as well), which reproduces
    Hugging Face's cached forward bit for bit, also in bf16. Untrimmed, it reads all T slots under the mask: the
    static shapes a CUDA graph needs; then ``step`` reads and writes nothing but the buffers above, on the device,
    so a graph of one call replays any later call. (The masked empty slots change nothing in exact arithmetic; in
    bf16, CPU's SDPA rounds some outputs one bit apart.)
    """

    def __init__(self, lm: PreTrainedModel, batch_size: int, max_len: int, sampling: SamplingParams,
                 trim: bool = True) -> None:
        self.lm, self.body, self.sampling, self.trim = lm, lm.base_model, sampling, trim
        self.filled = 0  # slots holding keys and values once the fed token's are in (read when trimmed)
        dtype, device, config = compute_dtype(lm), lm.device, lm.config
        self.linears = [(Linear(b.attn.c_attn, dtype), Linear(b.attn.c_proj, dtype), Linear(b.mlp.c_fc, dtype),
                         Linear(b.mlp.c_proj, dtype)) for b in self.body.h]
        B, H, T = batch_size, config.n_head, max_len
        shape = (B, H, T, config.n_embd // H)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.body.h]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.body.h]
        self.bias = torch.zeros((B, 1, 1, T), dtype=dtype, device=device)
        self.tokens = torch.zeros((B, T), dtype=torch.long, device=device)
        self.positions = torch.zeros(B, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)

    def refresh(self) -> None:
        for linears in self.linears:
            for linear in linears:
                linear.refresh()

    def start(self, queries: torch.Tensor, query_mask: torch.Tensor) -> None:
        """Run the (B, P) queries through Hugging Face's forward (once per batch: its per-call cost does not matter
        here, and the first token comes out exactly as from the dynamic loop), load its KV cache into the buffers
        and sample the first token."""
        P = queries.shape[1]
        positions = position_ids_from(query_mask)
        cache, passed = kv_cache(self.body)
        out = self.body(input_ids=queries, attention_mask=query_mask, position_ids=positions, use_cache=True, **passed)
        for keys, values, layer in zip(self.keys, self.values, cache.layers, strict=True):
            keys[:, :, :P].copy_(layer.keys)
            values[:, :, :P].copy_(layer.values)
        self.bias.fill_(float("-inf"))
        self.bias[:, 0, 0, :P].masked_fill_(query_mask.bool(), 0.0)
        self.tokens[:, P] = sample_tokens(lm_head(self.lm, out.last_hidden_state[:, -1]), self.sampling)
        self.positions.copy_(positions[:, -1] + 1)
        self.slot.fill_(P)
        self.filled = P + 1

    def step(self) -> None:
        """Feed the token at ``slot`` and sample the next one into ``slot + 1`` (from ``logits``, kept: (B, V))."""
        self.logits = lm_head(self.lm, self.hidden())
        next_tokens = sample_tokens(self.logits, self.sampling)
        self.tokens.index_copy_(1, self.slot + 1, next_tokens[:, None])
        self.positions.add_(1)
        self.slot.add_(1)
        self.filled += 1

    def snapshot(self) -> tuple[list[torch.Tensor], int]:
        """A copy of everything ``step`` reads or writes (the whole KV cache included), for ``restore``."""
        buffers = [*self.keys, *self.values, self.bias, self.tokens, self.positions, self.slot]
        return [b.clone() for b in buffers], self.filled

    def restore(self, snapshot: tuple[list[torch.Tensor], int]) -> None:
        buffers, self.filled = snapshot
        for target, saved in zip([*self.keys, *self.values, self.bias, self.tokens, self.positions, self.slot],
                                 buffers, strict=True):
            target.copy_(saved)

    def hidden(self) -> torch.Tensor:
        """(B, E) final hidden state of the token at ``slot``, its keys and values stored there: GPT-2's forward
        (dropout left out: decoding runs in eval mode), one token a row."""
        body = self.body
        x = F.embedding(self.tokens.index_select(1, self.slot).squeeze(1), body.wte.weight)
        x = x + F.embedding(self.positions, body.wpe.weight)
        self.bias.index_fill_(-1, self.slot, 0.0)
        for i, (block, (qkv_proj, out_proj, fc, fc_proj)) in enumerate(zip(body.h, self.linears, strict=True)):
            x = x + out_proj(self.attention(i, qkv_proj(layer_norm(block.ln_1, x)), block.attn.scaling))
            x = x + fc_proj(block.mlp.act(fc(layer_norm(block.ln_2, x))))
        return layer_norm(body.ln_f, x)

    def attention(self, layer: int, qkv: torch.Tensor, scaling: float) -> torch.Tensor:
        """(B, 3E) queries, keys and values of the fed token -> (B, E) attention output over the attended slots."""
        B, H = len(qkv), self.keys[layer].shape[1]
        q, k, v = qkv.view(B, 3, H, 1, -1).unbind(1)  # each (B, H, 1, D)
        keys, values, bias = self.keys[layer], self.values[layer], self.bias
        keys.index_copy_(2, self.slot, k)
        values.index_copy_(2, self.slot, v)
        if self.trim:
            keys, values, bias = keys[:, :, :self.filled], values[:, :, :self.filled], bias[..., :self.filled]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, scale=scaling)
        return out.reshape(B, -1)


def layer_norm(norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
