"""dpo: the initial policy trained on preference pairs by DPO or IPO (dpo.loss), no reward model and no RL.

Reads   the pairs of dpo.pairs: data/pairs/{train,test}.parquet (prepare's, the reward model's own) or
        data/sampled_pairs/{train,test}.parquet (the sample_pairs stage's); the frozen reference's log-probs of
        them, data/ref_logprobs (the ref_logprobs stage's); the initial policy (models/sft when sft.enabled, else
        model.policy)
Writes  models/dpo/        the trained LM + tokenizer (AutoModelForCausalLM); only a DISABLED marker when method is
                           not dpo (evaluate then reads the method's own policy)
        metrics/dpo/       DVCLive curves: each step's batch (train/loss, train/rewards/*, train/logratios/*) and, ten
                           times a run, the held-out test pairs' (eval/rewards/accuracies, eval/rewards/margins, ...)
        metrics/dpo.json   summary: the held-out stats at the end, pairs, steps, seconds
The reference's log-probs are computed once per pair set by the ref_logprobs stage, so no reference model is held
while training (rlhf/train/dpo.py). The outputs are replaced together
when the stage completes, or not at all; with dpo.checkpoint_every a rerun after a kill resumes from the newest
checkpoint in data/checkpoints/dpo/ to the same result. Its params are the dpo: section below (DpoParams).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from rlhf.models.loading import initial_policy, load_initial_policy, save_pretrained
from rlhf.pipeline.cli import run_stage
from rlhf.pipeline.io import DISABLED_MARKER, StagedOutputs, run_switchable, write_json
from rlhf.pipeline.params import load_params
from rlhf.pipeline.paths import PAIRS_DIR, REF_LOGPROBS_DIR, SAMPLED_PAIRS_DIR, SFT_DIR
from rlhf.pipeline.registry import Output, Stage
from rlhf.pipeline.schema import Params
from rlhf.pipeline.sections import Rule, Schedule
from rlhf.train import checkpoint, dpo
from rlhf.train.precision import pick_device
from rlhf.train.rng import seed_everything

log = logging.getLogger("dpo")

DPO_DIR = Path("models/dpo")
DPO_CURVES = Path("metrics/dpo")  # DVCLive's folder
DPO_METRICS = Path("metrics/dpo.json")
EVAL_BATCH = 64  # pairs per forward pass of the held-out evaluation
DISABLED = "method is not dpo: evaluate reads the method's own policy"


class DpoParams(Schedule):
    """params.yaml's dpo: section (method dpo; the sample_pairs and ref_logprobs stages read it too)."""

    loss: Literal["dpo", "ipo"]
    """dpo: -log sigmoid(beta h) (Rafailov et al. 2023), with label_smoothing the conservative cDPO; ipo:
    (h - 1 / (2 tau))^2 (Azar et al. 2023); h: the chosen minus the rejected log-ratio log pi / pi_ref."""
    beta: float = Field(gt=0)
    """DPO's KL coefficient: small lets the policy move far from the reference."""
    label_smoothing: float = Field(ge=0, lt=0.5)
    """cDPO: the probability that a pair's label is flipped (0: plain DPO; 0.5 would learn nothing)."""
    tau: float = Field(gt=0)
    """IPO's regularisation strength: the target log-ratio margin is 1 / (2 tau) nats per sequence."""
    pairs: Literal["prepare", "sampled"]
    """prepare: prepare's data/pairs (a positive against a negative review's opening, the reward model's pairs);
    sampled: samples_per_prompt completions per train prompt from the initial policy, ranked by the reward scorer
    (data/sampled_pairs, the DPO paper's IMDb setup)."""
    samples_per_prompt: int = Field(ge=2)
    """k: completions sampled per prompt for sampled pairs; every two with different scores make a pair (k = 4: up to
    6 pairs a prompt)."""
    sample_prompts: int | None = Field(gt=0)
    """Train prompts sampled for sampled pairs (the first ones; a tenth of them held out for test pairs); null: all."""
    batch_size: int = Field(gt=0)
    """Pairs per optimizer step."""
    epochs: int = Field(gt=0)
    """Shuffled passes over the training pairs."""
    max_length: int = Field(gt=0)
    """Token cap of prompt + response; responses are cut to fit."""

    def check_with(self, params: Any) -> None:
        s = params.sft
        if s.enabled and s.base == "scratch" and self.max_length > s.n_positions:
            raise Rule("dpo.max_length", f"must fit sft.n_positions ({s.n_positions})", self.max_length)


STAGE = Stage(
    __spec__.name,
    params=("seed", "method", "model", "sft.enabled", "dpo.loss", "dpo.beta", "dpo.label_smoothing", "dpo.tau",
            "dpo.pairs", "dpo.learning_rate", "dpo.batch_size", "dpo.epochs", "dpo.max_length", "dpo.warmup_steps",
            "dpo.max_grad_norm", "dpo.checkpoint_every"),
    inputs=(PAIRS_DIR, SAMPLED_PAIRS_DIR, REF_LOGPROBS_DIR, SFT_DIR),
    outputs=(Output(DPO_DIR), Output(DPO_CURVES, cache=False), Output(DPO_METRICS, "metrics", cache=False)),
    out_of_memory="lower dpo.batch_size or dpo.max_length",
    section=DpoParams,
    policy=DPO_DIR,
)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    params = load_params()
    run_switchable(STAGE, params.method == "dpo", lambda outputs: train_dpo(params, outputs), DPO_DIR,
                   DISABLED, {DPO_METRICS: '{"trained": false}\n', DPO_CURVES / DISABLED_MARKER: DISABLED + "\n"})


def train_dpo(params: Params, outputs: StagedOutputs) -> None:
    cfg = params.dpo
    frames = dpo.read_pair_files(cfg.pairs, cfg.batch_size)
    ref_logprobs = dpo.read_reference(dpo.reference_key(params))
    generator = seed_everything(params.seed)
    lm, tokenizer, what = load_initial_policy(params)
    dpo.check_context(lm, cfg.max_length, what)
    outputs.check_free_space(DPO_DIR, checkpoint.weights_bytes(lm))
    device, precision = pick_device(), params.model.precision
    config = dpo.DpoConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(dpo.DpoConfig)})
    lm.to(device)
    train_pairs, test_pairs = (
        dataclasses.replace(dpo.encode_pairs(frame, tokenizer, cfg.max_length, str(path)), ref_logprobs=ref)
        for frame, path, ref in zip(frames, dpo.PAIR_FILES[cfg.pairs][1:], ref_logprobs, strict=True))

    fingerprint = run_fingerprint(params) if cfg.checkpoint_every else None
    history = dpo.History(dpo.total_steps(len(train_pairs), config),
                          lambda: dpo.evaluate(lm, tokenizer, test_pairs, config, device, precision, EVAL_BATCH),
                          STAGE.checkpoints / f"history-{fingerprint}.jsonl" if fingerprint else None)
    result = dpo.train(lm, tokenizer, train_pairs, config, device, generator, precision, fingerprint, history)
    held_out = {key: value for key, value in history.rows[-1].items() if key.startswith("eval/")}

    save_pretrained(lm, tokenizer, outputs[DPO_DIR])
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
    return checkpoint.fingerprint("dpo", params, [dpo.PAIR_FILES[params.dpo.pairs][0], path, tokenizer],
                                  exclude=("dpo.checkpoint_every",))


if __name__ == "__main__":
    run_stage(main)
