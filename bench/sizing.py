"""Memory per GPU of a ppo run by policy size and by what is turned on: the table in docs/gpu.md.

``python -m bench.sizing`` prints it. The weights, gradient and optimizer terms are counted, not guessed: the ppo stage
reports what its main process holds (``weights_and_optimizer_bytes`` in metrics/ppo.json), and
tests/test_sharding.py checks ``state_bytes`` against it, whole and sharded over 2 processes. The activation and
logits terms are the textbook counts (per layer and token, a bf16 body keeps about 34 x hidden bytes for its
backward: Korthikanti et al. 2022, flash attention keeping no scores; checkpointed, its input alone), not measured.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

FP32 = 4
ADAM_MOMENTS = 2  # exp_avg, exp_avg_sq: fp32 each
ACTIVATION_BYTES = 34  # per layer, token and hidden unit, bf16 body (Korthikanti et al. 2022, no attention scores)
LOGIT_COPIES = 3  # fp32 logits, their log-softmax and their gradient
GIB = 1024**3


@dataclass(frozen=True)
class Model:
    name: str
    params: float
    layers: int
    hidden: int
    vocab: int


MODELS = (Model("124M (GPT-2)", 124e6, 12, 768, 50257), Model("1.5B (GPT-2 XL)", 1.56e9, 48, 1600, 50257),
          Model("7B (Qwen2.5-7B)", 7.6e9, 28, 3584, 152064))


def state_bytes(params: float, trained: float, processes: int = 1, shard: bool = False,
                reference: bool = True) -> float:
    """Weights (fp32), gradients and AdamW moments of the ``trained`` parameters, the frozen ``params`` (the base of
    a LoRA run: ``params`` - ``trained``) and, without LoRA, the reference's copy; each divided over ``processes``
    when sharded."""
    frozen = params - trained + (params if reference else 0)
    total = trained * FP32 * (1 + 1 + ADAM_MOMENTS) + frozen * FP32
    return total / processes if shard else total


def optimizer_held_bytes(trained: float) -> float:
    """What metrics/ppo.json's ``weights_and_optimizer_bytes`` counts of ``state_bytes``: trained weights and moments
    (gradients are freed between updates, the reference is another module)."""
    return trained * FP32 * (1 + ADAM_MOMENTS)


def activation_bytes(model: Model, tokens: int, checkpointing: bool) -> float:
    """The body's saved activations for ``tokens`` positions of one mini-batch; checkpointed, each layer's input
    plus one layer recomputed at a time."""
    per_layer = ACTIVATION_BYTES * model.hidden * tokens
    return (2 * model.hidden * tokens * model.layers + per_layer) if checkpointing else per_layer * model.layers


def logits_bytes(model: Model, tokens: int, chunk: int | None) -> float:
    """The LM head's fp32 logits over ``tokens`` positions, or over a ``chunk`` of them at a time."""
    return LOGIT_COPIES * FP32 * model.vocab * (min(tokens, chunk) if chunk else tokens)


def per_gpu(model: Model, gpus: int, lora: bool, chunk: int | None, checkpointing: bool, tokens: int) -> float:
    """Peak bytes per GPU of the update: the sharded (gpus > 1) or whole state plus one mini-batch's activations
    and logits; the rollout's peak (the policy gathered whole once, fp32) when higher."""
    trained = model.params * 0.005 if lora else model.params  # LoRA r=16 on the attention and MLP: ~0.5 %
    state = state_bytes(model.params, trained, gpus, shard=gpus > 1, reference=not lora)
    update = state + activation_bytes(model, tokens, checkpointing) + logits_bytes(model, tokens, chunk)
    rollout = state + (model.params * FP32 if gpus > 1 else 0)
    return max(update, rollout)


# (model, what is on: lora, chunk, checkpointing, GPUs) rows of the table
PLANS = [
    (MODELS[0], False, None, False, 1),
    (MODELS[1], False, None, False, 1),
    (MODELS[1], False, 1024, True, 1),
    (MODELS[1], True, 1024, True, 1),
    (MODELS[2], False, None, False, 1),
    (MODELS[2], True, 1024, True, 1),
    (MODELS[2], False, 1024, True, 8),
    (MODELS[2], False, 1024, True, 16),
]


def table(tokens: int) -> str:
    rows = ["| policy | LoRA | chunked log-probs | activation checkpointing | GPUs (FSDP2 when > 1) | GiB per GPU |",
            "| --- | --- | --- | --- | --- | --- |"]
    for model, lora, chunk, checkpointing, gpus in PLANS:
        gib = per_gpu(model, gpus, lora, chunk, checkpointing, tokens) / GIB
        rows.append(f"| {model.name} | {'yes' if lora else 'no'} | {chunk or 'no'} | "
                    f"{'yes' if checkpointing else 'no'} | {gpus}{' (2 nodes)' if gpus > 8 else ''} | {gib:.0f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8 * 1024, help="positions per mini-batch (8 x 1024)")
    print(table(parser.parse_args().tokens))


if __name__ == "__main__":
    main()
