"""Our PPO phase against TRL 0.11.4's ``PPOTrainer.step`` on identical inputs: every quantity as a max abs difference.

``python -m bench.equivalence [--wheels DIR]`` (the TRL side runs in ``bench/.venvs/trl011``, made on first use as
``bench.compare`` makes it)

Each case is one PPO phase (rollout forward passes, rewards, advantages, ``ppo_epochs`` over mini-batches, the KL
controller) of both trainers on the same tiny random GPT-2s (policy and reference, built in a temp dir, dropout
off), the same value-head weights, queries, responses, scores and mini-batch order, in fp32 on the CPU. Compared:
the per-token log-probs, reference log-probs, values, KL, non-score rewards, rewards, advantages and returns over the
real response tokens; every mini-batch's losses and stats; the step's stats under the names each trainer logs them;
the weights (policy and value head) and the KL coefficient after the step. Where TRL 0.11 is wrong the case says why
ours differs, and a control case (TRL patched, or inputs the bug cannot reach) shows that cause is the whole
difference.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from bench.compare import bench_env, setup_venv
from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.models.policy import PolicyWithValueHead
from rlhf.models.rollout import Samples, left_pad
from rlhf.pipeline.params import defaults
from rlhf.pipeline.ppo_params import PpoParams
from rlhf.train.ppo_trainer import PPOTrainer

TOLERANCE = 1e-5  # fp32 on both sides; the layouts differ (TRL right-pads query + response), so not bit for bit
# the weights after the step, as a fraction of the largest distance a weight moved: Adam divides a gradient by its
# running RMS, so where a gradient is near Adam's eps (1e-8) fp32 noise of 1e-10 in it moves the weight by ~1e-2 lr
WEIGHT_TOLERANCE = 1e-2
VOCAB, BATCH = 96, 8
TOKENS = ("logprobs", "ref_logprobs", "values", "kl", "non_score_reward", "rewards", "advantages", "returns")
# settings common to every case (TRL's PPOConfig defaults otherwise, which are ours); a learning rate large enough
# that the weights move visibly in one phase
BASE = {"batch_size": BATCH, "learning_rate": 1e-3, "adap_kl_ctrl": False, "init_kl_coef": 0.2}
CLIP_WHY = ("TRL 0.11 clips only the first optimizer step: its `model_params` is a `filter` iterator, which the "
            "first `clip_grad_norm_` consumes; every later call clips an empty list")
WHITEN_WHY = ("TRL 0.11 whitens the rewards without re-masking them: padding gets mean * (1 - 1/std) instead of 0, "
              "and its GAE (which does not stop at padding) carries it into the last real token of every padded row")

SKIP_WHY = ("ours takes no optimizer step for a mini-batch whose mean ratio exceeds ratio_threshold; TRL 0.11 zeroes "
            "its loss and steps anyway, so Adam's momentum still moves the weights (and it logs the zeroed losses)")


@dataclass(frozen=True)
class Case:
    name: str
    overrides: dict = field(default_factory=dict)
    padded: bool = True  # rows of different query and response lengths (else every row is as long)
    trl_fix: str | None = None  # a patch of TRL's bug: "clip_every_step", "score_moments_as_tensors"
    why: str | None = None  # None: the trainers agree; else why TRL 0.11 differs


CASES = [
    Case("one mini-batch, one epoch", {"mini_batch_size": 8, "ppo_epochs": 1}),
    Case("4 mini-batches x 4 epochs", {"mini_batch_size": 2, "ppo_epochs": 4}),
    Case("gradient accumulation 2 x 2, 2 epochs", {"mini_batch_size": 2, "gradient_accumulation_steps": 2,
                                                   "ppo_epochs": 2}),
    Case("adaptive KL, 2 mini-batches x 2 epochs", {"mini_batch_size": 4, "ppo_epochs": 2, "adap_kl_ctrl": True,
                                                    "target": 0.5, "horizon": 100.0}),
    # unpatched, TRL 0.11.4 raises at its first step with use_score_scaling ('float' object has no attribute 'to')
    Case("score scaling, norm and clip (TRL patched to run)", {"mini_batch_size": 4, "ppo_epochs": 2,
                                                                "use_score_scaling": True, "use_score_norm": True,
                                                                "score_clip": 0.5},
         trl_fix="score_moments_as_tensors"),
    Case("gradient clipping, one optimizer step", {"mini_batch_size": 8, "ppo_epochs": 1, "max_grad_norm": 0.05}),
    Case("gradient clipping, 4 mini-batches x 2 epochs", {"mini_batch_size": 2, "ppo_epochs": 2,
                                                         "max_grad_norm": 0.05}, why=CLIP_WHY),
    Case("  the same, TRL clipping every step (patched)", {"mini_batch_size": 2, "ppo_epochs": 2,
                                                          "max_grad_norm": 0.05}, trl_fix="clip_every_step"),
    Case("ratio_threshold 1.0, 4 mini-batches x 2 epochs", {"mini_batch_size": 2, "ppo_epochs": 2,
                                                           "ratio_threshold": 1.0}, why=SKIP_WHY),
    Case("whiten_rewards, padded rows", {"mini_batch_size": 4, "ppo_epochs": 2, "whiten_rewards": True},
         why=WHITEN_WHY),
    Case("  the same, rows without padding", {"mini_batch_size": 4, "ppo_epochs": 2, "whiten_rewards": True},
         padded=False),
]


def build_model(folder: Path, seed: int = 0) -> Path:
    """A random 2-layer GPT-2 (dropout off) and a word-level tokenizer of VOCAB tokens, saved in ``folder``."""
    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"<|endoftext|>": VOCAB - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                            unk_token="<|endoftext|>").save_pretrained(folder)
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)
    GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def case_inputs(case: Case, seed: int) -> dict:
    """The case's queries, responses (no EOS: every response is cut by its length), scores, mini-batch order and
    full settings."""
    g = torch.Generator().manual_seed(seed)
    settings = PpoParams.model_validate(defaults().ppo.model_dump() | BASE | case.overrides).model_dump()

    def lengths(low: int, high: int) -> list[int]:
        return torch.randint(low, high + 1, (BATCH,), generator=g).tolist() if case.padded else [high] * BATCH

    queries = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in lengths(2, 6)]
    responses = [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in lengths(3, 8)]
    scores = (torch.randn(BATCH, generator=g) * 2).tolist()
    perms = [torch.randperm(BATCH, generator=g).tolist() for _ in range(settings["ppo_epochs"])]
    return {"name": case.name, "settings": settings, "queries": queries, "responses": responses, "scores": scores,
            "perms": perms, "trl_fix": case.trl_fix}


class FixedScores:
    name = "fixed"

    def __init__(self, scores: list[float]) -> None:
        self.scores = torch.tensor(scores)

    def __call__(self, queries: list[str], responses: list[str], response_ids: object = None) -> torch.Tensor:
        return self.scores.clone()


def samples_of(queries: list[list[int]], responses: list[list[int]], pad_id: int) -> Samples:
    """Left-padded queries and right-padded responses, as ``rollout.generate`` lays them out."""
    query_ids, query_mask = left_pad(queries, pad_id, torch.device("cpu"))
    response_ids, response_mask = left_pad([r[::-1] for r in responses], pad_id, torch.device("cpu"))
    response_ids, response_mask = response_ids.flip(1), response_mask.flip(1)  # right-padded
    return Samples(torch.cat([query_ids, response_ids], 1), torch.cat([query_mask, response_mask], 1),
                   query_ids.shape[1], response_mask.bool(), torch.zeros(len(queries), dtype=torch.bool))


def run_ours(model_dir: Path, ref_dir: Path, v_head: dict[str, torch.Tensor], case: dict) -> dict:
    """Our trainer's phases on the case: ``score``, ``make_experience`` then ``learn``, as ``PPOTrainer.step`` runs
    them."""
    cfg = PpoParams(**case["settings"])
    tokenizer = load_tokenizer(str(model_dir), defaults().model)
    policy = PolicyWithValueHead(load_causal_lm(str(model_dir), defaults().model), cfg.critic)
    policy.v_head.load_state_dict(v_head)
    trainer = PPOTrainer(policy, load_causal_lm(str(ref_dir), defaults().model), tokenizer,
                         FixedScores(case["scores"]), cfg, torch.device("cpu"), "fp32")
    minibatches = []
    minibatch_loss = trainer.minibatch_loss

    def recorded(exp, mb):
        loss, stats = minibatch_loss(exp, mb)
        minibatches.append({k: v.item() for k, v in stats.items()})
        return loss, stats

    trainer.minibatch_loss = recorded
    initial = {f"lm.{k}": v.clone() for k, v in policy.lm.state_dict().items()}
    initial |= {f"v_head.{k}": v.clone() for k, v in policy.v_head.state_dict().items()}
    samples = samples_of(case["queries"], case["responses"], tokenizer.pad_token_id)
    texts = [""] * BATCH  # the scorer ignores them
    perms = iter(case["perms"])
    with mock.patch.object(torch, "randperm", lambda n: torch.tensor(next(perms))):
        rollout = trainer.make_experience(samples, texts, texts, trainer.score(samples, texts, texts, 0))
        stats = trainer.learn(rollout, 0).stats
    stats["non_score_reward per token"] = stats["objective/non_score_reward"] / stats["tokens/response_length"]
    weights = {f"lm.{k}": v for k, v in policy.lm.state_dict().items()}
    weights |= {f"v_head.{k}": v for k, v in policy.v_head.state_dict().items()}
    exp = rollout.experience
    tokens = {"logprobs": exp.logprobs, "ref_logprobs": exp.ref_logprobs, "values": exp.values, "kl": rollout.kl,
              "non_score_reward": rollout.non_score_reward, "rewards": rollout.rewards, "advantages": exp.advantages,
              "returns": exp.returns}
    return {"tokens": {k: tokens[k][rollout.masks] for k in TOKENS}, "minibatches": minibatches, "stats": stats,
            "kl_coef_after": trainer.kl_ctl.value, "weights": weights,
            "moved": {n: (weights[n] - initial[n]).abs().max().item() for n in weights}}


def differences(ours: dict, trl: dict) -> dict[str, dict[str, float]]:
    """Max abs differences, grouped: per token, per mini-batch (the max over mini-batches), step stats; after the
    step, the weights' as a fraction of the largest move of a weight of the group (policy, value head)."""
    def gap(a: torch.Tensor | float, b: torch.Tensor | float) -> float:
        return (torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().max().item()

    if len(ours["minibatches"]) != len(trl["minibatches"]):
        raise SystemExit(f"error: {len(ours['minibatches'])} mini-batches of ours, {len(trl['minibatches'])} of TRL")
    keys = trl["minibatches"][0].keys()
    per_minibatch = {k: max(gap(o[k], t[k]) for o, t in zip(ours["minibatches"], trl["minibatches"], strict=True))
                     for k in keys}
    shared = sorted(trl["weights"].keys() & ours["weights"].keys())
    lm = [n for n in shared if n.startswith("lm.")]
    head = [n for n in shared if n.startswith("v_head.")]
    return {
        "per token": {k: gap(ours["tokens"][k], trl["tokens"][k]) for k in TOKENS},
        "per mini-batch": per_minibatch,
        "step stats": {k: gap(ours["stats"][k], v) for k, v in trl["stats"].items()},
        "after the step": {"kl_coef": gap(ours["kl_coef_after"], trl["kl_coef_after"])},
        "weights / move": {name: max(gap(ours["weights"][n], trl["weights"][n]) for n in group)
                           / max(ours["moved"][n] for n in group)
                           for name, group in (("policy", lm), ("value head", head))},
    }


def report(case: Case, diffs: dict[str, dict[str, float]]) -> bool:
    """Print one case's differences and verdict; returns whether the trainers agree."""
    worst = max(v for name, group in diffs.items() for v in group.values() if name != "weights / move")
    agree = worst <= TOLERANCE and max(diffs["weights / move"].values()) <= WEIGHT_TOLERANCE
    changed = ", ".join(f"{k}={v}" for k, v in case.overrides.items())
    print(f"\n{case.name} ({changed}{', equal lengths' if not case.padded else ''})")
    for group, values in diffs.items():
        print(f"  {group + ':':<16}" + "  ".join(f"{k} {v:.1e}" for k, v in values.items()))
    if agree:
        verdict = f"agree (<= {TOLERANCE:.0e}, weights <= {WEIGHT_TOLERANCE:.0e} of their move)"
    else:
        verdict = "DIFFER" + (f": expected, {case.why}" if case.why else ": unexpected")
    print(f"  -> {verdict}")
    return agree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", type=Path, help="install the TRL venv offline from this folder of wheels")
    args = parser.parse_args()
    python = setup_venv("trl011", args.wheels)
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        # a reference other than the policy, so that the KL and the rewards' KL penalty are not 0
        model_dir, ref_dir = build_model(folder / "model"), build_model(folder / "ref", seed=1)
        v_head = {"weight": torch.randn(1, 32, generator=torch.Generator().manual_seed(1)) * 0.2,
                  "bias": torch.tensor([0.1])}
        cases = [case_inputs(case, seed) for seed, case in enumerate(CASES)]
        torch.save({"model_dir": str(model_dir), "ref_dir": str(ref_dir), "v_head": v_head, "cases": cases},
                   folder / "inputs.pt")
        subprocess.run([str(python), "-m", "bench.peers.trl_equivalence", str(folder)], check=True,
                       cwd=Path(__file__).resolve().parents[1], env=bench_env())
        trl = torch.load(folder / "trl.pt", weights_only=False)
        ours = [run_ours(model_dir, ref_dir, v_head, case) for case in cases]
    print(f"ours vs TRL 0.11.4 PPOTrainer.step: max abs difference of each quantity; {BATCH} samples, fp32, CPU")
    agree = {case.name.strip(): report(case, differences(o, t)) for case, o, t in zip(CASES, ours, trl, strict=True)}
    unexpected = [c.name.strip() for c in CASES if agree[c.name.strip()] == bool(c.why)]
    print(json.dumps({"tolerance": TOLERANCE, "weight_tolerance": WEIGHT_TOLERANCE, "agree": agree,
                      "unexpected": unexpected}))
    if unexpected:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
