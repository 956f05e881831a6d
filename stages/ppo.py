"""ppo: PPO against the reward scorer, from the initial policy (models/sft or model.policy).

Reads   data/prompts/train.parquet, the initial policy and reference (models/sft when sft.enabled, else
        model.policy), the reward (models/reward when reward.train, else reward.model)
Params  STAGE_PARAMS["ppo"] in stages/core/params.py (listed by --help)
Writes  models/policy/          the trained LM + tokenizer (AutoModelForCausalLM), value_head.safetensors beside it
        data/rollouts/*.parquet one row per sample per step
        metrics/ppo/            DVCLive curves (reward, KL, kl_coef, losses, clip fractions, throughput)
        metrics/ppo.json        summary

Multi-process: ``accelerate launch --num_processes N -m stages.ppo`` on GPUs, ``torchrun --nproc_per_node N -m
stages.ppo`` on CPU (each process samples ppo.batch_size prompts).
"""

from __future__ import annotations

import logging

from stages.core.errors import run_stage
from stages.core.io import write_json
from stages.core.loop import train
from stages.core.params import load_params


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    params = load_params()
    summary = train(params)
    write_json(summary, "metrics/ppo.json")
    logging.getLogger("ppo").info("ppo: %s", summary)


if __name__ == "__main__":
    run_stage(main)
