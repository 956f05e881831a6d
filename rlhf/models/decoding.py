"""Sampling new tokens from a causal LM, one decoding step per token: the decoding loops.

GPT-2 models decode on preallocated buffers (rlhf/models/static_decoder.py), a step of a few dozen operator calls
with no host sync, so on CUDA it is captured once in a CUDA graph and replayed for every token (``GraphedDecoder``).
Other architectures go through Hugging Face's forward with its dynamic cache (``decode_dynamic``), which is also the
reference the static decoder is tested against.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from rlhf.models.lora import adapters_on
from rlhf.models.policy import kv_cache, lm_head, position_ids_from
from rlhf.models.sampling import SamplingParams, sample_tokens
from rlhf.models.static_decoder import StaticDecoder, compute_dtype, static_decoding_supports

log = logging.getLogger(__name__)


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
    _, cache = kv_cache(lm.base_model)
    out = lm.base_model(input_ids=queries, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                        **cache)
    for t in range(new_tokens):
        responses[:, t] = sample_tokens(lm_head(lm, out.last_hidden_state[:, -1]), sampling)
        if t == new_tokens - 1:
            break
        # every sampled token is attended while decoding; the cut at each row's length and EOS comes after
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(B, 1)], dim=1)
        positions = positions[:, -1:] + 1
        out = lm.base_model(input_ids=responses[:, t: t + 1], attention_mask=attention_mask, position_ids=positions,
                            use_cache=True, **cache)
    return responses


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
    # the model itself (held here, so its id stays its own), its weights' addresses and which LoRA adapters are on: a
    # model moved or reloaded into new tensors, or with its adapters switched, must not replay a graph of the old one
    key = (id(lm), batch_size, max_len, sampling, compute_dtype(lm), tuple(p.data_ptr() for p in lm.parameters()),
           adapters_on(lm))
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
