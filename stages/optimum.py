"""optimum: the frontier's limit, without training: the KL-regularised optimum pi_beta ∝ pi_ref exp(r / beta) over a
grid of beta, and best-of-n for n = 1, 2, 4, ..., N, from one pool of N reference samples per eval prompt.

Reads   data/prompts/eval.parquet (the first optimum.prompts), the reference (models/sft when sft.enabled, else
        model.policy), the reward (models/reward when reward.train, else reward.model, plus reward.functions),
        evaluate.judges
Writes  data/optimum/pool.parquet      N responses per prompt, sampled as evaluate samples (each prompt at its
                                       evaluation length, ppo's sampling settings, the seed), a score column for the
                                       reward and for every judge
        metrics/optimum/curve.csv      per beta: kl, ess_median, ess_min, reliable, and each scorer's positive rate
                                       and mean (<scorer>.positive_rate, <scorer>.mean; the reward's scorer: reward)
        metrics/optimum/best_of_n.csv  per n: kl_bound, kl (the pool's estimate), each scorer's positive rate, mean
        metrics/optimum.json           prompts, samples, the largest KL of a reliable point, seconds
Only a DISABLED marker when optimum.samples_per_prompt is 0. DVC keeps the pool: it is drawn again only when the
reference, the reward, the judges, the prompts, the sampling keys, the seed or N change.
"""

from __future__ import annotations

import time

import pyarrow as pa

from rlhf.pipeline.cli import run_stage
from rlhf.pipeline.errors import DataError
from rlhf.pipeline.io import StagedOutputs, run_switchable, write_json, write_parquet, write_text
from rlhf.pipeline.params import Params, initial_policy, load_params
from rlhf.pipeline.paths import (
    EVAL_PROMPTS,
    OPTIMUM_BEST_OF_N,
    OPTIMUM_CURVE,
    OPTIMUM_METRICS,
    OPTIMUM_POOL,
)

STAGE = "optimum"
OUT_OF_MEMORY = "lower evaluate.batch_size"


def main() -> None:
    params = load_params(STAGE)
    run_switchable(STAGE, params.optimum.samples_per_prompt > 0, lambda outputs: estimate(params, outputs),
                   OPTIMUM_POOL.parent, "optimum.samples_per_prompt is 0: no pool",
                   {OPTIMUM_METRICS: '{"optimum": {"sampled": false}}\n', OPTIMUM_CURVE: "", OPTIMUM_BEST_OF_N: ""})


def estimate(params: Params, outputs: StagedOutputs) -> None:
    # imported here: switched off, the stage loads none of it (stages/__init__.py)
    from rlhf.data.prompts import check_prompts, read_prompts
    from rlhf.eval import optimum
    from rlhf.eval.scorers import load_scorers
    from rlhf.models.devices import pick_device
    from rlhf.models.loading import load_initial_policy
    from rlhf.models.rollout import SamplingParams, evaluation_lengths
    from rlhf.models.runs import Sampler
    from rlhf.train.rng import seed_everything

    start = time.perf_counter()
    cfg, n = params.ppo, params.optimum.samples_per_prompt
    prompts = read_prompts(EVAL_PROMPTS)
    if params.optimum.prompts is not None and params.optimum.prompts > len(prompts):  # not capped without a word
        raise DataError(f"optimum.prompts: {params.optimum.prompts} prompts asked, but {EVAL_PROMPTS} holds "
                        f"{len(prompts)}")
    P = len(prompts) if params.optimum.prompts is None else params.optimum.prompts
    optimum.check_pool_memory(P, n, cfg.response_max_tokens)
    device = pick_device()
    seed_everything(params.seed)
    # every scorer and the reference load (or fail naming their key) before any sampling
    longest = prompts.longest + cfg.response_max_tokens  # what each scorer reads at most
    scorers = load_scorers(params, prompts, STAGE, device, longest)
    initial = initial_policy(params)
    reference, tokenizer = load_initial_policy(initial, params.model)
    check_prompts(EVAL_PROMPTS, prompts, tokenizer, reference, cfg.response_max_tokens,
                  f"the reference ({initial.what})")
    reference.to(device).eval()

    sampler = Sampler(reference, tokenizer, SamplingParams.of(cfg), params.evaluate.batch_size)
    lengths = evaluation_lengths(len(prompts), cfg.response_min_tokens, cfg.response_max_tokens, params.seed)
    with outputs.steps():
        pool = optimum.draw_pool(sampler, prompts.input_ids[:P], lengths[:P], n, params.seed)
        pool = optimum.score_pool(pool, prompts.queries[:P], scorers, params.evaluate.batch_size)
    curve, best_of_n = optimum.curve(pool, list(scorers)), optimum.best_of_n(pool, list(scorers))

    write_parquet(pa.Table.from_pandas(pool, preserve_index=False), outputs[OPTIMUM_POOL])
    write_text(curve.to_csv(index=False), outputs[OPTIMUM_CURVE])
    write_text(best_of_n.to_csv(index=False), outputs[OPTIMUM_BEST_OF_N])
    reliable = curve[curve["reliable"]]["kl"]
    write_json({"optimum": {"prompts": P, "samples": n, "reliable_kl": round(float(reliable.max()), 3),
                            "seconds": round(time.perf_counter() - start, 1)}}, outputs[OPTIMUM_METRICS])


if __name__ == "__main__":
    run_stage(main, OUT_OF_MEMORY)
