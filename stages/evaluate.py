"""evaluate: sentiment and KL of the final policy against the reference (the initial policy) on held-out prompts.

The policy is method's: models/policy (ppo), models/dpo (dpo), or for best_of_n no model but the reward scorer's best
of evaluate.best_of_n reference responses per prompt, whose KL is reported as the analytic bound log N - (N-1)/N
(kl.best_of_n_bound) instead of the sampled and exact KL. Everything else is measured the same way for every method.

Reads   data/prompts/eval.parquet, the policy of method, the reference (models/sft when sft.enabled, else
        model.policy), the reward (models/reward when reward.train, else reward.model, plus reward.functions), the
        judges of evaluate.judges, and the optimum's pool (data/optimum) when optimum.samples_per_prompt > 0
Writes  metrics/eval.json                     flat keys (see rlhf/eval/evaluation.py) for dvc metrics diff; with a
                                              pool, optimum.objective_* too: the policy's objective E[r] - beta KL
                                              on the pool's prompts against the optimum's (rlhf/eval/optimum.py)
        data/eval/samples.parquet             query, response_before/after, every score before/after, kl, kl_full
        metrics/evaluate/report.md            before/after summary and examples
        metrics/evaluate/score_histogram.csv  reward score histogram before vs after (the score_histogram plot)
The outputs are replaced together when the stage completes, or not at all (rlhf/pipeline/io.py's StagedOutputs).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pyarrow as pa
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.data.prompts import check_prompts, read_prompts
from rlhf.eval.evaluation import SIDES, evaluate_policy, markdown_report
from rlhf.eval.objective import POLICY_SAMPLES, objective_probe, read_pool
from rlhf.eval.plots import histogram
from rlhf.eval.scorers import load_scorers
from rlhf.models.devices import pick_device
from rlhf.models.loading import check_vocab_match, load_causal_lm, load_initial_policy
from rlhf.models.scorers import REWARD
from rlhf.pipeline.cli import run_stage
from rlhf.pipeline.errors import ModelError
from rlhf.pipeline.io import StagedOutputs, write_json, write_parquet, write_text
from rlhf.pipeline.params import Params, initial_policy, load_params, reward_model
from rlhf.pipeline.paths import EVAL_PROMPTS, POLICIES
from rlhf.train.rng import seed_everything

log = logging.getLogger("evaluate")

BEST_OF_N = (" After: for each prompt, the reward's best of {n} reference responses (the first of them the "
             "reference's own, so best of 1 is the reference), every judge scoring the chosen one; its KL is the "
             "analytic bound log N - (N-1)/N, not a sample estimate.")

STAGE = "evaluate"
EVAL_SAMPLES = Path("data/eval/samples.parquet")
EVAL_METRICS = Path("metrics/eval.json")
EVAL_REPORT = Path("metrics/evaluate/report.md")
EVAL_HISTOGRAM = Path("metrics/evaluate/score_histogram.csv")
# what to lower when the GPU runs out of memory
OUT_OF_MEMORY = "lower evaluate.batch_size"


def describe(params: Params, n: int) -> str:
    """The report's one-paragraph account of what was measured."""
    cfg, path = params.ppo, reward_model(params)[0]
    reward = " + ".join(([f"`{path}`"] if path is not None else [])
                        + [f"{spec.weight:g} x `{spec.function}`" for spec in params.reward.functions])
    judges = ", ".join(name if name == spec else f"{name} (`{spec}`)"
                       for name, spec in zip(params.evaluate.judge_names, params.evaluate.judges, strict=True))
    return (f"{n} held-out prompts from `{EVAL_PROMPTS}`. Each model answers every prompt once, with the same "
            f"per-prompt response length ({cfg.response_min_tokens}-{cfg.response_max_tokens} tokens) and seed "
            f"({params.seed}), sampled as in training (top_k={cfg.top_k}, top_p={cfg.top_p}, "
            f"temperature={cfg.temperature}). Reward: {reward}. Judges: {judges or 'none'}."
            + (BEST_OF_N.format(n=params.evaluate.best_of_n) if params.method == "best_of_n" else ""))


def main() -> None:
    params = load_params(STAGE)
    with StagedOutputs.of(STAGE) as outputs:
        evaluate(params, outputs)


def evaluate(params: Params, outputs: StagedOutputs) -> None:
    prompts = read_prompts(EVAL_PROMPTS)
    device = pick_device()
    seed_everything(params.seed)

    # every scorer and model loads (or fails naming its key) before any sampling
    longest = prompts.longest + params.ppo.response_max_tokens  # what each scorer reads at most
    scorers = load_scorers(params, prompts, STAGE, device, longest)
    initial = initial_policy(params)
    reference, tokenizer = load_initial_policy(initial, params.model)
    reference.to(device).eval()
    policy = load_policy(params, tokenizer)
    if policy is not None:
        policy.to(device).eval()
    check_prompts(EVAL_PROMPTS, prompts, tokenizer, reference, params.ppo.response_max_tokens,
                  f"the reference model ({initial.what})")
    probe = objective_probe(params, read_pool(params), prompts, scorers[REWARD], tokenizer, POLICY_SAMPLES,
                            params.evaluate.batch_size)

    with outputs.steps():
        metrics, samples = evaluate_policy(policy, reference, tokenizer, scorers, prompts, params)
        if probe is not None and policy is not None:
            metrics |= probe.measure(policy, lambda: contextlib.nullcontext(reference))
    for run, side in SIDES.items():
        if f"response_{side}" in samples and (samples[f"response_{side}"].str.strip() == "").all():
            log.warning("evaluate: every response of the %s run (%s) is empty (it answers EOS at once, or tokens "
                        "that decode to nothing): its scores are the prompts' alone", run, side)

    write_parquet(pa.Table.from_pandas(samples, preserve_index=False), outputs[EVAL_SAMPLES])
    scores = {"before": samples["reward_before"].to_numpy(), "after": samples["reward_after"].to_numpy()}
    write_text(histogram(scores, x="bin", reference="before").to_csv(index=False), outputs[EVAL_HISTOGRAM])
    write_text(markdown_report(samples, metrics, list(scorers), params.evaluate.examples,
                               describe(params, len(samples)), after(params)), outputs[EVAL_REPORT])
    write_json(metrics, outputs[EVAL_METRICS])
    kl = (f"KL bound {metrics['kl.best_of_n_bound']:.3f}" if "kl.best_of_n_bound" in metrics else
          f"KL {metrics['kl.mean']:.3f} (exact {metrics['kl.full_mean']:.3f})")
    if (share := metrics.get("optimum.objective_fraction")) is not None:
        kl += f", {share:.2f} of the optimum's objective gain at beta {metrics['optimum.objective_beta']:g}"
    log.info("evaluate: %s: reward %.3f -> %.3f, positive %.2f -> %.2f, %s; report in %s", after(params),
             metrics["reward.reference_mean"], metrics["reward.policy_mean"],
             metrics["reward.reference_positive_rate"], metrics["reward.policy_positive_rate"], kl, EVAL_REPORT)


def after(params: Params) -> str:
    """What the report calls the evaluated policy."""
    if params.method in POLICIES:
        return f"{params.method.upper()} policy"
    return f"best of {params.evaluate.best_of_n} reference samples"


def load_policy(params: Params, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel | None:
    """The trained policy of ``method`` (None for best_of_n, which trains none), checked against the tokenizer."""
    if params.method not in POLICIES:
        return None
    folder = POLICIES[params.method]
    if not (folder / "config.json").exists():
        raise ModelError(f"{folder}: no trained policy here (run the {params.method} stage)")
    policy = load_causal_lm(str(folder), params.model, what=str(folder))
    check_vocab_match(tokenizer, policy, str(folder))
    return policy


if __name__ == "__main__":
    run_stage(main, OUT_OF_MEMORY)
