"""DPO and IPO on a tiny GPT-2: they learn an obvious preference (held-out implicit-reward accuracy) and raise a
scorer's score of the sampled policy over the reference's when trained on pairs sampled and ranked by that scorer;
an interrupted run resumes to the uninterrupted result; sampled pairs are ranked as the scorer ranks them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import QUERIES, TokenShareScorer, signal_pairs

from rlhf.data.prompts import Prompts
from rlhf.data.sampled_pairs import SAMPLED_PAIR_SCHEMA, sample_pairs
from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.models.rollout import response_lengths
from rlhf.models.runs import Sampler, score_run
from rlhf.models.sampling import SamplingParams
from rlhf.pipeline.errors import DataError
from rlhf.pipeline.params import defaults
from rlhf.train import dpo

CPU = torch.device("cpu")
CONFIG = defaults().dpo.model_copy(update=dict(loss="dpo", beta=0.1, label_smoothing=0.0, tau=0.1, rpo_alpha=0.0,
                                                learning_rate=1e-2, batch_size=8, epochs=1, max_length=24,
                                                warmup_steps=2, max_grad_norm=1.0, checkpoint_every=None))
RESPONSE_TOKENS = (4, 8)
SAMPLING = SamplingParams()
PAIR_PROMPTS = QUERIES


@pytest.fixture(scope="module")
def tokenizer(tiny_gpt2_dir: Path):
    return load_tokenizer(str(tiny_gpt2_dir), defaults().model)


def load(path: Path):
    return load_causal_lm(str(path), defaults().model)


def prepared(frame: pd.DataFrame, reference, tokenizer) -> dpo.PairSet:
    pairs = dpo.encode_pairs(frame, tokenizer, CONFIG.max_length, "pairs")
    return dpo.with_reference(pairs, dpo.PairModel(reference, tokenizer, CPU), 16)


def test_pairs_without_a_prompt_continue_bos_and_responses_are_cut_to_fit(tokenizer) -> None:
    frame = pd.DataFrame({"chosen": ["the movie was great " * 10], "rejected": [""]})
    pairs = dpo.encode_pairs(frame, tokenizer, 12, "pairs")
    assert pairs.prompts == [[tokenizer.bos_token_id]]
    assert pairs.chosen[0] == tokenizer(frame["chosen"][0]).input_ids[:11]
    assert pairs.rejected == [[tokenizer.eos_token_id]], "an empty response is the EOS it stopped at"
    with pytest.raises(DataError, match=r"^pairs: row 0: the prompt is \d+ tokens, .* dpo.max_length=3$"):
        dpo.encode_pairs(frame.assign(prompt=["the movie was great"]), tokenizer, 3, "pairs")


def test_reference_logprobs_are_each_pair_s_own(tiny_gpt2_dir: Path, tokenizer) -> None:
    """Batched and padded, each row's log-prob is the one the model gives that prompt + response alone."""
    reference = load(tiny_gpt2_dir)
    frame = pd.DataFrame({"prompt": ["", "The movie was"], "chosen": ["a great film", "great"],
                          "rejected": ["awful", "an awful plot it is"]})
    pairs = prepared(frame, reference, tokenizer)
    for row in range(2):
        for side, response in enumerate((pairs.chosen[row], pairs.rejected[row])):
            ids = torch.tensor([pairs.prompts[row] + response])
            with torch.no_grad():
                logits = reference(ids).logits[0, len(pairs.prompts[row]) - 1: -1]
            expected = logits.log_softmax(-1).gather(-1, torch.tensor(response)[:, None]).sum().item()
            assert pairs.ref_logprobs[row, side].item() == pytest.approx(expected, abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["dpo", "ipo"])
def test_preference_training_learns_an_obvious_signal(tiny_gpt2_dir: Path, tokenizer, loss: str) -> None:
    reference, lm = load(tiny_gpt2_dir), load(tiny_gpt2_dir)
    config = CONFIG.model_copy(update=dict(loss=loss))
    train = prepared(signal_pairs(64, 0), reference, tokenizer)
    held_out = prepared(signal_pairs(32, 1), reference, tokenizer)
    before = dpo.evaluate(dpo.PairModel(lm, tokenizer, CPU), held_out, config)
    assert before["rewards/accuracies"] < 0.5 and abs(before["rewards/margins"]) < 1e-4  # the policy is the reference
    steps = []
    result = dpo.train(dpo.PairModel(lm, tokenizer, CPU), train, config, torch.Generator().manual_seed(0),  # 8 steps
                       after_step=lambda step, stats: steps.append((step, stats)))
    assert [step for step, _ in steps] == list(range(8))
    assert steps[-1][1]["rewards/accuracies"] >= 0.9 and steps[-1][1]["loss"] == pytest.approx(result.losses[-1])
    after = dpo.evaluate(dpo.PairModel(lm, tokenizer, CPU), held_out, config)
    assert after["rewards/accuracies"] >= 0.9
    assert after["rewards/margins"] > 0 and after["logratios/chosen"] > after["logratios/rejected"]
    assert after["loss"] < before["loss"] and sum(result.losses[-4:]) / 4 < result.losses[0]


@pytest.mark.slow
def test_the_nll_term_holds_the_chosen_responses_likelihood_up(tiny_gpt2_dir: Path, tokenizer) -> None:
    """RPO's term: trained alike, the policy with it gives the held-out chosen responses a higher log-ratio than the
    one without, and still ranks the pairs."""
    reference = load(tiny_gpt2_dir)
    train = prepared(signal_pairs(64, 0), reference, tokenizer)
    held_out = prepared(signal_pairs(32, 1), reference, tokenizer)
    after = {}
    for alpha in (0.0, 1.0):
        lm = load(tiny_gpt2_dir)
        config = CONFIG.model_copy(update=dict(rpo_alpha=alpha))
        dpo.train(dpo.PairModel(lm, tokenizer, CPU), train, config, torch.Generator().manual_seed(0))
        after[alpha] = dpo.evaluate(dpo.PairModel(lm, tokenizer, CPU), held_out, config)
    assert after[1.0]["logratios/chosen"] > after[0.0]["logratios/chosen"] + 1
    assert after[1.0]["rewards/accuracies"] >= 0.9


def mean_score(lm, tokenizer, scorer, n: int = 64) -> float:
    """The scorer's mean over ``n`` responses to QUERIES, sampled with fixed lengths and draws."""
    queries = [QUERIES[i % len(QUERIES)] for i in range(n)]
    lengths = response_lengths(n, *RESPONSE_TOKENS, torch.Generator().manual_seed(1))
    run = Sampler(lm, tokenizer, SAMPLING, n).run([tokenizer(q).input_ids for q in queries], lengths, 1, "eval")
    return score_run({"s": scorer}, queries, run.texts, n, "score")["s"].mean().item()


def every_ranked_pair(reference, tokenizer, scorer, k: int) -> list[tuple[str, str, str]]:
    """(prompt, chosen, rejected) of the draws ``sample_pairs(seed=0)`` makes, compared two by two in a loop."""
    queries = [q for q in PAIR_PROMPTS for _ in range(k)]
    lengths = response_lengths(len(queries), *RESPONSE_TOKENS, torch.Generator().manual_seed(0))
    texts = Sampler(reference, tokenizer, SAMPLING, 16).run([tokenizer(q).input_ids for q in queries], lengths, 0,
                                                            "sample").texts
    scores = [scorer([q], [t]).item() for q, t in zip(queries, texts, strict=True)]
    pairs = []
    for p in range(len(PAIR_PROMPTS)):
        for i in range(p * k, (p + 1) * k):
            for j in range(p * k, (p + 1) * k):
                if scores[i] > scores[j]:
                    pairs.append((queries[i], texts[i], texts[j]))
    return sorted(pairs)


@pytest.mark.slow
def test_sampled_pairs_rank_as_the_scorer_and_dpo_on_them_raises_its_score(tiny_gpt2_dir: Path, tokenizer) -> None:
    reference, lm = load(tiny_gpt2_dir), load(tiny_gpt2_dir)
    scorer = TokenShareScorer(tokenizer, cutoff=len(tokenizer) // 4)
    k = 8
    prompts = Prompts([tokenizer(q).input_ids for q in PAIR_PROMPTS], PAIR_PROMPTS)
    table = sample_pairs(Sampler(reference, tokenizer, SAMPLING, 16), prompts, k, RESPONSE_TOKENS, scorer, seed=0)
    assert table.schema == SAMPLED_PAIR_SCHEMA
    frame = table.to_pandas()
    rescored = [scorer(frame["prompt"].tolist(), frame[side].tolist()) for side in ("chosen", "rejected")]
    assert torch.equal(rescored[0], torch.tensor(frame["chosen_score"].to_numpy()))
    assert torch.equal(rescored[1], torch.tensor(frame["rejected_score"].to_numpy()))
    assert (frame["chosen_score"] > frame["rejected_score"]).all()
    assert sorted(zip(frame["prompt"], frame["chosen"], frame["rejected"], strict=True)) == every_ranked_pair(
        reference, tokenizer, scorer, k), "exactly the pairs of the same draws ranked one by one"

    before = mean_score(reference, tokenizer, scorer)
    config = CONFIG.model_copy(update=dict(learning_rate=3e-2, batch_size=16, epochs=2))  # ~210 pairs: 26 steps
    dpo.train(dpo.PairModel(lm, tokenizer, CPU), prepared(frame, reference, tokenizer), config,
              torch.Generator().manual_seed(0))
    assert mean_score(lm, tokenizer, scorer) > before + 0.1


def test_sample_pairs_needs_two_samples_per_prompt(tiny_gpt2_dir: Path, tokenizer) -> None:
    with pytest.raises(ValueError, match="k must be >= 2"):
        sample_pairs(Sampler(load(tiny_gpt2_dir), tokenizer, SAMPLING, 4), Prompts([[1]], ["x"]), 1, RESPONSE_TOKENS,
                     TokenShareScorer(tokenizer, 10), 0)


class Interrupted(Exception):
    pass


def interrupt_at(lm, call: int) -> None:
    """Raise in the ``call``-th forward pass of ``lm``'s backbone: a fault from outside the training code."""
    calls = 0

    def hook(module, args) -> None:
        nonlocal calls
        calls += 1
        if calls == call:
            raise Interrupted

    lm.base_model.register_forward_pre_hook(hook)


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tiny_gpt2_dir: Path, tokenizer, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = CONFIG.model_copy(update=dict(checkpoint_every=2))  # 32 pairs: 4 steps, a checkpoint after 2
    reference = load(tiny_gpt2_dir)
    pairs = prepared(signal_pairs(32, 0), reference, tokenizer)

    def run(lm, steps: list) -> dpo.FitResult:
        return dpo.train(dpo.PairModel(lm, tokenizer, CPU), pairs, config, torch.Generator().manual_seed(0),
                         fingerprint="run-a",
                         after_step=lambda step, stats: steps.append((step, stats)))

    whole, every_step = load(tiny_gpt2_dir), []
    uninterrupted = run(whole, every_step)
    # a completed run's checkpoints go once the stage's outputs are in place (StagedOutputs), not in the loop
    shutil.rmtree(tmp_path / "data/checkpoints/dpo")
    first = load(tiny_gpt2_dir)
    interrupt_at(first, 4)  # in step 4 (one forward a step): the newest checkpoint is after step 2
    with pytest.raises(Interrupted):
        run(first, [])
    assert [p.name for p in (tmp_path / "data/checkpoints/dpo").iterdir()] == ["step-000001"]
    torch.manual_seed(123)  # the checkpoint restores the global RNGs too
    resumed_lm = load(tiny_gpt2_dir)
    steps_after_resume = []
    resumed = run(resumed_lm, steps_after_resume)
    assert resumed.losses == uninterrupted.losses
    assert steps_after_resume == every_step[2:], "the same batches and stats, from the step after the checkpoint"
    for a, b in zip(resumed_lm.parameters(), whole.parameters(), strict=True):
        assert torch.equal(a, b)



def test_training_refuses_pairs_without_reference_logprobs_or_fewer_than_a_batch(tiny_gpt2_dir: Path,
                                                                                  tokenizer) -> None:
    lm = load(tiny_gpt2_dir)
    pairs = dpo.encode_pairs(signal_pairs(4, 0), tokenizer, CONFIG.max_length, "pairs")
    with pytest.raises(ValueError, match="no reference log-probs"):
        dpo.train(dpo.PairModel(lm, tokenizer, CPU), pairs, CONFIG, torch.Generator())
    with pytest.raises(DataError, match=r"^4 training pairs, fewer than dpo.batch_size=8$"):
        policy = dpo.PairModel(lm, tokenizer, CPU)
        dpo.train(policy, dpo.with_reference(pairs, policy, 4), CONFIG, torch.Generator())
