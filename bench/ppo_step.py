"""Seconds per PPO iteration of our trainer on a named config: ``python -m bench.ppo_step --config bench-cpu``.

Drives the real ``PPOTrainer.step`` (the ppo stage's code path) on a randomly initialised GPT-2 of the config's shape
with IMDb prompts and the stand-in scorer. One warm-up iteration is not counted. Prints a per-phase table, then, as
its last line, one JSON object (``bench.configs.summarize``): config, iters, s_per_iter (median wall time of a whole
iteration), generate_s, score_s, forward_s, update_s, samples_per_s, tokens_per_s, peak_mem_mb, update_gflops,
peak_gflops, update_share_of_peak, learn_gflops, prompts_sha1, estimator, samples_per_prompt.

``--estimator rloo --samples-per-prompt 4`` times another ppo.advantage_estimator at the same batch_size (samples):
each iteration answers the first batch_size / k prompts of its batch k times each. ``--value-model separate`` gives
gae its own critic. ``--lora-r 16`` trains LoRA adapters (model.lora's other keys at their defaults) against the
adapters-off reference instead of every weight against a second model. ``--compile true|false`` sets ppo.compile
(default auto, as the stage: compiled on CUDA only); the warm-up iteration pays the compilation.
``--gradient-checkpointing``: model.gradient_checkpointing true (the update recomputes the policy's activations).
"""

from __future__ import annotations

import argparse
import json
import typing

import torch
from pydantic import ValidationError
from transformers import GPT2Config, GPT2LMHeadModel

from bench.configs import (
    CONFIGS,
    PHASES,
    BenchConfig,
    add_common_args,
    gpt2_config_kwargs,
    load_prompts,
    mean_padded_length,
    pass_flops,
    set_threads,
    stand_in_score,
    summarize,
    timed,
    use_bf16,
)
from rlhf.models.devices import pick_device
from rlhf.models.loading import fast_activations, load_tokenizer
from rlhf.models.lora import add_lora
from rlhf.models.policy import PolicyWithValueHead, checkpoint_activations, disable_dropout
from rlhf.pipeline.cli import run_stage
from rlhf.pipeline.params import defaults
from rlhf.pipeline.ppo_params import PpoParams
from rlhf.pipeline.section import Rule
from rlhf.train.compiled import step_metrics
from rlhf.train.ppo_trainer import PPOTrainer


class StandInScorer:
    name = "stand_in"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, queries: list[str], responses: list[str], response_ids: object = None) -> torch.Tensor:
        ids = self.tokenizer(responses, add_special_tokens=False)["input_ids"]
        return torch.tensor([stand_in_score(r) for r in ids], dtype=torch.float32)


def ppo_params(cfg: BenchConfig, args: argparse.Namespace) -> PpoParams:
    """The config's PPO settings with the command line's estimator; a broken rule ends the run with one line."""
    try:
        return PpoParams.model_validate(defaults().ppo.model_dump() | dict(
            batch_size=cfg.batch_size, mini_batch_size=cfg.mini_batch_size, ppo_epochs=cfg.ppo_epochs,
            learning_rate=cfg.learning_rate, response_min_tokens=cfg.new_tokens, response_max_tokens=cfg.new_tokens,
            advantage_estimator=args.estimator, samples_per_prompt=args.samples_per_prompt,
            value_model=args.value_model, compile={"true": True, "false": False}.get(args.compile, args.compile)))
    except ValidationError as e:
        error = e.errors()[0]
        rule = (error.get("ctx") or {}).get("error")
        key, message = (rule.key, rule.rule) if isinstance(rule, Rule) else (error["loc"][0], error["msg"])
        raise SystemExit(f"ppo.{key}: {message} (--config {cfg.name} with the command line's options)") from None


def build_trainer(cfg: BenchConfig, ppo: PpoParams, tokenizer, device: torch.device, bf16: bool,
                  lora_r: int = 0, gradient_checkpointing: bool = False) -> PPOTrainer:
    torch.manual_seed(0)
    config = GPT2Config(**gpt2_config_kwargs(cfg, tokenizer.eos_token_id))
    lm = fast_activations(GPT2LMHeadModel(config))
    if lora_r:
        add_lora(lm, defaults().model.lora.model_copy(update={"r": lora_r}))
        ref = None
    else:
        ref = fast_activations(GPT2LMHeadModel(config))
        ref.load_state_dict(lm.state_dict())
        disable_dropout(ref)
        ref = ref.to(device)
    disable_dropout(lm)
    policy = PolicyWithValueHead(lm, ppo.critic).to(device)
    if gradient_checkpointing:
        checkpoint_activations(policy)
    return PPOTrainer(policy, ref, tokenizer, StandInScorer(tokenizer), ppo, device, "bf16" if bf16 else "fp32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--estimator", choices=typing.get_args(PpoParams.model_fields["advantage_estimator"]
                                                               .annotation), default="gae",
                        help="ppo.advantage_estimator")
    parser.add_argument("--samples-per-prompt", type=int, default=1, help="ppo.samples_per_prompt (k)")
    parser.add_argument("--value-model", choices=["shared", "separate"], default="shared",
                        help="ppo.value_model (gae only)")
    parser.add_argument("--lora-r", type=int, default=0, help="model.lora.r (0: every weight trains)")
    parser.add_argument("--compile", choices=["auto", "true", "false"], default="auto", help="ppo.compile")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="model.gradient_checkpointing: true")
    args = parser.parse_args()
    set_threads(args.threads)

    cfg = CONFIGS[args.config]
    device = pick_device()
    ppo = ppo_params(cfg, args)
    if args.lora_r and ppo.critic == "separate":
        raise SystemExit("--value-model separate: LoRA keeps one copy of the weights; a separate critic is a second")
    tokenizer = load_tokenizer(args.tokenizer, defaults().model, what="--tokenizer")
    batches = [batch[: ppo.prompts_per_step] for batch in load_prompts(args.data, tokenizer, cfg, args.iters)]
    bf16 = use_bf16(args.precision)
    trainer = build_trainer(cfg, ppo, tokenizer, device, bf16, args.lora_r, args.gradient_checkpointing)

    rows = []
    for i, batch in enumerate(batches):
        row: dict[str, float] = {}
        with timed(row, "step"):
            stats = trainer.step(batch, tokenizer.batch_decode(batch), step=i).stats
        row |= {phase: stats[f"time/{phase}"] for phase in PHASES}
        print(f"iter {i}{' (warm-up, not counted)' if i == 0 else ''}: {row['step']:.2f} s", flush=True)
        if i > 0:  # the first iteration pays one-time costs (allocator warm-up, lazy init)
            rows.append(row)

    # bodies run over the padded batch, LM heads over the response positions only; a shared value head costs no
    # body, a separate critic one more
    critic, compiled = ppo.critic, step_metrics(trainer.compiled_step)["compiled"]
    positions = mean_padded_length(cfg, batches[1:])
    bodies = 2 if critic == "separate" else 1
    update = cfg.ppo_epochs * pass_flops(cfg, positions, cfg.new_tokens, bodies=bodies, backward=True,
                                         weight_grads=not args.lora_r)
    forward = pass_flops(cfg, positions, cfg.new_tokens, bodies=1 + bodies, heads=2)  # policy (+ critic) + reference
    notes = f"{critic} value head" if critic else "no value head"
    lora = (f"LoRA r={args.lora_r}, the reference its adapters off" if args.lora_r
            else "every weight trained, a second model as reference")
    result = summarize("ours", cfg, batches, rows, update, forward, bf16,
                       notes=f"{ppo.advantage_estimator}, k={ppo.samples_per_prompt}; {notes}; {lora}; LM head on "
                             f"response positions only; update {'compiled' if compiled else 'eager'}")
    print(json.dumps(result | {"estimator": ppo.advantage_estimator, "samples_per_prompt": ppo.samples_per_prompt,
                               "lora_r": args.lora_r, "compiled": compiled,
                               "gradient_checkpointing": args.gradient_checkpointing}))


if __name__ == "__main__":
    run_stage(main)
