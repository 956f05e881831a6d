"""Log-prob error of each reduced-precision path against float64: ``python -m bench.logprob_error``.

The model (``--model``, a saved causal LM, e.g. models/policy after a run) samples ``--tokens`` tokens for each of
``--prompts`` prompts of ``--prompt-file`` (fp32, seed 0); each path below then scores the sampled tokens, and its
per-token and per-sequence absolute differences from float64 are printed (mean / p99 / max), then one JSON line.

- ``fp32``: ``rollout.forward`` without autocast (``model.precision: fp32``).
- ``bf16``: ``rollout.forward`` under bf16 autocast (``model.precision: bf16``, what ``auto`` picks on a GPU): the
  body in bf16, the LM head fp32 on CPU and TF32 on CUDA.
- ``fp32+tf32-head``: the body in fp32, the head's inputs rounded to TF32 (below): the head's own share.
- ``bf16+tf32-head``: the body in bf16, the head's inputs rounded to TF32 (11 significant bits, round to nearest)
  and multiplied in fp32: TF32 emulated on any device (on CUDA, ``bf16`` is the real thing).
- ``bf16+tf32-head-truncated``: the same, the inputs truncated instead of rounded (the worse of the two roundings).
- ``bf16+bf16-head``: body and head in bf16, the logits rounded to bf16 (TRL's choice under autocast; not ours).

The rollout and the update run the same path, so none of these moves PPO's first ratio off 1; what they change is
how well the log-probs (and the KL to the reference) match the exact ones.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from bench.configs import set_threads
from rlhf.data.prompts import read_prompts
from rlhf.models.devices import pick_device
from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.models.policy import backbone_hidden, disable_dropout
from rlhf.models.precision import autocast, full_precision
from rlhf.models.rollout import Samples, SamplingParams, forward, generate
from rlhf.pipeline.cli import run_stage
from rlhf.pipeline.params import defaults
from rlhf.rl.logprobs import logprobs_and_entropy

TF32_DROPPED_BITS = 13  # fp32 keeps 23 explicit mantissa bits, TF32 10


def round_to_tf32(x: torch.Tensor, truncate: bool = False) -> torch.Tensor:
    """fp32 ``x`` with its mantissa cut to TF32's 10 explicit bits: rounded to nearest (ties to even) or truncated."""
    bits = x.float().contiguous().view(torch.int32)
    if not truncate:
        half = (1 << (TF32_DROPPED_BITS - 1)) - 1
        bits = bits + half + ((bits >> TF32_DROPPED_BITS) & 1)  # finite values only: no NaN/inf in a model's weights
    return (bits & ~((1 << TF32_DROPPED_BITS) - 1)).view(torch.float32)


def head_logprobs(lm: torch.nn.Module, samples: Samples, head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  precision: str) -> torch.Tensor:
    """(B, R) log-probs with the body under ``precision``'s autocast and ``head(hidden, weight)`` for the logits."""
    with torch.no_grad(), autocast(samples.query_responses.device, precision):
        hidden = backbone_hidden(lm.base_model, samples.query_responses, samples.attention_mask,
                                 samples.context_length)
        logits = head(hidden, lm.get_output_embeddings().weight)
    return logprobs_and_entropy(logits, samples.responses)[0]


def tf32_head(truncate: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def head(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        with full_precision(hidden.device):
            return round_to_tf32(hidden, truncate) @ round_to_tf32(weight, truncate).T
    return head


def paths(lm: torch.nn.Module, lm64: torch.nn.Module) -> dict[str, Callable[[Samples], torch.Tensor]]:
    """Name -> the (B, R) log-probs that path gives the sampled tokens; 'fp64' is the reference."""

    def production(precision: str) -> Callable[[Samples], torch.Tensor]:
        def run(samples: Samples) -> torch.Tensor:
            with torch.no_grad(), autocast(samples.query_responses.device, precision):
                return forward(lm, samples, 1.0).logprobs
        return run

    return {
        "fp64": lambda s: head_logprobs(lm64, s, lambda h, w: h.double() @ w.T, "fp32"),
        "fp32": production("fp32"),
        "bf16": production("bf16"),
        "fp32+tf32-head": lambda s: head_logprobs(lm, s, tf32_head(truncate=False), "fp32"),
        "bf16+tf32-head": lambda s: head_logprobs(lm, s, tf32_head(truncate=False), "bf16"),
        "bf16+tf32-head-truncated": lambda s: head_logprobs(lm, s, tf32_head(truncate=True), "bf16"),
        "bf16+bf16-head": lambda s: head_logprobs(lm, s, lambda h, w: h @ w.T, "bf16"),
    }


def differences(logprobs: torch.Tensor, exact: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Per real token and per sequence (the sum over its tokens): mean, p99 and max of |logprobs - exact|."""
    diff = (logprobs.double() - exact) * mask
    token = diff[mask].abs()
    sequence = diff.sum(1).abs()
    return {"token_mean": token.mean().item(), "token_p99": token.quantile(0.99).item(),
            "token_max": token.max().item(), "sequence_mean": sequence.mean().item(),
            "sequence_max": sequence.max().item()}


def measure(model: str, prompt_file: Path, n_prompts: int, tokens: int, batch_size: int,
            device: torch.device) -> dict[str, dict[str, float]]:
    model_params = defaults().model
    tokenizer = load_tokenizer(model, model_params, what="--model")
    lm = load_causal_lm(model, model_params, what="--model", dtype=torch.float32).to(device).eval()
    disable_dropout(lm)
    lm64 = load_causal_lm(model, model_params, what="--model", dtype=torch.float64).to(device).eval()
    query_ids = read_prompts(prompt_file).input_ids[:n_prompts]
    torch.manual_seed(0)
    runs = paths(lm, lm64)
    scored: dict[str, list[torch.Tensor]] = {name: [] for name in runs}
    masks = []
    for start in range(0, len(query_ids), batch_size):
        batch = query_ids[start: start + batch_size]
        samples = generate(lm, tokenizer, batch, [tokens] * len(batch), SamplingParams())
        masks.append(samples.response_mask)
        for name, run in runs.items():
            scored[name].append(run(samples))
    mask = torch.cat(masks)
    exact = torch.cat(scored.pop("fp64")).double()
    return {name: differences(torch.cat(parts), exact, mask) for name, parts in scored.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/policy", help="a saved causal LM folder (with its tokenizer)")
    parser.add_argument("--prompt-file", type=Path, default=Path("data/prompts/eval.parquet"),
                        help="prompts as prepare writes them")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=16, help="sampled tokens per prompt")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own, one per core)")
    args = parser.parse_args()
    set_threads(args.threads)
    device = pick_device()
    results = measure(args.model, args.prompt_file, args.prompts, args.tokens, args.batch_size, device)
    print(f"{args.model}: {args.prompts} prompts x {args.tokens} sampled tokens on {device.type}; absolute "
          "log-prob difference from float64, nats")
    print(f"{'path':>26}  per token: mean / p99 / max          per sequence: mean / max")
    for name, r in results.items():
        print(f"{name:>26}  {r['token_mean']:.1e} / {r['token_p99']:.1e} / {r['token_max']:.1e}"
              f"          {r['sequence_mean']:.1e} / {r['sequence_max']:.1e}")
    print(json.dumps({"model": args.model, "device": device.type, "results": results}))


if __name__ == "__main__":
    run_stage(main)
