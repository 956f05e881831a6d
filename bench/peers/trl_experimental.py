"""TRL 1.12.0's ``trl.experimental.ppo.PPOTrainer`` on a bench config, timed the way ``bench.ppo_step`` times ours.

Runs in its own venv (``python -m bench.compare --setup-only`` makes ``bench/.venvs/trl112``):
``bench/.venvs/trl112/bin/python -m bench.peers.trl_experimental --config bench-cpu``

TRL 1.x has no step-by-step API: ``PPOTrainer.train()`` runs every iteration itself, sampling prompts from a
DataLoader and scoring with a reward *model*. What this script does to it, and nothing more:

- the reward model is ``StandInRewardModel``: TRL calls it through its own ``get_reward`` like any sequence
  classifier (backbone, then ``score`` read at the last response token); its score there is ``stand_in_score`` of
  the response's tokens, the function every peer scores with;
- the shuffled prompt DataLoader is replaced by the benchmark's batches in order (left-padded as TRL's collator
  would), so every iteration sees the same prompts as ours;
- timings: the module-level functions ``train()`` calls are wrapped (``batch_generation`` = generate, ``get_reward``
  on the reward model = score; the first ``forward`` with gradients on marks the start of the update) and a
  callback's ``on_step_end`` closes each iteration. forward = the rest of the iteration: the reference and value
  model passes, log-probs, rewards, advantages.

Training settings are TRL's defaults except the config's batch shape (per-device batch = batch_size, num_mini_batches
= batch_size / mini_batch_size, local_rollout_forward_batch_size = batch_size), response_length = new_tokens, the
learning rate, no stop token (every response is new_tokens long, as ours), bf16 only where the device has it natively
(``bench.configs.use_bf16``: TRL's default would also turn on emulated bf16 on a CPU without it), and no sample
generations or checkpoints.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from types import SimpleNamespace

import torch
import trl.experimental.ppo.ppo_trainer as ppo_module
from datasets import Dataset
from torch import nn
from transformers import AutoTokenizer, GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, TrainerCallback
from trl.experimental.ppo import PPOConfig, PPOTrainer

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


class IdsAsHidden(nn.Module):
    """The stand-in reward model's backbone: hands the token ids on as its last hidden state."""

    def forward(self, input_ids: torch.Tensor, **kwargs: object) -> SimpleNamespace:
        return SimpleNamespace(hidden_states=(input_ids.unsqueeze(-1),))


class StandInRewardModel(nn.Module):
    """Scores position t with ``stand_in_score`` of the ``window`` tokens ending at t; TRL reads the score at the
    last response token, where that window is exactly the response."""

    base_model_prefix = "backbone"

    def __init__(self, window: int) -> None:
        super().__init__()
        self.backbone = IdsAsHidden()
        self.window = window

    def score(self, hidden: torch.Tensor) -> torch.Tensor:  # (B, L, 1) token ids -> (B, L, 1) scores
        w = self.window
        scores = [[stand_in_score(row[max(0, t - w + 1): t + 1]) for t in range(len(row))]
                  for row in hidden.squeeze(-1).tolist()]
        return torch.tensor(scores, device=hidden.device).unsqueeze(-1)


def check_scores(scores: torch.Tensor, responses: torch.Tensor, pad_token_id: int) -> None:
    """TRL read exactly ``stand_in_score(response)``: checked on every response without a pad (= EOS) token, where
    TRL's last-token position is the response's end."""
    expected = torch.tensor([stand_in_score(r) for r in responses.tolist()])
    full = ~(responses == pad_token_id).any(1).cpu()
    if not torch.allclose(scores.float().cpu()[full], expected[full]):
        raise RuntimeError("the reward TRL read is not the stand-in score of the response")


class PhaseClock(TrainerCallback):
    """Per-iteration phase times of TRL's ``train()``, from wrapped module functions and ``on_step_end``."""

    def __init__(self, reward_model: nn.Module) -> None:
        self.reward_model = reward_model
        self.rows: list[dict[str, float]] = []
        self.row: dict[str, float] = {}
        self.start = 0.0

    def now(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def instrument(self) -> None:
        batch_generation, get_reward, forward = ppo_module.batch_generation, ppo_module.get_reward, ppo_module.forward

        def timed_generation(*args, **kwargs):
            with timed(self.row, "generate"):
                return batch_generation(*args, **kwargs)

        def timed_reward(model, query_responses, pad_token_id, context_length):
            if model is not self.reward_model:  # the value model's rollout pass: part of forward
                return get_reward(model, query_responses, pad_token_id, context_length)
            with timed(self.row, "score"):
                out = get_reward(model, query_responses, pad_token_id, context_length)
            check_scores(out[1], query_responses[:, context_length:], pad_token_id)
            return out

        def marked_forward(*args, **kwargs):
            if torch.is_grad_enabled() and "update_start" not in self.row:  # the first PPO minibatch
                self.row["update_start"] = self.now()
            return forward(*args, **kwargs)

        ppo_module.batch_generation, ppo_module.get_reward = timed_generation, timed_reward
        ppo_module.forward = marked_forward

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = self.now()

    def on_step_end(self, args, state, control, **kwargs):
        end = self.now()
        row, self.row = self.row, {}
        row["step"] = end - self.start
        row["update"] = end - row.pop("update_start")
        row["forward"] = row["step"] - row["generate"] - row["score"] - row["update"]
        self.rows.append(row)
        print(f"iter {len(self.rows) - 1}{' (warm-up, not counted)' if len(self.rows) == 1 else ''}: "
              f"{row['step']:.2f} s", flush=True)
        self.start = end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    args = parser.parse_args()
    set_threads(args.threads)

    cfg = CONFIGS[args.config]
    bf16 = use_bf16(args.precision)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, padding_side="left")
    tokenizer.pad_token = tokenizer.eos_token
    batches = load_prompts(args.data, tokenizer, cfg, args.iters)

    torch.manual_seed(0)
    config = GPT2Config(**gpt2_config_kwargs(cfg, tokenizer.eos_token_id), num_labels=1,
                        pad_token_id=tokenizer.pad_token_id)
    policy, ref, value_model = GPT2LMHeadModel(config), GPT2LMHeadModel(config), GPT2ForSequenceClassification(config)
    ref.load_state_dict(policy.state_dict())
    reward_model = StandInRewardModel(cfg.new_tokens)
    training_args = PPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl112-bench-"), report_to="none", save_strategy="no",
        num_sample_generations=0, seed=0, bf16=bf16, use_cpu=not torch.cuda.is_available(),
        learning_rate=cfg.learning_rate,
        per_device_train_batch_size=cfg.batch_size, gradient_accumulation_steps=1,
        num_mini_batches=cfg.batch_size // cfg.mini_batch_size, num_ppo_epochs=cfg.ppo_epochs,
        local_rollout_forward_batch_size=cfg.batch_size, response_length=cfg.new_tokens, stop_token=None,
        total_episodes=cfg.batch_size * len(batches), logging_steps=1, disable_tqdm=True,
    )
    clock = PhaseClock(reward_model)
    trainer = PPOTrainer(training_args, tokenizer, policy, ref, reward_model,
                         Dataset.from_dict({"input_ids": [q for batch in batches for q in batch]}), value_model,
                         callbacks=[clock])
    trainer.dataloader = [tokenizer.pad({"input_ids": batch}, return_tensors="pt") for batch in batches]
    clock.instrument()
    trainer.train()

    # a separate value model trains its own transformer; the LM heads see every padded position; the rollout's
    # policy log-probs come from generate's scores, so its forward phase runs the reference and the value model
    positions = mean_padded_length(cfg, batches[1:])
    update = cfg.ppo_epochs * pass_flops(cfg, positions, positions, bodies=2, backward=True)
    forward = pass_flops(cfg, positions, positions, bodies=2, heads=1)
    result = summarize("trl112", cfg, batches, clock.rows[1:], update, forward, bf16,
                       notes="TRL 1.12.0 trl.experimental.ppo.PPOTrainer.train; separate value model; "
                             "LM head on every position")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
