"""Milliseconds and operator calls per decoding step: ``python -m bench.decode_step``.

``python -m bench.decode_step --config toy --batch 1`` (almost pure per-token overhead) or ``--config bench-cpu``
(the config's batch). A randomly initialised GPT-2 of the config's shape samples ``--tokens`` new tokens after
2-8-token prompts, under the precision ``bench.ppo_step`` trains in, through each decoder of ``--decoders``:
``static`` (``decoding.decode``, what ``rollout.generate`` runs: the static KV cache, on CUDA a CUDA graph unless
``--no-cuda-graph``) and ``dynamic`` (``decoding.decode_dynamic``: Hugging Face's forward and dynamic cache, the loop
``generate`` ran before). One decoding step costs the difference between decoding 1 + N tokens and 1 token, divided
by N: the prompt's forward pass (prefill) and the first token cancel out. The two are timed in alternation, the
decoders take turns (in an order reversed every other time), and the medians of the differences are taken, so a
load change on a shared machine hits all alike. Operator calls per step are counted the same way in
``torch.profiler``: every ``aten::`` call (nested ones included: each goes through the dispatcher) and the top-level
ones (each a call from Python). Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from bench.configs import CONFIGS, BenchConfig, gpt2_config_kwargs, set_threads, use_bf16
from rlhf.models.decoding import SamplingParams, decode, decode_dynamic
from rlhf.models.devices import pick_device
from rlhf.models.loading import fast_activations
from rlhf.models.policy import disable_dropout
from rlhf.models.precision import autocast
from rlhf.models.rollout import left_pad
from rlhf.pipeline.cli import run_stage

EOS = 50256  # GPT-2's; the pad token too, as in the pipeline
DECODERS = ("static", "dynamic")


def random_prompts(cfg: BenchConfig, batch: int, seed: int = 0) -> list[list[int]]:
    """``batch`` prompts of random token ids, 2-8 tokens long (left padding as in the benchmark's real prompts)."""
    rng = random.Random(seed)
    return [[rng.randrange(EOS) for _ in range(rng.randint(cfg.prompt_min_tokens, cfg.prompt_max_tokens))]
            for _ in range(batch)]


def decoder(name: str, cfg: BenchConfig, batch: int, bf16: bool, device: torch.device,
            cuda_graph: bool = True) -> Callable[[int], torch.Tensor]:
    """``run(n)``: ``n`` new tokens for every prompt through decoder ``name``, under the trainer's autocast."""
    torch.manual_seed(0)
    lm = fast_activations(GPT2LMHeadModel(GPT2Config(**gpt2_config_kwargs(cfg, EOS)))).to(device).eval()
    disable_dropout(lm)
    queries, query_mask = left_pad(random_prompts(cfg, batch), EOS, device)
    sampling = SamplingParams()

    def run(n: int) -> torch.Tensor:
        with autocast(device, "bf16" if bf16 else "fp32"):
            if name == "dynamic":
                return decode_dynamic(lm, queries, query_mask, n, sampling)
            return decode(lm, queries, query_mask, n, sampling, cuda_graph)

    return run


def seconds(run: Callable[[int], torch.Tensor], n: int) -> float:
    """Wall time of ``run(n)``; on CUDA the queued kernels are waited for."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    sync()
    start = time.perf_counter()
    run(n)
    sync()
    return time.perf_counter() - start


def op_counts(run: Callable[[int], torch.Tensor], n: int) -> tuple[Counter, int]:
    """Every ``aten::`` call of ``run(n)`` by name, and how many of them were called from Python (top level)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run(n)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top_level = sum(1 for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    return Counter(e.name for e in events), top_level


def measure(runs: dict[str, Callable[[int], torch.Tensor]], tokens: int, iters: int) -> dict[str, dict]:
    """Each decoder's first-token time, time per step and operator calls per step; the decoders take turns in every
    repetition, so a load change on a shared machine hits them alike, in an order reversed every other repetition
    (on CPU, whichever runs first after another decoder ran measured slower)."""
    pairs: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for run in runs.values():
        run(1 + tokens)  # warm-up: allocator, lazy init, CUDA graph capture
    for i in range(iters):
        for name in list(runs)[:: 1 if i % 2 == 0 else -1]:
            pairs[name].append((seconds(runs[name], 1), seconds(runs[name], 1 + tokens)))
    results = {}
    for name, run in runs.items():
        (ops, top), (ops_first, top_first) = op_counts(run, 1 + tokens), op_counts(run, 1)
        ops.subtract(ops_first)
        results[name] = {
            "first_token_ms": round(statistics.median(p[0] for p in pairs[name]) * 1e3, 3),
            "ms_per_step": round(statistics.median(p[1] - p[0] for p in pairs[name]) / tokens * 1e3, 3),
            "ops_per_step": round(ops.total() / tokens, 1),
            "top_level_ops_per_step": round((top - top_first) / tokens, 1), "ops": ops}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="toy")
    parser.add_argument("--batch", type=int, help="prompts per batch (default: the config's batch_size)")
    parser.add_argument("--tokens", type=int, default=16, help="decoding steps timed (new tokens after the first)")
    parser.add_argument("--iters", type=int, default=15, help="timed pairs (medians), after one warm-up")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own, one per core)")
    parser.add_argument("--precision", choices=["auto", "fp32"], default="auto",
                        help="auto: bf16 autocast where the device has native bf16 (as bench.ppo_step); fp32: none")
    parser.add_argument("--decoders", default=",".join(DECODERS), help=f"comma-separated, from: {', '.join(DECODERS)}")
    parser.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false",
                        help="on CUDA, run the static decoder's steps eagerly instead of as a CUDA graph")
    parser.add_argument("--top", type=int, default=8, help="list this many of each decoder's most frequent operators")
    args = parser.parse_args()
    names = [d for d in args.decoders.split(",") if d]
    if not names or any(d not in DECODERS for d in names):
        raise SystemExit(f"error: --decoders: expected a comma-separated list from {', '.join(DECODERS)}")
    set_threads(args.threads)

    cfg = CONFIGS[args.config]
    batch = args.batch or cfg.batch_size
    device, bf16 = pick_device(), use_bf16(args.precision)
    print(f"{args.config} ({cfg.n_layer} layers x {cfg.n_embd}, vocab {cfg.vocab_size}), batch {batch}, "
          f"{'bf16 autocast' if bf16 else 'fp32'}, {torch.get_num_threads()} threads, {device.type}")
    results = measure({name: decoder(name, cfg, batch, bf16, device, args.cuda_graph) for name in names},
                      args.tokens, args.iters)
    for name, r in results.items():
        ops = r.pop("ops")
        print(f"{name:>8}: prefill + first token {r['first_token_ms']:.2f} ms; per decoding step "
              f"{r['ms_per_step']:.3f} ms, {r['ops_per_step']:.1f} aten calls ({r['top_level_ops_per_step']:.1f} "
              "from Python)")
        print("          " + ", ".join(f"{n.removeprefix('aten::')} {c / args.tokens:.1f}"
                                       for n, c in ops.most_common(args.top)))
    if len(results) == 2:
        print(f"static / dynamic: {results['static']['ms_per_step'] / results['dynamic']['ms_per_step']:.2f}x the "
              "time per step")
    print(json.dumps({"config": args.config, "batch": batch, "precision": "bf16 mixed" if bf16 else "fp32",
                      "device": device.type, "torch_threads": torch.get_num_threads(), "tokens": args.tokens,
                      "iters": args.iters, "cuda_graph": args.cuda_graph and device.type == "cuda", **results}))


if __name__ == "__main__":
    run_stage(main)
