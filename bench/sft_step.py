"""Tokens per second of an SFT training step, ours against Hugging Face's own loss: ``python -m bench.sft_step``.

A from-scratch GPT-2 of a preset's ``sft`` shape (``--preset``: presets/NAME.yaml over params.yaml; its batch_size x
block_size tokens a step) trains on random token blocks under the preset's precision (``model.precision``, auto
unless it says otherwise), one runner per loss, each with its own copy of the model and AdamW:

- ``ours``: ``sft.next_token_loss`` (the LM head on the positions that predict a token, ``logprobs.cross_entropy``),
  what the sft stage trains with eagerly;
- ``ours-compiled``: the same under torch.compile (``sft.compiled_loss``), what the sft stage trains with where
  ``sft.compile`` says so;
- ``hf``: ``lm(input_ids, labels=input_ids).loss`` (the head on every position, Hugging Face's upcast
  cross-entropy), what it trained with before; ``hf-compiled``: the same under torch.compile.

A step is the sft stage's: the batch copied to the device as the stage copies it, forward, backward, gradient clip,
fused AdamW, and nothing read back. The runners take turns of ``--steps`` steps each, timed together from one wait for
the device to the next (so the host queues a step while the device runs the one before, as in training), in an order
reversed every other turn, so a load change on a shared machine hits all; the first step of each, compilation
included, is timed apart. The medians are printed, with each runner's peak memory above the weights on CUDA, and one
JSON line last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from bench.configs import set_threads
from rlhf.models.devices import pick_device
from rlhf.models.precision import autocast, mixed_precision, to_device
from rlhf.pipeline.cli import run_stage
from rlhf.pipeline.params import read_yaml
from rlhf.pipeline.sections import SftParams
from rlhf.train.compiled import CompiledStep
from rlhf.train.sft import compiled_loss, next_token_loss, scratch_model
from tools.presets import load_preset, overlay

GPT2_VOCAB, EOS = 50257, 50256
RUNNERS = ("ours", "ours-compiled", "hf", "hf-compiled")
PEER = "hf"  # the runner the others are compared with


def preset_sft(name: str) -> tuple[SftParams, str]:
    """The preset's sft section over params.yaml's, and its model.precision."""
    raw = overlay(read_yaml("params.yaml"), load_preset(name))
    return SftParams.model_validate(raw["sft"]), raw["model"]["precision"]


def hf_loss(lm: torch.nn.Module, batch: torch.Tensor, precision: str) -> torch.Tensor:
    with autocast(batch.device, precision):
        return lm(input_ids=batch, labels=batch).loss


def runner(name: str, s: SftParams, precision: str, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """``step(batch)``: one optimizer step of ``name``'s loss on a (B, T) CPU batch; the loss, left on the device."""
    torch.manual_seed(0)
    lm = scratch_model(s, GPT2_VOCAB, EOS).to(device).train()
    optimizer = torch.optim.AdamW(lm.parameters(), lr=s.learning_rate, betas=(0.9, 0.95), fused=True)  # as fit.fit
    if name.startswith("ours"):
        # the stage's compiled step, its first use checked against the eager step as in a run
        check = CompiledStep("sft.compile", True, "bf16" if mixed_precision(device, precision) else "fp32")
        loss = compiled_loss(check, list(lm.parameters())) if name.endswith("-compiled") else next_token_loss
    else:
        loss = torch.compile(hf_loss, dynamic=False) if name.endswith("-compiled") else hf_loss

    def step(batch: torch.Tensor) -> torch.Tensor:
        value = loss(lm, to_device(batch, device), precision)
        value.backward()
        torch.nn.utils.clip_grad_norm_(lm.parameters(), s.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return value.detach()

    return step


def wait(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(step: Callable[[torch.Tensor], torch.Tensor], batches: list[torch.Tensor],
          device: torch.device) -> tuple[float, float | None, torch.Tensor]:
    """Seconds per step of ``batches`` run back to back, their peak memory above what was allocated before them (MB;
    None off CUDA), and the first step's loss."""
    cuda = device.type == "cuda"
    wait(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    losses = [step(batch) for batch in batches]
    wait(device)
    seconds = (time.perf_counter() - start) / len(batches)
    return seconds, (torch.cuda.max_memory_allocated() - before) / 2**20 if cuda else None, losses[0]


def measure(names: list[str], s: SftParams, precision: str, device: torch.device, iters: int,
            steps: int) -> dict[str, dict[str, float | None]]:
    """Each runner's first step (seconds, compilation included, and loss: the same model and batch for all), and its
    median time per step, tokens/s and peak memory over ``iters`` turns of ``steps`` steps."""
    runs = {name: runner(name, s, precision, device) for name in names}
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, GPT2_VOCAB, (s.batch_size, s.block_size), generator=g) for _ in range(steps + 1)]
    first = {name: timed(step, batches[:1], device) for name, step in runs.items()}  # also the warm-up
    turns: dict[str, list[tuple[float, float | None, torch.Tensor]]] = {name: [] for name in runs}
    for i in range(iters):
        for name in list(runs)[:: 1 if i % 2 == 0 else -1]:
            turns[name].append(timed(runs[name], batches[1:], device))
    tokens = s.batch_size * s.block_size
    return {name: {"s_per_step": statistics.median(t for t, _, _ in timings),
                   "tokens_per_s": tokens / statistics.median(t for t, _, _ in timings),
                   "peak_mem_mb": None if device.type != "cuda" else max(m for _, m, _ in timings),
                   "first_step_s": first[name][0], "first_loss": first[name][2].item()}
            for name, timings in turns.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="offline-cpu", help="presets/NAME.yaml: sft shape, batch, precision")
    parser.add_argument("--batch-size", type=int, help="override the preset's sft.batch_size (a smaller CPU run)")
    parser.add_argument("--runners", default="ours,ours-compiled,hf",
                        help=f"comma-separated, from: {', '.join(RUNNERS)} (each compared with {PEER} if it runs)")
    parser.add_argument("--iters", type=int, default=6, help="timed turns per runner, after one warm-up step each")
    parser.add_argument("--steps", type=int, default=2, help="steps per turn, run back to back")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own, one per core)")
    parser.add_argument("--precision", choices=["auto", "fp32", "bf16"],
                        help="override the preset's model.precision (fp32: a CPU without native bf16's path)")
    args = parser.parse_args()
    names = [r for r in args.runners.split(",") if r]
    if not names or any(r not in RUNNERS for r in names) or len(set(names)) < len(names):
        raise SystemExit(f"error: --runners: expected distinct names from {', '.join(RUNNERS)}")
    set_threads(args.threads)
    s, precision = preset_sft(args.preset)
    precision = args.precision or precision
    if args.batch_size:
        s = s.model_copy(update={"batch_size": args.batch_size})
    device = pick_device()
    results = measure(names, s, precision, device, args.iters, args.steps)
    dtype = mixed_precision(device, precision)
    print(f"{args.preset}: {s.n_layer} layers x {s.n_embd}, batch {s.batch_size} x {s.block_size} tokens, "
          f"{'bf16 autocast' if dtype else 'fp32'}, {torch.get_num_threads()} threads, {device.type}, "
          f"{args.iters} turns of {args.steps} steps")
    for name, r in results.items():
        memory = "" if r["peak_mem_mb"] is None else f", peak {r['peak_mem_mb']:.0f} MB above the weights"
        print(f"{name:>13}: {r['s_per_step'] * 1e3:8.1f} ms a step, {r['tokens_per_s']:10.0f} tokens/s{memory}; "
              f"first step {r['first_step_s']:.1f} s, loss {r['first_loss']:.4f}")
    speedups = {name: results[PEER]["s_per_step"] / r["s_per_step"] for name, r in results.items()
                if PEER in results and name != PEER}
    for name, ratio in speedups.items():
        print(f"{name} is {ratio:.2f}x as fast as {PEER}")
    print(json.dumps({"preset": args.preset, "batch_size": s.batch_size, "block_size": s.block_size,
                      "device": device.type, "iters": args.iters, "steps": args.steps, "results": results,
                      "speedups": speedups, "speedup": speedups.get("ours")}))


if __name__ == "__main__":
    run_stage(main)
