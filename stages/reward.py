"""reward: a preference reward model trained on chosen/rejected pairs (Bradley-Terry).

Reads   data/pairs/{train,test}.parquet, the initial model (models/sft, a Hub id / local dir, or scratch)
Writes  models/reward/                  one-output sequence classifier + tokenizer; only a DISABLED marker when
                                        reward.train is false (ppo then scores with reward.model)
        metrics/reward.json             held-out pair accuracy, mean margin, score means
        metrics/reward/scores.csv       score histogram of positive (chosen) vs negative (rejected) test snippets
        metrics/reward/system.csv       CPU, memory and GPU use while training (rlhf/train/system_use.py)
The outputs are replaced together when the stage completes, or not at all (rlhf/pipeline/io.py's StagedOutputs).
"""

from __future__ import annotations

import logging
from pathlib import Path

from rlhf.pipeline.cli import run_stage
from rlhf.pipeline.errors import DataError
from rlhf.pipeline.io import StagedOutputs, run_switchable, write_json, write_text
from rlhf.pipeline.params import Params, load_params
from rlhf.pipeline.paths import REWARD_DIR, TEST_PAIRS, TRAIN_PAIRS
from rlhf.train.system_use import HEADER as SYSTEM_HEADER

STAGE = "reward"
REWARD_METRICS = Path("metrics/reward.json")
REWARD_SCORES = Path("metrics/reward/scores.csv")
REWARD_SYSTEM = Path("metrics/reward/system.csv")
# what to lower when the GPU runs out of memory
OUT_OF_MEMORY = "lower reward.batch_size or reward.max_length"


def main() -> None:
    params = load_params(STAGE)
    run_switchable(STAGE, params.reward.train, lambda outputs: train_reward(params, outputs),
                   REWARD_DIR, "reward.train is false: ppo and evaluate score with reward.model",
                   {REWARD_METRICS: '{"reward": {"trained": false}}\n', REWARD_SCORES: "score,positive,negative\n",
                    REWARD_SYSTEM: SYSTEM_HEADER})


def train_reward(params: Params, outputs: StagedOutputs) -> None:
    # imported here: switched off, the stage loads none of it (stages/__init__.py)
    from rlhf.data.pairs import read_pairs
    from rlhf.eval.plots import histogram
    from rlhf.models.devices import pick_device
    from rlhf.models.loading import save_pretrained
    from rlhf.train.checkpoint import weights_bytes
    from rlhf.train.reward_model import build, evaluate, train
    from rlhf.train.rng import seed_everything
    from rlhf.train.system_use import SystemUse

    generator = seed_everything(params.seed)
    train_pairs, test_pairs = read_pairs(TRAIN_PAIRS), read_pairs(TEST_PAIRS)
    if len(train_pairs) < params.reward.batch_size:
        raise DataError(f"{TRAIN_PAIRS}: {len(train_pairs)} pairs, fewer than reward.batch_size="
                        f"{params.reward.batch_size}")
    model, tokenizer = build(params)
    outputs.check_free_space(REWARD_DIR, weights_bytes(model))
    device = pick_device()
    model.to(device)
    with outputs.steps(), SystemUse(device) as system:
        result = train(model, tokenizer, train_pairs, params, device, generator)
    chosen, rejected = evaluate(model, tokenizer, test_pairs, params.reward.max_length, device)
    save_pretrained(model, tokenizer, outputs[REWARD_DIR])
    metrics = {"trained": True, "accuracy": round((chosen > rejected).float().mean().item(), 4),
               "margin_mean": round((chosen - rejected).mean().item(), 4),
               "chosen_score_mean": round(chosen.mean().item(), 4),
               "rejected_score_mean": round(rejected.mean().item(), 4),
               "train_loss": round(sum(result.losses[-20:]) / len(result.losses[-20:]), 4),
               "pairs": len(train_pairs), "seconds": round(result.seconds, 1), "system": system.summary()}
    write_json({"reward": metrics}, outputs[REWARD_METRICS])
    write_text(histogram({"positive": chosen.numpy(), "negative": rejected.numpy()}, x="score").to_csv(index=False),
               outputs[REWARD_SCORES])
    system.write(outputs[REWARD_SYSTEM])
    logging.getLogger("reward").info("reward: held-out pair accuracy %.3f", metrics["accuracy"])


if __name__ == "__main__":
    run_stage(main, OUT_OF_MEMORY)
