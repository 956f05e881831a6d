"""Tokens per second of an SFT training step, ours against Hugging Face's own loss: ``python -m bench.sft_step``.

A from-scratch GPT-2 of a preset's ``sft`` shape (``--preset``: presets/NAME.yaml over params.yaml; its batch_size x
block_size tokens a step) trains on random token blocks under the preset's precision (``model.precision``, auto
unless it says otherwise), one runner per loss, each with its own copy of the model and AdamW:

- ``ours``: ``sft.next_token_loss`` (the LM head on the positions that predict a token, ``logprobs.cross_entropy``),
  what the sft stage trains with;
- ``hf``: ``lm(input_ids, labels=input_ids).loss`` (the head on every position, Hugging Face's upcast
  cross-entropy), what it trained with before.

The runners take turns, in an order reversed every other time, so a load change on a shared machine hits both; the
medians are printed, with each runner's peak memory above the weights on CUDA, and one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from bench.configs import set_threads
from rlhf.models.precision import autocast, mixed_precision, pick_device
from rlhf.pipeline.cli import run_stage
from rlhf.pipeline.params import read_yaml
from rlhf.pipeline.sections import SftParams
from rlhf.train.sft import next_token_loss, scratch_model
from tools.presets import load_preset, overlay

GPT2_VOCAB, EOS = 50257, 50256


def preset_sft(name: str) -> tuple[SftParams, str]:
    """The preset's sft section over params.yaml's, and its model.precision."""
    raw = overlay(read_yaml("params.yaml"), load_preset(name))
    return SftParams.model_validate(raw["sft"]), raw["model"]["precision"]


def runner(name: str, s: SftParams, precision: str, device: torch.device) -> Callable[[torch.Tensor], float]:
    """``step(batch)``: one optimizer step of ``name``'s loss on a (B, T) batch; the loss."""
    torch.manual_seed(0)
    lm = scratch_model(s, GPT2_VOCAB, EOS).to(device).train()
    optimizer = torch.optim.AdamW(lm.parameters(), lr=s.learning_rate, betas=(0.9, 0.95), fused=True)  # as fit.fit

    def loss(batch: torch.Tensor) -> torch.Tensor:
        if name == "ours":
            return next_token_loss(lm, batch, precision)
        with autocast(device, precision):
            return lm(input_ids=batch, labels=batch).loss

    def step(batch: torch.Tensor) -> float:
        value = loss(batch)
        value.backward()
        torch.nn.utils.clip_grad_norm_(lm.parameters(), s.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return value.item()

    return step


def timed(step: Callable[[torch.Tensor], float], batch: torch.Tensor,
          device: torch.device) -> tuple[float, float | None]:
    """Seconds of one step, and its peak memory above what was allocated before it (MB; None off CUDA)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    step(batch)  # .item() waits for the GPU
    seconds = time.perf_counter() - start
    return seconds, (torch.cuda.max_memory_allocated() - before) / 2**20 if cuda else None


def measure(s: SftParams, precision: str, device: torch.device, iters: int) -> dict[str, dict[str, float | None]]:
    """Each runner's median step time, tokens/s, peak memory and first loss (the same model and batch for both)."""
    steps = {name: runner(name, s, precision, device) for name in ("ours", "hf")}
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, GPT2_VOCAB, (s.batch_size, s.block_size), generator=g).to(device)
               for _ in range(iters + 1)]
    first_loss = {name: step(batches[0]) for name, step in steps.items()}  # also the warm-up
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    for i, batch in enumerate(batches[1:]):
        for name in list(steps)[:: 1 if i % 2 == 0 else -1]:
            times[name].append(timed(steps[name], batch, device))
    tokens = s.batch_size * s.block_size
    return {name: {"s_per_step": statistics.median(t for t, _ in runs),
                   "tokens_per_s": tokens / statistics.median(t for t, _ in runs),
                   "peak_mem_mb": None if device.type != "cuda" else max(m for _, m in runs),
                   "first_loss": first_loss[name]} for name, runs in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="offline-cpu", help="presets/NAME.yaml: sft shape, batch, precision")
    parser.add_argument("--batch-size", type=int, help="override the preset's sft.batch_size (a smaller CPU run)")
    parser.add_argument("--iters", type=int, default=6, help="timed steps per runner, after one warm-up step each")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own, one per core)")
    args = parser.parse_args()
    set_threads(args.threads)
    s, precision = preset_sft(args.preset)
    if args.batch_size:
        s = s.model_copy(update={"batch_size": args.batch_size})
    device = pick_device()
    results = measure(s, precision, device, args.iters)
    dtype = mixed_precision(device, precision)
    print(f"{args.preset}: {s.n_layer} layers x {s.n_embd}, batch {s.batch_size} x {s.block_size} tokens, "
          f"{'bf16 autocast' if dtype else 'fp32'}, {torch.get_num_threads()} threads, {device.type}")
    for name, r in results.items():
        memory = "" if r["peak_mem_mb"] is None else f", peak {r['peak_mem_mb']:.0f} MB above the weights"
        print(f"{name:>5}: {r['s_per_step'] * 1e3:8.1f} ms a step, {r['tokens_per_s']:10.0f} tokens/s{memory}")
    ratio = results["hf"]["s_per_step"] / results["ours"]["s_per_step"]
    print(f"ours is {ratio:.2f}x as fast as hf")
    print(json.dumps({"preset": args.preset, "batch_size": s.batch_size, "block_size": s.block_size,
                      "device": device.type, "iters": args.iters, "results": results, "speedup": ratio}))


if __name__ == "__main__":
    run_stage(main)
