"""dpo: the initial policy trained on preference pairs by DPO or IPO (dpo.loss), no reward model and no RL.

Reads   the pairs of dpo.pairs: data/pairs/{train,test}.parquet (prepare's, the reward model's own) or
        data/sampled_pairs/{train,test}.parquet (the sample_pairs stage's); the initial policy, also the frozen
        reference (models/sft when sft.enabled, else model.policy)
Writes  models/dpo/        the trained LM + tokenizer (AutoModelForCausalLM); only a DISABLED marker when method is
                           not dpo (evaluate then reads the method's own policy)
        metrics/dpo/       DVCLive curves: each step's batch (train/loss, train/rewards/*, train/logratios/*) and, ten
                           times a run, the held-out test pairs' (eval/rewards/accuracies, eval/rewards/margins, ...)
        metrics/dpo.json   summary: the held-out stats at the end, pairs, steps, seconds
The reference's log-probs are computed once, before training (rlhf/train/dpo.py). The outputs are replaced together
when the stage completes, or not at all; with dpo.checkpoint_every a rerun after a kill resumes from the newest
checkpoint in data/checkpoints/dpo/ to the same result.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from collections.abc import Callable
from pathlib import Path

import pandas as pd
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.data.pairs import read_pairs
from rlhf.models.loading import context_size, initial_policy, load_initial_policy
from rlhf.pipeline.cli import run_stage
from rlhf.pipeline.errors import DataError, ModelError
from rlhf.pipeline.io import DISABLED_MARKER, StagedOutputs, atomic_path, run_switchable, write_json, write_text
from rlhf.pipeline.params import load_params
from rlhf.pipeline.paths import (
    DPO_CURVES,
    DPO_DIR,
    DPO_METRICS,
    PAIRS_DIR,
    SAMPLED_PAIRS_DIR,
    SAMPLED_TEST_PAIRS,
    SAMPLED_TRAIN_PAIRS,
    SFT_DIR,
    TEST_PAIRS,
    TRAIN_PAIRS,
)
from rlhf.pipeline.registry import Output, Stage
from rlhf.pipeline.schema import Params
from rlhf.train import checkpoint, dpo
from rlhf.train.precision import pick_device
from rlhf.train.rng import seed_everything

log = logging.getLogger("dpo")

PAIR_FILES = {"prepare": (PAIRS_DIR, TRAIN_PAIRS, TEST_PAIRS),
              "sampled": (SAMPLED_PAIRS_DIR, SAMPLED_TRAIN_PAIRS, SAMPLED_TEST_PAIRS)}  # dpo.pairs -> its files
EVAL_POINTS = 10  # held-out evaluations a run, evenly spaced (the last after the last step)
EVAL_BATCH = 64  # pairs per forward pass of the reference and of the held-out evaluation
DISABLED = "method is not dpo: evaluate reads the method's own policy"

STAGE = Stage(
    __spec__.name,
    params=("seed", "method", "model", "sft.enabled", "dpo.loss", "dpo.beta", "dpo.label_smoothing", "dpo.tau",
            "dpo.pairs", "dpo.learning_rate", "dpo.batch_size", "dpo.epochs", "dpo.max_length", "dpo.warmup_steps",
            "dpo.max_grad_norm", "dpo.checkpoint_every"),
    inputs=(PAIRS_DIR, SAMPLED_PAIRS_DIR, SFT_DIR),
    outputs=(Output(DPO_DIR), Output(DPO_CURVES, cache=False), Output(DPO_METRICS, "metrics", cache=False)),
    out_of_memory="lower dpo.batch_size or dpo.max_length",
)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    params = load_params()
    run_switchable(STAGE, params.method == "dpo", lambda outputs: train_dpo(params, outputs), DPO_DIR,
                   DISABLED, {DPO_METRICS: '{"trained": false}\n', DPO_CURVES / DISABLED_MARKER: DISABLED + "\n"})


def read_pair_files(params: Params) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The (train, test) pairs of dpo.pairs, checked before any model loads."""
    folder, *files = PAIR_FILES[params.dpo.pairs]
    if (folder / DISABLED_MARKER).exists():
        raise DataError(f"{folder}: holds no pairs (run the sample_pairs stage with method dpo and dpo.pairs "
                        f"{params.dpo.pairs})")
    train, test = (read_pairs(path) for path in files)
    if len(train) < params.dpo.batch_size:
        raise DataError(f"{files[0]}: {len(train)} pairs, fewer than dpo.batch_size={params.dpo.batch_size}")
    return train, test


class History:
    """Every step's stats, and the held-out ones at EVAL_POINTS steps. While a run can resume they are also appended
    to ``file`` beside its checkpoints: a killed run's staged outputs are deleted, and a resumed run reads back the
    steps before its checkpoint."""

    def __init__(self, steps: int, evaluate: Callable[[], dict[str, float]], file: Path | None) -> None:
        self.steps, self.evaluate, self.file = steps, evaluate, file
        self.eval_every = max(1, steps // EVAL_POINTS)
        self.rows: list[dict[str, float]] | None = None

    def __call__(self, step: int, stats: dict[str, float]) -> None:
        if self.rows is None:  # the first step of this process: a resumed run keeps the steps before it
            earlier = self.file.read_text().splitlines() if step and self.file and self.file.exists() else []
            self.rows = [row for row in map(json.loads, earlier) if row["step"] < step]
            if self.file:
                write_text("".join(json.dumps(row) + "\n" for row in self.rows), self.file)
        row = {"step": step} | {f"train/{key}": value for key, value in stats.items()}
        if (step + 1) % self.eval_every == 0 or step + 1 == self.steps:
            row |= {f"eval/{key}": value for key, value in self.evaluate().items()}
        self.rows.append(row)
        if self.file:
            with self.file.open("a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")

    def write_curves(self, folder: Path) -> None:
        from rlhf.rl.curves import open_curves  # dvclive's import is slow: only where curves are written

        with open_curves(folder, resume=False) as live:
            for row in self.rows or []:
                for key, value in row.items():
                    if key != "step":
                        live.log_metric(key, value, plot=True)
                live.next_step()


def train_dpo(params: Params, outputs: StagedOutputs) -> None:
    cfg = params.dpo
    train_frame, test_frame = read_pair_files(params)
    generator = seed_everything(params.seed)
    lm, tokenizer, what = load_initial_policy(params)
    if cfg.max_length > context_size(lm):
        raise ModelError(f"dpo.max_length: {cfg.max_length} exceeds {what}'s {context_size(lm)} positions")
    outputs.check_free_space(DPO_DIR, checkpoint.weights_bytes(lm))
    device, precision = pick_device(), params.model.precision
    config = dpo.DpoConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(dpo.DpoConfig)})
    reference = copy.deepcopy(lm).to(device)
    lm.to(device)
    train_pairs, test_pairs = (
        dpo.with_reference(dpo.encode_pairs(frame, tokenizer, cfg.max_length, str(path)), reference, tokenizer,
                           EVAL_BATCH, device, precision)
        for frame, path in zip((train_frame, test_frame), PAIR_FILES[cfg.pairs][1:], strict=True))
    del reference

    fingerprint = run_fingerprint(params) if cfg.checkpoint_every else None
    history = History(dpo.total_steps(len(train_pairs), config),
                      lambda: dpo.evaluate(lm, tokenizer, test_pairs, config, device, precision, EVAL_BATCH),
                      STAGE.checkpoints / f"history-{fingerprint}.jsonl" if fingerprint else None)
    result = dpo.train(lm, tokenizer, train_pairs, config, device, generator, precision, fingerprint, history)
    held_out = {key: value for key, value in history.rows[-1].items() if key.startswith("eval/")}

    save(lm, tokenizer, outputs[DPO_DIR])
    history.write_curves(outputs[DPO_CURVES])
    tail = result.losses[-20:]
    write_json({"trained": True, "train_pairs": len(train_pairs),
                "test_pairs": len(test_pairs), "steps": len(result.losses), "seconds": round(result.seconds, 1),
                "train_loss": round(sum(tail) / len(tail), 4), **held_out}, outputs[DPO_METRICS])
    log.info("dpo: held-out implicit-reward accuracy %.3f, margin %.3f", held_out["eval/rewards/accuracies"],
             held_out["eval/rewards/margins"])


def run_fingerprint(params: Params) -> str:
    """What determines a dpo run: the params the stage reads (not the checkpoint interval) and its inputs."""
    path, tokenizer, _ = initial_policy(params)
    return checkpoint.fingerprint("dpo", params, [PAIR_FILES[params.dpo.pairs][0], path, tokenizer],
                                  exclude=("dpo.checkpoint_every",))


def save(lm: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    with atomic_path(folder) as tmp:
        lm.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


if __name__ == "__main__":
    run_stage(main)
