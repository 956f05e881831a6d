"""reward: a preference reward model trained on chosen/rejected pairs (Bradley-Terry).

Reads   data/pairs/{train,test}.parquet, the initial model (models/sft, a Hub id / local dir, or scratch)
Params  STAGE_PARAMS["reward"] in stages/core/params.py (listed by --help)
Writes  models/reward/                  one-output sequence classifier + tokenizer; only a DISABLED marker when
                                        reward.train is false (ppo then scores with reward.model)
        metrics/reward.json             held-out pair accuracy, mean margin, score means
        metrics/reward/scores.csv       score histogram of positive (chosen) vs negative (rejected) test snippets
The outputs are replaced together when the stage completes, or not at all (stages/core/io.py's StagedOutputs).
"""

from __future__ import annotations

import logging

from stages.core.checkpoint import weights_bytes
from stages.core.errors import DataError, run_stage
from stages.core.io import StagedOutputs, atomic_path, seed_everything, write_json, write_text
from stages.core.params import Params, load_params
from stages.core.paths import REWARD_DIR, REWARD_METRICS, REWARD_SCORES, TEST_PAIRS, TRAIN_PAIRS
from stages.core.plots import histogram
from stages.core.reward_model import build, evaluate, read_pairs, train
from stages.core.training import pick_device, run_switchable


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    params = load_params()
    run_switchable("reward", params.reward.train, lambda outputs: train_reward(params, outputs),
                   REWARD_DIR, "reward.train is false: ppo and evaluate score with reward.model",
                   {REWARD_METRICS: '{"trained": false}\n', REWARD_SCORES: "score,positive,negative\n"})


def train_reward(params: Params, outputs: StagedOutputs) -> None:
    generator = seed_everything(params.seed)
    train_pairs, test_pairs = read_pairs(TRAIN_PAIRS), read_pairs(TEST_PAIRS)
    if len(train_pairs) < params.reward.batch_size:
        raise DataError(f"{TRAIN_PAIRS}: {len(train_pairs)} pairs, fewer than reward.batch_size="
                        f"{params.reward.batch_size}")
    model, tokenizer = build(params)
    outputs.check_free_space(REWARD_DIR, weights_bytes(model))
    device = pick_device()
    model.to(device)
    result = train(model, tokenizer, train_pairs, params, device, generator)
    chosen, rejected = evaluate(model, tokenizer, test_pairs, params.reward.max_length, device)
    with atomic_path(outputs[REWARD_DIR]) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    metrics = {"trained": True, "accuracy": round((chosen > rejected).float().mean().item(), 4),
               "margin_mean": round((chosen - rejected).mean().item(), 4),
               "chosen_score_mean": round(chosen.mean().item(), 4),
               "rejected_score_mean": round(rejected.mean().item(), 4),
               "train_loss": round(sum(result.losses[-20:]) / len(result.losses[-20:]), 4),
               "pairs": len(train_pairs), "seconds": round(result.seconds, 1)}
    write_json(metrics, outputs[REWARD_METRICS])
    write_text(histogram({"positive": chosen.numpy(), "negative": rejected.numpy()}, x="score").to_csv(index=False),
               outputs[REWARD_SCORES])
    logging.getLogger("reward").info("reward: held-out pair accuracy %.3f", metrics["accuracy"])


if __name__ == "__main__":
    run_stage(main)
