"""TRL 0.11.4's legacy ``PPOTrainer.step`` on a bench config, timed the way ``bench.ppo_step`` times ours.

Runs in its own venv (``python -m bench.compare --setup-only`` makes ``bench/.venvs/trl011``):
``bench/.venvs/trl011/bin/python -m bench.peers.trl_legacy --config bench-cpu --generate batched``

The loop is the classic notebook's (gpt2-sentiment.ipynb): ``ppo_trainer.generate`` -> score -> ``ppo_trainer.step``.
``--generate per-query`` calls ``generate`` once per prompt as the notebook does; ``batched`` passes the whole batch
as a list (TRL left-pads it and calls ``model.generate`` once). Phases: generate and score are timed around those
calls; forward = TRL's own ``time/ppo/forward_pass`` + ``compute_rewards`` + ``compute_advantages``; update =
``time/ppo/optimize_step``; the iteration is the wall time of all of it (TRL's stats bookkeeping included).

Settings are TRL's PPOConfig defaults (Adam, adaptive KL, ...) except the config's batch shape, epochs and learning
rate; sampling is the notebook's (top_k 0, top_p 1) with ``max_new_tokens`` = new_tokens and no EOS stop, as ours;
dropout off in the model and value head, as ours. Where the device has native bf16 (CUDA, or a CPU with AMX / AVX-512
BF16: ``bench.configs.use_bf16``), bf16 mixed precision through TRL's accelerator, as ours; on CUDA TRL's phase
clock reads after a CUDA synchronize (``SyncedClock``).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch
import trl.trainer.ppo_trainer
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel
from trl import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

from bench.configs import (
    CONFIGS,
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


class SyncedClock:
    """TRL reads ``time.time()`` between its phases; on CUDA a phase's kernels are still queued then, so its time
    would land in a later phase. Used as TRL's ``time`` module on CUDA: the same clock, after a synchronize."""

    @staticmethod
    def time() -> float:
        torch.cuda.synchronize()
        return time.time()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--generate", choices=["per-query", "batched"], default="batched")
    args = parser.parse_args()
    set_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning)  # "PPOTrainer is deprecated": we know

    cfg = CONFIGS[args.config]
    bf16 = use_bf16(args.precision)
    cuda = torch.cuda.is_available()
    if cuda:
        trl.trainer.ppo_trainer.time = SyncedClock
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    tokenizer.pad_token = tokenizer.eos_token
    batches = load_prompts(args.data, tokenizer, cfg, args.iters)

    torch.manual_seed(0)
    lm = GPT2LMHeadModel(GPT2Config(**gpt2_config_kwargs(cfg, tokenizer.eos_token_id)))
    ref = GPT2LMHeadModel(lm.config)
    ref.load_state_dict(lm.state_dict())
    config = PPOConfig(learning_rate=cfg.learning_rate, batch_size=cfg.batch_size, mini_batch_size=cfg.mini_batch_size,
                       ppo_epochs=cfg.ppo_epochs,
                       accelerator_kwargs={"mixed_precision": "bf16"} if bf16 else {})
    model, ref_model = (AutoModelForCausalLMWithValueHead.from_pretrained(m, summary_dropout_prob=0.0)
                        for m in (lm, ref))
    ppo_trainer = PPOTrainer(config, model, ref_model, tokenizer)
    device = ppo_trainer.accelerator.device
    # the notebook's sampling settings; eos_token_id None: every response gets exactly new_tokens tokens, as ours
    generation_kwargs = dict(min_length=-1, top_k=0.0, top_p=1.0, do_sample=True,
                             pad_token_id=tokenizer.eos_token_id, eos_token_id=None, max_new_tokens=cfg.new_tokens)

    rows = []
    for i, batch in enumerate(batches):
        row: dict[str, float] = {}
        with timed(row, "step"):
            queries = [torch.tensor(q, device=device) for q in batch]
            with timed(row, "generate"):
                if args.generate == "per-query":
                    responses = [ppo_trainer.generate(q, return_prompt=False, **generation_kwargs).squeeze(0)
                                 for q in queries]
                else:
                    responses = ppo_trainer.generate(queries, return_prompt=False, batch_size=len(queries),
                                                     **generation_kwargs)
            with timed(row, "score"):
                scores = [torch.tensor(stand_in_score(r.tolist())) for r in responses]
            stats = ppo_trainer.step(queries, responses, scores)
        # TRL cuts a response after a sampled EOS token (rare: ~1 in 50k per token), so "about", not "exactly"
        assert sum(map(len, responses)) >= (cfg.new_tokens - 1) * len(responses), "responses are short"
        row["forward"] = sum(stats[f"time/ppo/{k}"] for k in ("forward_pass", "compute_rewards", "compute_advantages"))
        row["update"] = stats["time/ppo/optimize_step"]
        print(f"iter {i}{' (warm-up, not counted)' if i == 0 else ''}: {row['step']:.2f} s", flush=True)
        if i > 0:
            rows.append(row)

    # TRL pads query + response of the whole batch and runs the LM head over every position
    positions = mean_padded_length(cfg, batches[1:])
    update = cfg.ppo_epochs * pass_flops(cfg, positions, positions, backward=True)
    forward = pass_flops(cfg, positions, positions, bodies=2, heads=2)  # policy + reference
    result = summarize(f"trl011-{args.generate}", cfg, batches, rows, update, forward, bf16,
                       notes="TRL 0.11.4 PPOTrainer.step; value head on the policy; LM head on every position")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
