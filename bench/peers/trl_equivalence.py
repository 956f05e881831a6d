"""TRL 0.11.4's side of ``bench.equivalence``: one ``PPOTrainer.step`` per case on the inputs it wrote.

Runs in the TRL 0.11 venv (``bench/.venvs/trl011``), so it imports torch, transformers and TRL only:
``bench/.venvs/trl011/bin/python -m bench.peers.trl_equivalence FOLDER`` reads ``FOLDER/inputs.pt`` and writes
``FOLDER/trl.pt``, one record per case in the layout ``bench.equivalence`` reads: per-token tensors over the real
response tokens in row order, per-mini-batch stats, step stats and the weights after the step, under our names.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from transformers import PreTrainedTokenizerFast
from trl import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

EOS = "<|endoftext|>"  # the bench's tokenizer's EOS, also its padding
# TRL's per-mini-batch stat -> ours (train_minibatch's flattened keys)
MINIBATCH_KEYS = {"loss/policy": "loss/policy", "loss/value": "loss/value", "loss/total": "loss/total",
                  "policy/entropy": "policy/entropy", "policy/approxkl": "policy/approxkl",
                  "policy/policykl": "policy/policykl", "policy/clipfrac": "policy/clipfrac",
                  "val/clipfrac": "val/clipfrac", "val/mean": "val/mean", "returns/mean": "val/returns"}
# TRL's step stat -> ours; ppo/mean_non_score_reward is compared with ours divided by the mean response length
STEP_KEYS = {"objective/kl": "objective/kl", "objective/kl_coef": "objective/kl_coef",
             "objective/entropy": "objective/entropy", "ppo/mean_scores": "objective/scores",
             "ppo/std_scores": "objective/scores_std", "ppo/mean_non_score_reward": "non_score_reward per token",
             **{f"ppo/{k}": v for k, v in MINIBATCH_KEYS.items()}}
CONFIG_KEYS = ("learning_rate", "batch_size", "mini_batch_size", "gradient_accumulation_steps", "ppo_epochs",
               "init_kl_coef", "adap_kl_ctrl", "target", "horizon", "gamma", "lam", "cliprange", "cliprange_value",
               "vf_coef", "kl_penalty", "whiten_rewards", "ratio_threshold", "max_grad_norm", "use_score_scaling",
               "use_score_norm", "score_clip")


def run_case(inputs: dict, case: dict) -> dict:
    """One ``PPOTrainer.step`` on the case's inputs, its quantities recorded by wrapping the trainer's methods."""
    settings = case["settings"]
    # from tokenizer.json alone: the saved tokenizer_config names a class that this older transformers lacks
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(Path(inputs["model_dir"]) / "tokenizer.json"),
                                        eos_token=EOS, pad_token=EOS)
    model, ref = (AutoModelForCausalLMWithValueHead.from_pretrained(inputs[key], summary_dropout_prob=0.0)
                  for key in ("model_dir", "ref_dir"))
    with torch.no_grad():
        model.v_head.summary.weight.copy_(inputs["v_head"]["weight"])
        model.v_head.summary.bias.copy_(inputs["v_head"]["bias"])
    config = PPOConfig(**{k: settings[k] for k in CONFIG_KEYS})
    trainer = PPOTrainer(config, model, ref, tokenizer)
    if case["trl_fix"] == "clip_every_step":  # the fix of TRL's one-shot filter iterator, to show it is the cause
        trainer.model_params = [p for p in trainer.model.parameters() if p.requires_grad]
    if case["trl_fix"] == "score_moments_as_tensors":  # else step() calls .to() on a float and raises
        wrap(trainer.running, "update", lambda args, out: vars(trainer.running).update(
            mean=torch.tensor(trainer.running.mean), std=torch.tensor(trainer.running.std)))
    record: dict = {"minibatches": []}
    wrap(trainer, "compute_rewards", lambda args, out: record.update(
        mask=args[3].bool(), logprobs=args[1], ref_logprobs=args[2], rewards=out[0], non_score_reward=out[1],
        kl=out[2]))
    wrap(trainer, "compute_advantages", lambda args, out: record.update(values=out[0], advantages=out[1],
                                                                        returns=out[2]))
    wrap(trainer, "loss", lambda args, out: record["minibatches"].append(
        {ours: float(out[2][theirs]) for theirs, ours in MINIBATCH_KEYS.items()}))
    perms = iter(case["perms"])
    with mock.patch.object(np.random, "permutation", lambda n: np.array(next(perms))):
        stats = trainer.step([torch.tensor(q) for q in case["queries"]], [torch.tensor(r) for r in case["responses"]],
                             [torch.tensor(s) for s in case["scores"]])
    mask = record.pop("mask")
    tokens = {k: record.pop(k)[mask].detach().float() for k in ("logprobs", "ref_logprobs", "values", "kl",
                                                                   "non_score_reward", "rewards", "advantages",
                                                                   "returns")}
    weights = {f"lm.{k}": v.detach().clone() for k, v in trainer.model.pretrained_model.state_dict().items()}
    weights |= {f"v_head.{k}": v.detach().clone() for k, v in trainer.model.v_head.summary.state_dict().items()}
    return {"tokens": tokens, "minibatches": record["minibatches"],
            "stats": {ours: float(np.asarray(stats[theirs])) for theirs, ours in STEP_KEYS.items()},
            "kl_coef_after": float(trainer.kl_ctl.value), "weights": weights}


def wrap(obj: object, name: str, seen) -> None:
    """Call ``seen(args, output)`` after every call of the object's method ``name``."""
    method = getattr(obj, name)

    def wrapped(*args):
        out = method(*args)
        seen(args, out)
        return out

    setattr(obj, name, wrapped)


def main() -> None:
    folder = Path(sys.argv[1])
    warnings.filterwarnings("ignore")  # deprecation and "ratio exceeds threshold" notices: the bench reports those
    torch.set_num_threads(1)
    inputs = torch.load(folder / "inputs.pt", weights_only=False)
    torch.save([run_case(inputs, case) for case in inputs["cases"]], folder / "trl.pt")


if __name__ == "__main__":
    main()
