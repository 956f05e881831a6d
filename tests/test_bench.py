"""The PPO step benchmark: its shared pieces, one toy iteration through the real trainer, and compare's CLI checks.

The TRL peers run in their own venvs (bench/.venvs), which tests never build; `python -m bench.compare --config toy
--iters 1` is their smoke run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from types import ModuleType

import pandas as pd
import pytest
import torch
from conftest import ROOT

from bench import compare, decode_step, equivalence, heap_peak, logprob_error, ppo_step, sft_step
from bench.configs import (
    CONFIGS,
    add_common_args,
    load_prompts,
    mean_padded_length,
    pass_flops,
    sample_prompts,
    stand_in_score,
)
from rlhf.models.loading import load_tokenizer
from rlhf.pipeline.params import defaults

INTERFACE_KEYS = {"config", "iters", "s_per_iter", "generate_s", "update_s", "samples_per_s", "tokens_per_s",
                  "peak_mem_mb"}


def test_stand_in_score_is_the_share_of_even_token_ids() -> None:
    assert stand_in_score([2, 3, 4, 5]) == 0.5
    assert stand_in_score([1, 3]) == 0.0
    assert stand_in_score([]) == 0.0


def test_prompts_are_seeded_2_to_8_token_prefixes_of_long_reviews() -> None:
    texts = [f"review {i} " + "word " * (30 + i) for i in range(60)] + ["too short"] * 40
    encode = lambda t: [len(w) for w in t.split()]  # noqa: E731
    cfg = CONFIGS["bench-cpu"]
    prompts = sample_prompts(texts, encode, 50, cfg, seed=0)
    assert len(prompts) == 50
    assert all(2 <= len(p) <= 8 for p in prompts)
    long_encodings = [encode(t) for t in texts if len(t) > 200]
    assert all(any(e[: len(p)] == p for e in long_encodings) for p in prompts)
    assert sample_prompts(texts, encode, 50, cfg, seed=0) == prompts
    assert sample_prompts(texts, encode, 50, cfg, seed=1) != prompts


def test_pass_flops_counts_each_weight_at_each_position_it_runs_on() -> None:
    cfg = CONFIGS["bench-cpu"]
    ours = pass_flops(cfg, positions=24, head_positions=16, backward=True)
    trl = pass_flops(cfg, positions=24, head_positions=24, backward=True)
    separate_critic = pass_flops(cfg, positions=24, head_positions=24, bodies=2, backward=True)
    assert trl - ours == pytest.approx(cfg.batch_size * 6 * cfg.head_params * 8)
    assert separate_critic - trl == pytest.approx(cfg.batch_size * 6 * cfg.body_params * 24)
    assert pass_flops(cfg, 24, 16) * 3 == pytest.approx(ours)  # forward alone: a third of forward + backward
    # frozen weights (LoRA) have no weight gradients: forward and the inputs' gradients, two thirds
    assert pass_flops(cfg, 24, 16, backward=True, weight_grads=False) * 3 == pytest.approx(ours * 2)


def run_main(module: ModuleType, args: list[str], monkeypatch: pytest.MonkeyPatch, capsys) -> dict:
    """Run a benchmark script's ``main`` with ``args``; its result, the JSON object on its last line."""
    monkeypatch.setattr(sys, "argv", [module.__name__, *args])
    threads = torch.get_num_threads()
    try:
        module.main()
    finally:  # --threads 1 is process-wide: later tests would run (and learn) differently
        torch.set_num_threads(threads)
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize(("estimator", "k", "lora_r"), [("gae", 1, 0), ("rloo", 4, 0), ("gae", 1, 4)])
def test_ppo_step_runs_the_trainer_and_prints_the_result_line(tokenizer_dir: Path, imdb_dir: Path, capsys,
                                                              monkeypatch: pytest.MonkeyPatch, estimator: str,
                                                              k: int, lora_r: int) -> None:
    result = run_main(ppo_step, ["--config", "toy", "--iters", "1", "--threads", "1", "--data", str(imdb_dir),
                                 "--tokenizer", str(tokenizer_dir), "--estimator", estimator,
                                 "--samples-per-prompt", str(k), "--lora-r", str(lora_r)], monkeypatch, capsys)

    cfg = CONFIGS["toy"]
    assert result.keys() >= INTERFACE_KEYS
    assert (result["config"], result["iters"], result["runner"]) == ("toy", 1, "ours")
    assert (result["estimator"], result["samples_per_prompt"], result["lora_r"]) == (estimator, k, lora_r)
    phases = sum(result[f"{p}_s"] for p in ("generate", "score", "forward", "update"))
    assert 0 < phases <= result["s_per_iter"] + 0.01  # the phases happen inside the timed iteration
    assert result["samples_per_s"] == pytest.approx(cfg.batch_size / result["s_per_iter"], rel=0.01)
    assert result["tokens_per_s"] == pytest.approx(result["samples_per_s"] * cfg.new_tokens, rel=0.01)
    batches = [batch[: cfg.batch_size // k]  # the prompts of a step, each answered k times
               for batch in load_prompts(imdb_dir, load_tokenizer(str(tokenizer_dir), defaults().model), cfg, iters=1)]
    flops = cfg.ppo_epochs * pass_flops(cfg, mean_padded_length(cfg, batches[1:]), cfg.new_tokens, backward=True,
                                        weight_grads=not lora_r)
    assert result["update_gflop"] == pytest.approx(flops / 1e9, abs=0.05)
    assert result["peak_mem_mb"] > 0


def test_heap_peak_sees_a_tensor_freed_inside_its_block_and_not_one_made_before() -> None:
    """What the phases' lines measure: the most the heap held inside the block over what it held on entry, a tensor
    made and freed inside counted, one held from before not."""
    try:
        in_use = heap_peak.heap_reader()
    except SystemExit:
        pytest.skip("no glibc mallinfo2 here")
    held = torch.ones(16 * 2**20 // 4)  # 16 MB, from before the block
    with heap_peak.HeapPeak(in_use) as heap:
        inside = torch.ones(64 * 2**20 // 4)
        time.sleep(0.01)
        del inside
    # the rest of the process allocates and frees beside it (another test's leftovers, the collector): a little slack
    assert 60 * 2**20 <= heap.peak - heap.start < 72 * 2**20
    assert heap.start >= held.numel() * 4


def test_ppo_step_refuses_an_estimator_setting_with_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["bench.ppo_step", "--config", "toy", "--estimator", "grpo"])
    with pytest.raises(SystemExit, match=r"^ppo.samples_per_prompt: must be >= 2 with ppo.advantage_estimator grpo"):
        ppo_step.main()


def test_compare_rejects_an_unknown_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["bench.compare", "--peers", "ours-twice,trl112"])
    with pytest.raises(SystemExit, match="--peers: unknown peer 'ours-twice'"):
        compare.main()


def test_compare_ratios_are_each_runner_s_per_iter_and_peak_memory_over_ours(capsys) -> None:
    row = {"generate_s": 1.0, "score_s": 0.0, "forward_s": 1.0, "update_s": 2.0, "samples_per_s": 1.0,
           "update_gflops": 50.0}
    ratios = compare.print_table({"ours": row | {"s_per_iter": 4.0, "peak_mem_mb": 8000.0},
                                  "ours-lora16": row | {"s_per_iter": 10.0, "peak_mem_mb": 2000.0}}, 100.0)
    assert ratios == {"ours": {"s_per_iter": 1.0, "peak_mem_mb": 1.0},
                      "ours-lora16": {"s_per_iter": 2.5, "peak_mem_mb": 0.25}}
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("ours-lora16"))
    assert "2.50x" in line and "0.25x" in line


@pytest.mark.slow
def test_compare_runs_our_lora_trainer_beside_full_fine_tuning(tokenizer_dir: Path, imdb_dir: Path, capsys,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``ours-lora16`` is our own script in this interpreter: no venv is made for it."""
    monkeypatch.setattr(compare, "setup_venv", lambda *args: pytest.fail("a venv was made"))
    result = run_main(compare, ["--config", "toy", "--iters", "1", "--threads", "1", "--data", str(imdb_dir),
                                "--tokenizer", str(tokenizer_dir), "--peers", "ours-lora16"], monkeypatch, capsys)
    assert not result["failed"] and result["same_prompts"]
    assert [r["lora_r"] for r in result["results"].values()] == [0, 16]
    assert result["ratio_to_ours"].keys() == result["memory_ratio_to_ours"].keys() == {"ours", "ours-lora16"}


def test_the_offline_cpu_config_is_the_preset_s_policy_and_batch() -> None:
    """bench's offline-cpu config times what the preset trains: its sft shape, its ppo batch and lr."""
    import yaml

    from tools.presets import load_preset, overlay

    params = overlay(yaml.safe_load((ROOT / "params.yaml").read_text()), load_preset("offline-cpu"))
    sft, ppo, cfg = params["sft"], params["ppo"], CONFIGS["offline-cpu"]
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_positions) == (sft["n_layer"], sft["n_embd"], sft["n_head"],
                                                                      sft["n_positions"])
    assert (cfg.batch_size, cfg.mini_batch_size, cfg.ppo_epochs, cfg.learning_rate, cfg.new_tokens) == (
        ppo["batch_size"], ppo["mini_batch_size"], ppo["ppo_epochs"], ppo["learning_rate"],
        ppo["response_max_tokens"])
    assert (cfg.prompt_min_tokens, cfg.prompt_max_tokens) == (params["prepare"]["prompt_min_tokens"],
                                                              params["prepare"]["prompt_max_tokens"])


GPU_SHAPES = {"bench-gpu-medium": (24, 1024, 16), "bench-gpu-large": (36, 1280, 20)}


@pytest.mark.parametrize("name", GPU_SHAPES)
def test_gpu_shape_configs_keep_bench_gpu_s_batch(name: str) -> None:
    cfg, gpu = CONFIGS[name], CONFIGS["bench-gpu"]
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head) == GPU_SHAPES[name]
    assert cfg.n_embd % cfg.n_head == 0
    keep = ("vocab_size", "batch_size", "mini_batch_size", "ppo_epochs", "new_tokens", "n_positions")
    assert [getattr(cfg, k) for k in keep] == [getattr(gpu, k) for k in keep]


@pytest.mark.slow
@pytest.mark.parametrize("name", GPU_SHAPES)
def test_ppo_step_and_compare_accept_the_gpu_shape_configs(name: str, tokenizer_dir: Path, imdb_dir: Path, capsys,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The names go through both command lines; ours runs one iteration of the config shrunk to a CPU-test size
    (its real size is for a GPU)."""
    monkeypatch.setitem(CONFIGS, name, dataclasses.replace(CONFIGS[name], n_layer=1, n_embd=2 * CONFIGS[name].n_head,
                                                           batch_size=4, mini_batch_size=4, ppo_epochs=1))
    parser = argparse.ArgumentParser()
    add_common_args(parser)
    assert parser.parse_args(["--config", name]).config == name  # what bench.compare (and the peers) parse
    result = run_main(ppo_step, ["--config", name, "--iters", "1", "--threads", "1", "--data", str(imdb_dir),
                                 "--tokenizer", str(tokenizer_dir)], monkeypatch, capsys)
    assert (result["config"], result["iters"]) == (name, 1)
    assert result["s_per_iter"] > 0


@pytest.mark.slow
def test_decode_step_counts_fewer_python_calls_for_the_static_decoder(capsys,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    result = run_main(decode_step, ["--config", "toy", "--batch", "2", "--tokens", "3", "--iters", "1", "--threads",
                                    "1", "--precision", "fp32"], monkeypatch, capsys)
    static, dynamic = result["static"], result["dynamic"]
    assert (result["config"], result["batch"], result["tokens"]) == ("toy", 2, 3)
    # operator counts are deterministic (timings on a shared CPU are not: they are printed, not asserted)
    assert 0 < static["top_level_ops_per_step"] < dynamic["top_level_ops_per_step"]
    assert 0 < static["ops_per_step"] < dynamic["ops_per_step"]


def tf32_by_frexp(x: float, truncate: bool) -> float:
    """The slow reference: x = m 2^e with 0.5 <= |m| < 1; TF32 keeps 11 significant bits of m."""
    m, e = math.frexp(x)
    scaled = m * 2**11
    kept = math.trunc(scaled) if truncate else round(scaled)  # round: to nearest, ties to even
    return math.ldexp(kept, e - 11)


@pytest.mark.parametrize("truncate", [False, True])
def test_round_to_tf32_keeps_11_significant_bits(truncate: bool) -> None:
    torch.manual_seed(0)
    x = torch.cat([torch.randn(2000) * 10.0 ** torch.randint(-6, 6, (2000,)),
                   torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 1 - 2**-24, 0.0])])  # ties, a carry
    ours = logprob_error.round_to_tf32(x, truncate)
    assert ours.tolist() == [tf32_by_frexp(v, truncate) for v in x.tolist()]


def test_logprob_error_puts_fp32_at_float64_and_a_bf16_head_furthest(tiny_gpt2_dir: Path, tmp_path: Path, capsys,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = load_tokenizer(str(tiny_gpt2_dir), defaults().model)
    queries = ["a great film", "the worst plot", "I loved it", "boring and long"]
    pd.DataFrame({"query": queries, "input_ids": [tokenizer(q)["input_ids"] for q in queries]}).to_parquet(
        tmp_path / "eval.parquet")
    result = run_main(logprob_error, ["--model", str(tiny_gpt2_dir), "--prompt-file", str(tmp_path / "eval.parquet"),
                                      "--prompts", "4", "--tokens", "6", "--batch-size", "3", "--threads", "1"],
                      monkeypatch, capsys)["results"]
    assert set(result) == {"fp32", "bf16", "fp32+tf32-head", "bf16+tf32-head", "bf16+tf32-head-truncated",
                           "bf16+bf16-head"}
    assert result["fp32"]["token_max"] < 1e-5
    assert 0 < result["fp32+tf32-head"]["token_mean"] < result["bf16+bf16-head"]["token_mean"]
    assert result["bf16"]["token_mean"] < result["bf16+bf16-head"]["token_mean"]


def test_sft_step_times_both_losses_on_the_same_model_and_batch(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # presets/ and params.yaml
    # the compiled runners compile for a minute on a CPU: tests/test_sft_reward.py checks the compiled step
    result = run_main(sft_step, ["--preset", "offline-cpu", "--batch-size", "2", "--iters", "1", "--threads", "1",
                                 "--runners", "ours,hf"], monkeypatch, capsys)
    ours, hf = result["results"]["ours"], result["results"]["hf"]
    assert (result["batch_size"], result["block_size"]) == (2, 64)
    assert ours["tokens_per_s"] > 0 and hf["tokens_per_s"] > 0
    assert result["speedup"] == pytest.approx(hf["s_per_step"] / ours["s_per_step"])
    # like for like: the same initial model and batch give the same loss (bf16 rounding apart)
    assert ours["first_loss"] == pytest.approx(hf["first_loss"], rel=1e-2)


def test_equivalence_lays_out_fixed_responses_as_generate_does() -> None:
    samples = equivalence.samples_of([[5, 6], [7, 8, 9]], [[1, 2, 3], [4]], pad_id=0)
    assert samples.context_length == 3
    assert samples.query_responses.tolist() == [[0, 5, 6, 1, 2, 3], [7, 8, 9, 4, 0, 0]]
    assert samples.attention_mask.tolist() == [[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]
    assert samples.response_mask.tolist() == [[True, True, True], [True, False, False]]


@pytest.fixture(scope="module")
def equivalence_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[equivalence.Case, dict, dict]:
    """One case run through our trainer twice, the second time with one weight nudged after the step."""
    case = equivalence.CASES[1]
    models = equivalence.build_model(tmp_path_factory.mktemp("policy")), equivalence.build_model(
        tmp_path_factory.mktemp("ref"), seed=1)
    v_head = {"weight": torch.full((1, 32), 0.05), "bias": torch.tensor([0.1])}
    inputs = equivalence.case_inputs(case, seed=0)
    return case, equivalence.run_ours(*models, v_head, inputs), equivalence.run_ours(*models, v_head, inputs)


def test_equivalence_verdict_agrees_with_itself_and_sees_a_moved_weight(equivalence_run, capsys) -> None:
    case, ours, again = equivalence_run
    # the stats compared are those of the second record (TRL's names, in the bench); wall times differ run to run
    again["stats"] = {k: v for k, v in again["stats"].items() if not k.startswith(("time/", "throughput/"))}
    diffs = equivalence.differences(ours, again)
    assert all(v == 0 for group in diffs.values() for v in group.values())  # our trainer is deterministic
    assert equivalence.report(case, diffs)
    name = next(n for n in again["weights"] if n.startswith("lm."))
    largest_move = max(v for n, v in ours["moved"].items() if n.startswith("lm."))
    again["weights"][name] = again["weights"][name] + 0.1 * largest_move
    assert not equivalence.report(case, equivalence.differences(ours, again))
    assert "DIFFER: unexpected" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.skipif(not (compare.VENVS / "trl011" / "bench-requirements.txt").exists(),
                    reason="the TRL 0.11 venv is absent (python -m bench.compare --setup-only makes it)")
def test_equivalence_with_trl_finds_only_the_known_differences(monkeypatch, capsys) -> None:
    result = run_main(equivalence, [], monkeypatch, capsys)
    assert result["unexpected"] == []
    assert result["agree"]["4 mini-batches x 4 epochs"] and not result["agree"]["whiten_rewards, padded rows"]
