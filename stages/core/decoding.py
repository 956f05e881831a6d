"""Sampling new tokens from a causal LM, one decoding step per token: the sampler and the decoding loops.

GPT-2 models decode on preallocated buffers (``StaticDecoder``): a static KV cache, the attention mask and position
ids updated in place, the blocks' matmuls called directly. A step is a few dozen operator calls with no host sync, so
on CUDA it is captured once in a CUDA graph and replayed for every token (``GraphedDecoder``). Other architectures
go through Hugging Face's forward with its dynamic cache (``decode_dynamic``), which is also the reference the static
decoder is tested against.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Model

from stages.core.policy import lm_head, position_ids_from

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    top_k: int = 0
    top_p: float = 1.0
    temperature: float = 1.0


def filter_logits(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """(B, V) next-token logits -> the logits sampling draws from: divided by the temperature, then only the
    ``top_k`` largest and the smallest set of tokens holding ``top_p`` of the probability kept (the rest -inf), as
    Hugging Face's temperature, top-k and top-p warpers do, in that order. Each step runs only where it changes
    something: with the defaults the logits pass through untouched."""
    if sampling.temperature != 1.0:
        logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1)  # ascending
        outside = sorted_logits.softmax(-1).cumsum(-1) <= 1 - sampling.top_p
        outside[:, -1] = False  # the most likely token always stays
        logits = logits.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
    return logits


def sample_tokens(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """(B, V) next-token logits -> (B,) sampled token ids; top_k 1 is greedy decoding.

    Inverse-CDF sampling: one uniform draw per row where ``torch.multinomial`` draws one exponential per vocabulary
    entry (50k per row, most of the sampling time on a CPU).
    """
    if sampling.top_k == 1:
        return logits.argmax(-1)
    cdf = filter_logits(logits.float(), sampling).softmax(-1).cumsum(-1)  # (B, V)
    u = torch.rand(len(cdf), 1, device=cdf.device) * cdf[:, -1:]
    # right=True: the first token whose cdf exceeds u, so a zero-probability token (a flat step) is never drawn
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)


@torch.no_grad()
def decode(lm: PreTrainedModel, queries: torch.Tensor, query_mask: torch.Tensor, new_tokens: int,
           sampling: SamplingParams, cuda_graph: bool = True) -> torch.Tensor:
    """(B, P) left-padded queries -> (B, new_tokens) sampled tokens, every row decoded to the end (the caller cuts
    at EOS). ``lm`` must be in eval mode. ``cuda_graph``: replay the decoding step as a CUDA graph where the model
    runs on CUDA and the static decoder supports it (elsewhere the switch changes nothing)."""
    if not static_decoding_supports(lm):
        return decode_dynamic(lm, queries, query_mask, new_tokens, sampling)
    B, P = queries.shape
    if cuda_graph and queries.device.type == "cuda":
        decoder = graphed_decoder(lm, B, P + new_tokens, sampling)
    else:
        decoder = StaticDecoder(lm, B, P + new_tokens, sampling)
    decoder.start(queries, query_mask)
    for _ in range(new_tokens - 1):
        decoder.step()
    return decoder.tokens[:, P: P + new_tokens].clone()


@torch.no_grad()
def decode_dynamic(lm: PreTrainedModel, queries: torch.Tensor, query_mask: torch.Tensor, new_tokens: int,
                   sampling: SamplingParams) -> torch.Tensor:
    """``decode`` through Hugging Face's forward and dynamic KV cache: any causal LM, dozens more operator calls a
    token. The LM head runs in fp32 on the last position only, as in the training forward."""
    B = len(queries)
    responses = torch.empty((B, new_tokens), dtype=torch.long, device=queries.device)
    attention_mask, positions = query_mask, position_ids_from(query_mask)
    out = lm.base_model(input_ids=queries, attention_mask=attention_mask, position_ids=positions, use_cache=True)
    for t in range(new_tokens):
        responses[:, t] = sample_tokens(lm_head(lm, out.last_hidden_state[:, -1]), sampling)
        if t == new_tokens - 1:
            break
        # every sampled token is attended while decoding; the cut at each row's length and EOS comes after
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(B, 1)], dim=1)
        positions = positions[:, -1:] + 1
        out = lm.base_model(input_ids=responses[:, t: t + 1], attention_mask=attention_mask, position_ids=positions,
                            past_key_values=out.past_key_values, use_cache=True)
    return responses


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
    """A GPT-2 ``Conv1D`` (y = b + x W, W of shape (in, out)) with its weights in the compute dtype.

    Cast once per decoder instead of by autocast at every step (autocast caches casts only of weights that require
    grad: a frozen reference model paid one cast per weight per token). The same ``addmm`` as ``Conv1D`` on
    the same rounded operands, so the outputs match Hugging Face's bit for bit.
    """

    def __init__(self, conv: nn.Module, dtype: torch.dtype) -> None:
        self.sources = (conv.weight, conv.bias)
        self.weight, self.bias = (p.detach().to(dtype) for p in self.sources)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x, self.weight)

    def refresh(self) -> None:
        """Copy the model's current weights into the casts (a no-op where no cast was needed)."""
        for cast, source in zip((self.weight, self.bias), self.sources, strict=True):
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
        out = self.body(input_ids=queries, attention_mask=query_mask, position_ids=positions, use_cache=True)
        for keys, values, layer in zip(self.keys, self.values, out.past_key_values.layers, strict=True):
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


# Largest total variation distance allowed between the next-token distributions of a captured step's replay and of
# the same step run eagerly. Both run the same kernels on the same inputs, so they should agree bit for bit
# (tests/test_decoding.py asserts that on CUDA); the tolerance only lets through rounding-level differences, e.g. a
# kernel chosen differently under capture. The whole bf16 body moves a sampled token's log-prob by at most 1.7e-2
# nats against fp32 (BENCHMARKS.md, "bf16 tolerance"), a distance of about half that; 0.05 is 5x it. A step replayed
# on the wrong data (another slot, token or weights) draws from another distribution: a distance of order 0.3-1 for
# a trained model (an untrained one, near uniform, can stay under it: for those the check proves little).
CAPTURE_TOLERANCE = 0.05


def sampling_distance(logits: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest total variation distance between the rows' next-token distributions, softmax of (B, V) logits:
    the most the probability of any set of tokens differs. NaN where either has a NaN, or a row all -inf."""
    p, q = (x.double().softmax(-1) for x in (logits, reference))
    return 0.5 * (p - q).abs().sum(-1).max().item()


def replay_matches_eager(decoder: StaticDecoder, replay: Callable[[], torch.Tensor]) -> bool:
    """The one-time check of a captured step: ``replay()`` (the graph: one step, returning its (B, V) logits) from
    the decoder's current state, then, from the same state restored, the same step eagerly; whether their
    ``sampling_distance`` is within CAPTURE_TOLERANCE (a warning where not). Either way the decoder is left one
    eager step further on, as if the check had not been. Cost: a copy of the decoder's buffers and one eager step."""
    state = decoder.snapshot()
    replayed = replay().clone()
    decoder.restore(state)
    decoder.step()
    distance = sampling_distance(replayed, decoder.logits)
    if distance <= CAPTURE_TOLERANCE:
        log.debug("captured decoding step checked: distance %.1e from the eager step", distance)
        return True
    log.warning("the captured CUDA graph of the decoding step does not replay the eager step (sampling distance %s "
                "> %s); decoding eagerly from now on", f"{distance:.3g}", CAPTURE_TOLERANCE)
    return False


class GraphedDecoder:
    """A ``StaticDecoder`` whose ``step`` is one CUDA graph replay: the step's kernels are launched by the GPU from
    the recorded graph, with no Python, dispatcher or launch overhead per kernel.

    Its first step is checked against the eager step (``replay_matches_eager``); where they differ, it and every
    later decoder of the process decode eagerly (``_CAPTURED['failed']``), as after a failed capture.
    """

    WARMUP_STEPS = 3  # on a side stream before capture, as torch.cuda.graph asks: lazy init, cuBLAS workspaces

    def __init__(self, decoder: StaticDecoder) -> None:
        # the warm-up feeds slots 0-2 of the fresh buffers; start() resets everything the step reads
        self.decoder, self.tokens = decoder, decoder.tokens
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.WARMUP_STEPS):
                decoder.step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            decoder.step()
        self.logits = decoder.logits  # the graph's output buffer, rewritten by every replay
        self.checked = self.eager = False

    def start(self, queries: torch.Tensor, query_mask: torch.Tensor) -> None:
        self.decoder.refresh()
        self.decoder.start(queries, query_mask)

    def step(self) -> None:
        if self.eager:
            self.decoder.step()
        elif not self.checked:  # on real inputs: the first step after the first start
            self.checked = True
            if not replay_matches_eager(self.decoder, self.replay):
                self.eager = True
                _CAPTURED.update(key=None, decoder=None, failed=True)
        else:
            self.graph.replay()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.logits


SLOT_BUCKET = 32  # cache slots are rounded up to a multiple of this: prompts of varying length share one graph
# the process's one captured decoder, under "key", and whether a capture ever failed: a rollout batch has the same
# shape every PPO step, so the policy's step is captured once; another model or shape replaces it (its buffers and
# graph freed first), so at most one set stays allocated
_CAPTURED: dict[str, object] = {"key": None, "decoder": None, "failed": False}


def graphed_decoder(lm: PreTrainedModel, batch_size: int, length: int,
                    sampling: SamplingParams) -> GraphedDecoder | StaticDecoder:
    """The captured decoder of this model and shape, captured on first use; an eager ``StaticDecoder`` once a
    capture has failed (with a warning, once: eager decoding samples from the same distribution, only slower)."""
    if _CAPTURED["failed"]:
        return StaticDecoder(lm, batch_size, length, sampling)
    max_len = -(-length // SLOT_BUCKET) * SLOT_BUCKET
    # the model itself (held here, so its id stays its own) and its weights' addresses: a model moved or reloaded
    # into new tensors must not replay a graph that reads the old ones
    key = (id(lm), batch_size, max_len, sampling, compute_dtype(lm), tuple(p.data_ptr() for p in lm.parameters()))
    if _CAPTURED["key"] == key:
        return _CAPTURED["decoder"]
    _CAPTURED.update(key=None, decoder=None)
    try:
        graphed = GraphedDecoder(StaticDecoder(lm, batch_size, max_len, sampling, trim=False))
    except RuntimeError as e:
        log.warning("CUDA graph capture of the decoding step failed; decoding eagerly from now on: %s",
                    str(e).splitlines()[0])
        _CAPTURED["failed"] = True
        return StaticDecoder(lm, batch_size, length, sampling)
    _CAPTURED.update(key=key, decoder=graphed)
    return graphed
