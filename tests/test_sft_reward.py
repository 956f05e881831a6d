"""sft and reward: they learn, reload to the same outputs, read the right token, and refuse bad input."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import set_params
from helpers import run_cli, signal_pairs
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf.data.pairs import read_pairs
from rlhf.models.loading import load_tokenizer
from rlhf.pipeline.errors import DataError, ModelError, ParamsError
from rlhf.pipeline.params import Params, defaults, parse_params
from rlhf.train import reward_model, sft
from stages import reward

CPU = torch.device("cpu")


def tiny_params(tokenizer_dir: Path, **sft_overrides: object) -> Params:
    p = defaults()
    s = p.sft.model_copy(update=dict(enabled=True, n_layer=2, n_embd=32, n_head=2, n_positions=64, block_size=32,
                                     batch_size=8, max_tokens=8 * 32 * 60, learning_rate=3e-3, warmup_steps=5,
                                     checkpoint_every=0, **sft_overrides))  # unit tests write no checkpoints
    r = p.reward.model_copy(update=dict(train=True, batch_size=16, learning_rate=1e-3, epochs=3, max_length=32,
                                        checkpoint_every=0))
    return p.model_copy(update=dict(model=p.model.model_copy(update={"tokenizer": str(tokenizer_dir)}), sft=s,
                                     reward=r))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path):
    return load_tokenizer(str(tokenizer_dir), defaults().model)


def test_pack_puts_eos_between_reviews(tokenizer) -> None:
    texts = pd.Series(["a great movie", "the plot was dull", "loved it"])
    blocks = sft.pack(texts, tokenizer, block_size=4, max_tokens=None)
    stream = [i for text in texts for i in [*tokenizer(text, add_special_tokens=False).input_ids,
                                             tokenizer.eos_token_id]]
    assert blocks.flatten().tolist() == stream[: len(blocks) * 4]


def test_perplexity_matches_a_token_loop(tiny_gpt2_dir: Path) -> None:
    lm = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir)
    blocks = torch.randint(0, 300, (3, 10), generator=torch.Generator().manual_seed(0))
    nll, n = 0.0, 0
    with torch.no_grad():
        for block in blocks:
            logits = lm(block[None]).logits[0]
            for t in range(1, len(block)):
                nll -= torch.log_softmax(logits[t - 1], -1)[block[t]].item()
                n += 1
    assert sft.perplexity(lm, blocks, batch_size=2, device=CPU) == pytest.approx(math.exp(nll / n), rel=1e-4)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_next_token_loss_and_its_gradient_are_hugging_face_s(tiny_gpt2_dir: Path, precision: str) -> None:
    """The training loss is what ``lm(input_ids, labels=input_ids).loss`` computes, under the same autocast."""
    lm = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir)
    blocks = torch.randint(0, 300, (3, 10), generator=torch.Generator().manual_seed(0))
    ours = sft.next_token_loss(lm, blocks, precision)
    ours.backward()
    our_grads = [p.grad.clone() for p in lm.parameters()]
    lm.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        theirs = lm(input_ids=blocks, labels=blocks).loss
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-5)
    for mine, p in zip(our_grads, lm.parameters(), strict=True):
        torch.testing.assert_close(mine, p.grad, rtol=1e-3, atol=1e-6)


@pytest.mark.slow
def test_sft_loss_goes_down_and_reloads(tokenizer_dir: Path, imdb_dir: Path, tokenizer, tmp_path: Path) -> None:
    params = tiny_params(tokenizer_dir)
    torch.manual_seed(0)
    lm = sft.build_model(params, tokenizer)
    texts = pd.read_parquet(imdb_dir / "train.parquet")["text"]
    blocks = sft.pack(texts, tokenizer, 32, None)
    before = sft.perplexity(lm, blocks[:16], 8, CPU)
    result = sft.train(lm, blocks, params, CPU, torch.Generator().manual_seed(0))
    first, last = result.losses[0], sum(result.losses[-5:]) / 5
    assert last < first - 1.0
    assert sft.perplexity(lm, blocks[:16], 8, CPU) < before / 4
    lm.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    lm.eval()
    assert torch.equal(lm(blocks[:2]).logits, again(blocks[:2]).logits)


def raw_params(**sections: dict) -> dict:
    """Every key at its default (params.yaml must be complete), with ``sections``' keys changed."""
    raw = defaults().model_dump()
    for name, changes in sections.items():
        raw[name].update(changes)
    return raw


def test_scratch_config_must_fit_n_positions(tokenizer_dir: Path) -> None:
    raw = raw_params(sft={"enabled": True, "block_size": 512, "n_positions": 256},
                     model={"tokenizer": str(tokenizer_dir)})
    with pytest.raises(ParamsError, match=r"sft.block_size: must be <= sft.n_positions \(256\) \(got 512\)"):
        parse_params(raw)


def test_missing_sft_base_is_named(tmp_path: Path) -> None:
    with pytest.raises(ParamsError, match=r"^params.yaml: sft.base: local path does not exist"):
        parse_params(raw_params(sft={"enabled": True, "base": str(tmp_path / "nope")}))


@pytest.mark.slow
@pytest.mark.parametrize("margin", [False, True])
def test_reward_model_learns_an_obvious_signal(tokenizer_dir: Path, tmp_path: Path, margin: bool) -> None:
    params = tiny_params(tokenizer_dir)
    params = params.model_copy(update={"reward": params.reward.model_copy(update={"base": "scratch",
                                                                                  "margin": margin})})
    torch.manual_seed(0)
    model, tok = reward_model.build(params)
    result = reward_model.train(model, tok, signal_pairs(320, 0), params, CPU, torch.Generator().manual_seed(0))
    assert sum(result.losses[-5:]) / 5 < result.losses[0] - 0.3
    test = signal_pairs(100, 1)
    chosen, rejected = reward_model.evaluate(model, tok, test, 32, CPU)
    assert (chosen > rejected).float().mean().item() >= 0.9
    assert abs(torch.cat([chosen, rejected]).mean().item()) < 1.0  # the centring term keeps 0 in the middle
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path)
    tokenizer = load_tokenizer(str(tmp_path), defaults().model, padding_side=None)
    again, _ = reward_model.evaluate(reloaded, tokenizer, test, 32, CPU)
    assert torch.allclose(again, chosen, atol=1e-5)


def test_score_is_read_at_the_last_real_token_for_either_padding(tiny_classifier_dir: Path) -> None:
    model = AutoModelForSequenceClassification.from_pretrained(tiny_classifier_dir).eval()
    texts = ["a great movie with a superb plot", "dull"]
    for side in ("right", "left"):
        tok = load_tokenizer(str(tiny_classifier_dir), defaults().model, padding_side=side)
        with torch.no_grad():
            batched = reward_model.scores(model, tok, texts, 32, CPU)
            alone = torch.cat([reward_model.scores(model, tok, [t], 32, CPU) for t in texts])
        if side == "right":
            assert torch.allclose(batched, alone, atol=1e-5)
        else:
            # absolute position embeddings shift under left padding; the reward stage therefore pads right
            assert not torch.allclose(batched, alone, atol=1e-5)


def test_bradley_terry_loss_from_definition() -> None:
    chosen, rejected = torch.tensor([1.0, -0.5]), torch.tensor([0.0, 0.5])
    expected = (math.log(1 + math.exp(-1.0)) + math.log(1 + math.exp(1.0))) / 2
    assert reward_model.bradley_terry_loss(chosen, rejected, None).item() == pytest.approx(expected)
    with_margin = reward_model.bradley_terry_loss(chosen, rejected, torch.tensor([0.5, 0.5])).item()
    assert with_margin == pytest.approx((math.log(1 + math.exp(-0.5)) + math.log(1 + math.exp(1.5))) / 2)
    centred = reward_model.bradley_terry_loss(chosen, rejected, None, center_coef=0.1).item()
    assert centred == pytest.approx(expected + 0.1 * (1.0**2 + 0.0**2) / 2)


@pytest.mark.parametrize(("frame", "message"), [
    (pd.DataFrame({"chosen": ["a"], "other": ["b"]}), r"missing column 'rejected'"),
    (pd.DataFrame({"chosen": pd.Series([], dtype=str), "rejected": pd.Series([], dtype=str)}), r": no pairs$"),
])
def test_bad_pairs(tmp_path: Path, frame: pd.DataFrame, message: str) -> None:
    frame.to_parquet(tmp_path / "pairs.parquet")
    with pytest.raises(DataError, match=message):
        read_pairs(tmp_path / "pairs.parquet")


def test_missing_reward_base_is_named(tmp_path: Path, tokenizer_dir: Path) -> None:
    params = tiny_params(tokenizer_dir)
    bad = str(tmp_path / "no-such-model")
    params = params.model_copy(update={"reward": params.reward.model_copy(update={"base": bad}),
                                       "model": params.model.model_copy(update={"tokenizer": None})})
    with pytest.raises(ModelError, match=rf"^reward.base: {bad}: no such directory"):
        reward_model.build(params)


def folder_hash(path: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(file.name.encode() + file.read_bytes())
    return digest.hexdigest()


def test_disabled_stages_write_a_fixed_marker(project: Path) -> None:
    for name, out in (("sft", "models/sft"), ("reward", "models/reward")):
        assert run_cli(project, name).returncode == 0
        first = folder_hash(project / out)
        set_params(project, **{"sft.max_tokens": 12345, "reward.epochs": 7})
        assert run_cli(project, name).returncode == 0
        assert folder_hash(project / out) == first
        switch = "sft.enabled" if name == "sft" else "reward.train"
        assert (project / out / "DISABLED").read_text().startswith(f"{switch} is false")


def test_fewer_pairs_than_a_batch_are_refused(project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    set_params(project, **{"reward.train": True, "reward.base": "scratch", "reward.batch_size": 8})
    (project / "data/pairs").mkdir(parents=True)
    signal_pairs(5, 0).to_parquet(project / "data/pairs/train.parquet")
    signal_pairs(5, 1).to_parquet(project / "data/pairs/test.parquet")
    monkeypatch.chdir(project)
    with pytest.raises(DataError, match=r"^data/pairs/train.parquet: 5 pairs, fewer than reward.batch_size=8$"):
        reward.main()
