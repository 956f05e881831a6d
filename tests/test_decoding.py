"""The decoding loops: the static KV-cache decoder samples exactly what Hugging Face's forward with its dynamic cache
samples, one step at a time, in fp32 and under bf16 autocast, LoRA adapters included; a decoder reused for another
batch (as a CUDA graph is) decodes it like a fresh one; other architectures take the dynamic loop; on CUDA the graph
replays the eager step."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from rlhf.models import decoding
from rlhf.models.decoding import (
    CAPTURE_TOLERANCE,
    GraphedDecoder,
    decode,
    decode_dynamic,
    graphed_decoder,
    replay_matches_eager,
    sampling_distance,
)
from rlhf.models.loading import load_causal_lm
from rlhf.models.lora import add_lora
from rlhf.models.policy import kv_cache, position_ids_from
from rlhf.models.rollout import left_pad
from rlhf.models.sampling import SamplingParams
from rlhf.models.static_decoder import StaticDecoder, static_decoding_supports
from rlhf.pipeline.params import defaults

SAMPLINGS = [SamplingParams(), SamplingParams(top_k=1), SamplingParams(top_k=20, top_p=0.9, temperature=0.7)]
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def lm(tiny_gpt2_dir: Path) -> PreTrainedModel:
    return load_causal_lm(str(tiny_gpt2_dir), defaults().model).eval()


@pytest.fixture(scope="module")
def lora_lm(tiny_gpt2_dir: Path) -> PreTrainedModel:
    """The tiny GPT-2 with LoRA adapters on every projection, B drawn at random: adapters that change the output."""
    torch.manual_seed(0)
    lm = add_lora(load_causal_lm(str(tiny_gpt2_dir), defaults().model), defaults().model.lora.model_copy(
        update={"r": 4}))
    with torch.no_grad():
        for name, weight in lm.named_parameters():
            if "lora_B" in name:
                weight.normal_(std=0.1)
    return lm.eval()


def prompts(lm: PreTrainedModel, n: int = 6, seed: int = 0, max_len: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` left-padded prompts of 1 to ``max_len`` random tokens (the longest exactly ``max_len``)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [max_len] + torch.randint(1, max_len + 1, (n - 1,), generator=g).tolist()
    ids = [torch.randint(0, lm.config.vocab_size, (k,), generator=g).tolist() for k in lengths]
    return left_pad(ids, lm.config.eos_token_id, lm.device)


def precision(name: str, device: str = "cpu") -> contextlib.AbstractContextManager:
    dtype = PRECISIONS[name]
    return torch.autocast(device, dtype=dtype) if dtype else contextlib.nullcontext()


def seeded(seed: int, fn, *args, **kwargs) -> torch.Tensor:
    torch.manual_seed(seed)
    return fn(*args, **kwargs)


@pytest.mark.parametrize("name", PRECISIONS)
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
def test_static_decoder_samples_what_the_dynamic_cache_loop_samples(lm: PreTrainedModel, sampling: SamplingParams,
                                                                    name: str) -> None:
    queries, mask = prompts(lm)
    with precision(name):
        for seed in range(3):
            dynamic = seeded(seed, decode_dynamic, lm, queries, mask, NEW_TOKENS, sampling)
            static = seeded(seed, decode, lm, queries, mask, NEW_TOKENS, sampling)
            assert torch.equal(static, dynamic), seed


@pytest.mark.parametrize("model", ["lm", "lora_lm"])
@pytest.mark.parametrize("trim", [True, False], ids=["trimmed", "all-slots"])
@pytest.mark.parametrize("name", PRECISIONS)
def test_each_static_step_computes_hugging_face_s_cached_hidden_state(model: str, name: str, trim: bool,
                                                                      request: pytest.FixtureRequest) -> None:
    lm = request.getfixturevalue(model)
    queries, mask = prompts(lm, seed=1)
    P = queries.shape[1]
    hf = {}  # Hugging Face's cached forward, in this precision and (as the yardstick of bf16's rounding) in fp32

    def hf_step(ids: torch.Tensor, mask: torch.Tensor, positions: slice) -> None:
        for key, enabled in (("here", True), ("fp32", False)):
            cache = hf.setdefault(f"{key} cache", kv_cache(lm.base_model)[1])  # filled in place
            with torch.autocast("cpu", enabled=enabled and name == "bf16"):
                out = lm.base_model(input_ids=ids, attention_mask=mask, use_cache=True,
                                    position_ids=position_ids_from(mask)[:, positions], **cache)
            hf[key] = out.last_hidden_state[:, -1].float()

    with precision(name), torch.no_grad():
        decoder = StaticDecoder(lm, len(queries), P + NEW_TOKENS + 5, SamplingParams(), trim=trim)
        decoder.start(queries, mask)
        hf_step(queries, mask, slice(None))
        for t in range(NEW_TOKENS - 1):
            static = decoder.hidden()  # the step below writes the same keys and values again
            decoder.step()
            mask = torch.cat([mask, mask.new_ones(len(mask), 1)], dim=1)
            hf_step(decoder.tokens[:, P + t: P + t + 1], mask, slice(-1, None))
            expected = hf["here"]
            if trim:  # the same operators on the same operands
                assert torch.equal(static.float(), expected), t
            elif name == "fp32":  # the attention also sees the masked empty slots: a sum in another order
                torch.testing.assert_close(static, expected, rtol=0, atol=1e-5)
            else:  # in bf16 its output rounds a bit apart, as an adapter's own bf16 matmuls may again: the two agree
                # about as closely as Hugging Face's agrees with fp32 (on the machine at hand: CPUs round apart too)
                apart, bf16_error = (static.float() - expected).norm(), (expected - hf["fp32"]).norm()
                assert apart <= 2 * bf16_error, (t, apart, bf16_error)


def test_a_reused_decoder_decodes_a_new_batch_like_a_fresh_one(lm: PreTrainedModel) -> None:
    """The contract a CUDA graph relies on: ``start`` resets everything ``step`` reads, whatever ran before."""
    sampling = SamplingParams()
    first, first_mask = prompts(lm, seed=2, max_len=9)
    second, second_mask = prompts(lm, seed=3, max_len=4)
    # untrimmed, as a CUDA graph runs it, with room for more slots than either batch needs
    reused = StaticDecoder(lm, len(first), 32, sampling, trim=False)
    fresh = StaticDecoder(lm, len(second), 32, sampling, trim=False)

    def run(decoder: StaticDecoder, queries: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(0)
        with torch.no_grad():
            decoder.start(queries, mask)
            for _ in range(NEW_TOKENS - 1):
                decoder.step()
        P = queries.shape[1]
        return decoder.tokens[:, P: P + NEW_TOKENS].clone()

    run(reused, first, first_mask)
    assert torch.equal(run(reused, second, second_mask), run(fresh, second, second_mask))


def test_other_architectures_decode_through_the_dynamic_cache_loop(lm: PreTrainedModel) -> None:
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=lm.config.vocab_size, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)).eval()
    assert static_decoding_supports(lm) and not static_decoding_supports(llama)
    queries, mask = prompts(lm)
    tokens = seeded(0, decode, llama, queries, mask, NEW_TOKENS, SamplingParams(top_k=1))
    assert torch.equal(tokens, seeded(0, decode_dynamic, llama, queries, mask, NEW_TOKENS, SamplingParams(top_k=1)))


def test_decoding_passes_the_kv_cache_as_the_installed_transformers_asks(tiny_gpt2_dir: Path) -> None:
    """Under the name the model's forward takes it (transformers 5.24 renamed past_key_values to cache, and warns
    wherever the old name is passed or read: the static decoder read it once a batch, the dynamic loop once a token).
    In a fresh process, as transformers warns once a process."""
    code = f"""
import logging, warnings, torch
from transformers import LlamaConfig, LlamaForCausalLM
from rlhf.models.decoding import decode
from rlhf.models.loading import load_causal_lm
from rlhf.models.sampling import SamplingParams
from rlhf.pipeline.params import defaults
warnings.simplefilter("error")
lm = load_causal_lm({str(tiny_gpt2_dir)!r}, defaults().model).eval()
llama = LlamaForCausalLM(LlamaConfig(vocab_size=lm.config.vocab_size, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)).eval()
for model in (lm, llama):
    decode(model, torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.long), 4, SamplingParams())
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "deprecated" not in result.stderr, result.stderr


def steps_without_waiting(decoder: StaticDecoder | GraphedDecoder, steps: int) -> None:
    """``steps`` decoding steps under CUDA's sync debug mode "error": a step that waited for the GPU would raise."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            decoder.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device; the eager step they "
                                                          "capture is tested above")
@pytest.mark.parametrize("model", ["lm", "lora_lm"])
@pytest.mark.parametrize("name", PRECISIONS)
def test_the_cuda_graph_replays_the_eager_static_step(model: str, name: str, request: pytest.FixtureRequest) -> None:
    lm = request.getfixturevalue(model)
    gpu = lm.to("cuda")
    greedy = SamplingParams(top_k=1)
    try:
        with precision(name, "cuda"):
            for seed, max_len in ((4, 9), (5, 3)):  # a second batch, shorter prompts: the same graph, reused
                queries, mask = (t.cuda() for t in prompts(gpu, seed=seed, max_len=max_len))
                graphed = graphed_decoder(gpu, len(queries), queries.shape[1] + NEW_TOKENS, greedy)
                assert isinstance(graphed, GraphedDecoder)  # not the eager fallback of a failed capture
                slots = graphed.tokens.shape[1]
                with torch.no_grad():
                    graphed.start(queries, mask)
                    for _ in range(NEW_TOKENS - 1):
                        graphed.step()
                    eager = StaticDecoder(gpu, len(queries), slots, greedy, trim=False)  # the graph's shapes
                    eager.start(queries, mask)
                    steps_without_waiting(eager, NEW_TOKENS - 1)
                # the sampled tokens, from slot P on: the slots before P are never written, and the reused
                # graph's still hold an earlier batch's tokens
                P = queries.shape[1]
                assert torch.equal(graphed.tokens[:, P: P + NEW_TOKENS], eager.tokens[:, P: P + NEW_TOKENS])
            assert graphed_decoder(gpu, len(queries), queries.shape[1] + NEW_TOKENS, greedy) is graphed
            sampled = seeded(0, decode, gpu, queries, mask, NEW_TOKENS, SamplingParams())
            assert sampled.shape == (len(queries), NEW_TOKENS) and sampled.max() < gpu.config.vocab_size
    finally:
        lm.to("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device; the eager step's draws "
                                                          "are tested above")
@pytest.mark.parametrize("name", PRECISIONS)
def test_the_cuda_graph_draws_each_token_itself_as_the_eager_step_does(lm: PreTrainedModel, name: str) -> None:
    """The draw is part of the captured step: every replay takes fresh uniforms from the default CUDA generator (torch
    registers it with each graph it captures), the very ones the eager step takes for the same seed, and no replay
    waits for the GPU. A graph that replayed its capture's uniforms would draw other tokens than the eager step."""
    gpu = lm.to("cuda")
    sampling = SamplingParams()  # the whole distribution: a draw, not an argmax
    try:
        with precision(name, "cuda"), torch.no_grad():
            queries, mask = (t.cuda() for t in prompts(gpu, seed=4))
            P = queries.shape[1]
            graphed = graphed_decoder(gpu, len(queries), P + NEW_TOKENS, sampling)
            assert isinstance(graphed, GraphedDecoder)
            graphed.start(queries, mask)
            graphed.step()  # the first step after a capture is checked against an eager one, drawing twice
            draws = []
            for seed in (0, 0, 1):
                torch.manual_seed(seed)
                graphed.start(queries, mask)
                steps_without_waiting(graphed, NEW_TOKENS - 1)
                draws.append(graphed.tokens[:, P: P + NEW_TOKENS].clone())
            eager = StaticDecoder(gpu, len(queries), graphed.tokens.shape[1], sampling, trim=False)  # its shapes
            torch.manual_seed(0)
            eager.start(queries, mask)
            for _ in range(NEW_TOKENS - 1):
                eager.step()
        assert torch.equal(draws[0], eager.tokens[:, P: P + NEW_TOKENS])
        assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    finally:
        lm.to("cpu")


def test_sampling_distance_is_the_largest_total_variation_between_rows() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 50, generator=g) * 3, torch.randn(4, 50, generator=g) * 3
    expected = max(sum(abs(p - q) for p, q in zip(ra.softmax(-1).tolist(), rb.softmax(-1).tolist(), strict=True)) / 2
                   for ra, rb in zip(a.double(), b.double(), strict=True))
    assert sampling_distance(a, b) == pytest.approx(expected, rel=1e-9)
    assert sampling_distance(a, a + 7.0) < 1e-6  # logits are defined up to a shift (and fp32 rounding of it)
    nan = a.clone()
    nan[2, 3] = float("nan")
    assert not sampling_distance(nan, a) <= CAPTURE_TOLERANCE  # NaN fails the check


def first_step(lm: PreTrainedModel, queries: torch.Tensor, mask: torch.Tensor) -> StaticDecoder:
    """A started untrimmed decoder (a captured one's shapes), on seed 0."""
    torch.manual_seed(0)
    decoder = StaticDecoder(lm, len(queries), 32, SamplingParams(), trim=False)
    decoder.start(queries, mask)
    return decoder


@pytest.mark.parametrize("faithful", [True, False], ids=["faithful-replay", "injected-mismatch"])
@torch.no_grad()
def test_the_capture_check_passes_a_faithful_replay_and_catches_a_wrong_one(lm: PreTrainedModel, faithful: bool,
                                                                           caplog) -> None:
    queries, mask = prompts(lm, seed=6)
    reference = first_step(lm, queries, mask)
    reference.step()
    decoder = first_step(lm, queries, mask)

    def replay() -> torch.Tensor:  # stands in for the graph: one step, and its logits
        decoder.step()
        decoder.positions.add_(7)  # state the check must undo before its eager step
        return decoder.logits if faithful else decoder.logits + 6.0 * (torch.arange(decoder.logits.shape[1]) == 0)

    with caplog.at_level("WARNING", logger="rlhf.models.decoding"):
        assert replay_matches_eager(decoder, replay) == faithful
    assert len(caplog.records) == (0 if faithful else 1)
    # either way the decoder is one eager step on, that step taken from the restored state
    assert torch.equal(decoder.logits, reference.logits)
    assert torch.equal(decoder.positions, reference.positions) and torch.equal(decoder.slot, reference.slot)
    for ours, theirs in zip(decoder.keys + decoder.values, reference.keys + reference.values, strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device; the check's logic is "
                                                          "tested on CPU above")
def test_a_captured_step_that_fails_the_check_decodes_eagerly_from_then_on(lm: PreTrainedModel, monkeypatch,
                                                                            caplog) -> None:
    gpu = lm.to("cuda")
    for key in ("key", "decoder", "failed"):
        monkeypatch.setitem(decoding._CAPTURED, key, None if key != "failed" else False)
    monkeypatch.setattr(decoding, "CAPTURE_TOLERANCE", -1.0)  # every replay is a mismatch
    greedy = SamplingParams(top_k=1)
    try:
        queries, mask = (t.cuda() for t in prompts(gpu, seed=4))
        with caplog.at_level("WARNING", logger="rlhf.models.decoding"):
            tokens = seeded(0, decode, gpu, queries, mask, NEW_TOKENS, greedy)
            again = seeded(0, decode, gpu, queries, mask, NEW_TOKENS, greedy)
        assert len([r for r in caplog.records if "does not replay" in r.message]) == 1  # warned once
        assert decoding._CAPTURED["failed"]
        assert isinstance(graphed_decoder(gpu, len(queries), queries.shape[1] + NEW_TOKENS, greedy), StaticDecoder)
        eager = seeded(0, decode, gpu, queries, mask, NEW_TOKENS, greedy, cuda_graph=False)
        assert torch.equal(tokens, eager) and torch.equal(again, eager)
    finally:
        lm.to("cpu")
