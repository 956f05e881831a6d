"""dpo: the initial policy trained on preference pairs by DPO or IPO (dpo.loss), no reward model and no RL.

Reads   the pairs of dpo.pairs: data/pairs/{train,test}.parquet (prepare's, the reward model's own) or
        data/sampled_pairs/{train,test}.parquet (the sample_pairs stage's); the frozen reference's log-probs of
        them, data/ref_logprobs (the ref_logprobs stage's); the initial policy (models/sft when sft.enabled, else
        model.policy)
Writes  models/dpo/        the trained LM + tokenizer (AutoModelForCausalLM); only a DISABLED marker when method is
                           not dpo (evaluate then reads the method's own policy)
        metrics/dpo/       DVCLive curves: each step's batch (train/loss, train/rewards/*, train/logratios/*) and, ten
                           times a run, the held-out test pairs' (eval/rewards/accuracies, eval/rewards/margins, ...)
                           and system.csv, CPU, memory and GPU use while training (rlhf/train/system_use.py)
        metrics/dpo.json   summary: the held-out stats at the end, pairs, steps, seconds, system use
The reference's log-probs are computed once per pair set by the ref_logprobs stage, so no reference model is held
while training (rlhf/train/dpo.py). The outputs are replaced together
when the stage completes, or not at all; with dpo.checkpoint_every a rerun after a kill resumes from the newest
checkpoint in data/checkpoints/dpo/ to the same result.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from rlhf.pipeline.cli import run_stage
from rlhf.pipeline.io import DISABLED_MARKER, StagedOutputs, run_switchable, write_json
from rlhf.pipeline.params import Params, initial_policy, load_params
from rlhf.pipeline.paths import DPO_DIR, checkpoint_dir
from rlhf.train.system_use import HEADER as SYSTEM_HEADER

log = logging.getLogger("dpo")

STAGE = "dpo"
DPO_METRICS = Path("metrics/dpo.json")
DPO_CURVES = Path("metrics/dpo")
DPO_SYSTEM = DPO_CURVES / "system.csv"
# what to lower when the GPU runs out of memory
OUT_OF_MEMORY = "lower dpo.batch_size or dpo.max_length"
EVAL_BATCH = 64  # pairs per forward pass of the held-out evaluation
DISABLED = "method is not dpo: evaluate reads the method's own policy"


def main() -> None:
    params = load_params(STAGE)
    run_switchable(STAGE, params.method == "dpo", lambda outputs: train_dpo(params, outputs), DPO_DIR, DISABLED,
                   {DPO_METRICS: '{"dpo": {"trained": false}}\n', DPO_CURVES / DISABLED_MARKER: DISABLED + "\n",
                    DPO_SYSTEM: SYSTEM_HEADER})


def train_dpo(params: Params, outputs: StagedOutputs) -> None:
    # imported here: switched off, the stage loads none of it (stages/__init__.py)
    from rlhf.models.devices import pick_device
    from rlhf.models.loading import load_initial_policy, save_pretrained
    from rlhf.models.lora import add_lora
    from rlhf.train import checkpoint, dpo
    from rlhf.train.rng import seed_everything
    from rlhf.train.system_use import SystemUse

    cfg = params.dpo
    frames = dpo.read_pair_files(cfg.pairs, cfg.batch_size)
    ref_logprobs = dpo.read_reference(dpo.reference_key(params))
    generator = seed_everything(params.seed)
    initial = initial_policy(params)
    lm, tokenizer = load_initial_policy(initial, params.model)
    if params.model.lora.r:  # the reference stays the initial policy: data/ref_logprobs
        add_lora(lm, params.model.lora)
    dpo.check_context(lm, cfg.max_length, initial.what)
    outputs.check_free_space(DPO_DIR, checkpoint.weights_bytes(lm))
    policy = dpo.PairModel(lm, tokenizer, pick_device(), params.model.precision)
    lm.to(policy.device)
    train_pairs, test_pairs = (
        dataclasses.replace(dpo.encode_pairs(frame, tokenizer, cfg.max_length, str(path)), ref_logprobs=ref)
        for frame, path, ref in zip(frames, dpo.PAIR_FILES[cfg.pairs][1:], ref_logprobs, strict=True))

    fingerprint = run_fingerprint(params) if cfg.checkpoint_every else None
    history = dpo.History(dpo.total_steps(len(train_pairs), cfg),
                          lambda: dpo.evaluate(policy, test_pairs, cfg, EVAL_BATCH),
                          checkpoint_dir(STAGE) / f"history-{fingerprint}.jsonl" if fingerprint else None)
    with outputs.steps(), SystemUse(policy.device) as system:
        result = dpo.train(policy, train_pairs, cfg, generator, fingerprint, history)
    held_out = {key: value for key, value in history.read()[-1].items() if key.startswith("eval/")}

    save_pretrained(lm, tokenizer, outputs[DPO_DIR])
    history.write_curves(outputs[DPO_CURVES])
    system.write(outputs[DPO_SYSTEM])
    tail = result.losses[-20:]
    write_json({"dpo": {"trained": True, "train_pairs": len(train_pairs), "test_pairs": len(test_pairs),
                        "steps": len(result.losses), "seconds": round(result.seconds, 1),
                        "train_loss": round(sum(tail) / len(tail), 4), "system": system.summary(), **held_out}},
               outputs[DPO_METRICS])
    log.info("dpo: held-out implicit-reward accuracy %.3f, margin %.3f", held_out["eval/rewards/accuracies"],
             held_out["eval/rewards/margins"])


def run_fingerprint(params: Params) -> str:
    """What determines a dpo run: the params the stage reads (not the checkpoint interval) and its inputs."""
    from rlhf.train import checkpoint, dpo

    initial = initial_policy(params)
    return checkpoint.fingerprint("dpo", params, [dpo.PAIR_FILES[params.dpo.pairs][0], initial.path,
                                                  initial.tokenizer],
                                  exclude=("dpo.checkpoint_every",))


if __name__ == "__main__":
    run_stage(main, OUT_OF_MEMORY)
