"""sft and reward: they learn, reload to the same outputs, read the right token, and refuse bad input."""

from __future__ import annotations

import hashlib
import math
import warnings
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import set_params
from helpers import count_host_reads, run_cli, signal_pairs
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlhf.data.pairs import read_pairs
from rlhf.data.tokens import token_stream
from rlhf.models.loading import load_tokenizer
from rlhf.pipeline.errors import DataError, ModelError, ParamsError
from rlhf.pipeline.params import Params, defaults, parse_params
from rlhf.train import reward_model, sft
from rlhf.train.fit import READ_EVERY
from stages import reward

CPU = torch.device("cpu")


def tiny_params(tokenizer_dir: Path, **sft_overrides: object) -> Params:
    p = defaults()
    s = p.sft.model_copy(update=dict(enabled=True, n_layer=2, n_embd=32, n_head=2, n_positions=64, block_size=32,
                                     batch_size=8, max_tokens=8 * 32 * 60, learning_rate=3e-3, warmup_steps=5,
                                     checkpoint_every=0) | sft_overrides)  # unit tests write no checkpoints
    r = p.reward.model_copy(update=dict(train=True, batch_size=16, learning_rate=1e-3, epochs=3, max_length=32,
                                        checkpoint_every=0))
    return p.model_copy(update=dict(model=p.model.model_copy(update={"tokenizer": str(tokenizer_dir)}), sft=s,
                                     reward=r))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path):
    return load_tokenizer(str(tokenizer_dir), defaults().model)


def test_pack_puts_eos_between_reviews(tokenizer) -> None:
    texts = pd.Series(["a great movie", "the plot was dull", "loved it"])
    blocks = sft.pack(token_stream(texts, tokenizer, None)[0], 4, "the text")
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


def test_review_label_loss_is_the_mean_logistic_loss_of_the_labelled_tokens() -> None:
    """Against the formula, token by token: -log sigmoid(z) for a positive review's token, -log(1 - sigmoid(z)) for
    a negative one's, unlabelled tokens (-1) skipped."""
    logits = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)) * 3
    labels = torch.tensor([[1, 1, 1, -1, -1], [0, 0, 0, 0, 0], [-1, -1, 1, 1, 1]])
    terms = [-math.log(torch.sigmoid(z).item()) if y == 1 else -math.log(1 - torch.sigmoid(z).item())
             for z, y in zip(logits.flatten(), labels.flatten().tolist(), strict=True) if y >= 0]
    assert sft.review_label_loss(logits, labels).item() == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    assert sft.review_label_loss(logits, torch.full_like(labels, -1)).item() == 0


def test_the_sentiment_term_adds_the_head_s_loss_on_every_position(tiny_gpt2_dir: Path) -> None:
    lm = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir)
    lm.sentiment_head = torch.nn.Linear(lm.config.hidden_size, 1)
    blocks = torch.randint(0, 300, (3, 10), generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[1] * 10, [0] * 4 + [-1] * 6, [-1] * 3 + [1] * 7])
    hidden = lm.transformer(blocks).last_hidden_state
    head = sft.review_label_loss(lm.sentiment_head(hidden).squeeze(-1), labels)
    assert sft.next_token_loss(lm, blocks, "fp32", labels, 0.5).item() == pytest.approx(
        sft.next_token_loss(lm, blocks).item() + 0.5 * head.item(), rel=1e-6)


VOCAB = 400  # the tiny tokenizer's size, about


def structured_blocks(n: int, length: int, seed: int = 0) -> torch.Tensor:
    """(n, length) blocks of counting runs (each token the one before plus 1) from random starts: a next-token
    signal a model learns in a few steps, so the loss moves and a misplaced label would show."""
    starts = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(seed))
    return (starts + torch.arange(length)) % VOCAB


def test_the_scratch_model_attends_through_sdpa_with_no_mask_tensor(tokenizer_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """What makes SDPA's flash kernels eligible on CUDA (bf16 inputs aside): no mask tensor, ``is_causal`` instead,
    eagerly and in the graph torch.compile traces of the loss (one graph, no break); and the forward reads nothing
    back from the device (transformers does, to look for packed sequences, in a forward without a KV cache)."""
    params = tiny_params(tokenizer_dir)
    lm = sft.scratch_model(params.sft, VOCAB, 0)
    assert lm.config._attn_implementation == "sdpa"
    blocks, calls = structured_blocks(2, 16), []
    original = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *args, **kwargs: calls.append(kwargs) or original(*args, **kwargs))
    reads = count_host_reads(monkeypatch)
    sft.next_token_loss(lm, blocks, "bf16")
    monkeypatch.undo()
    assert not reads
    assert len(calls) == params.sft.n_layer
    assert all(call["attn_mask"] is None and call["is_causal"] for call in calls)
    traced = torch._dynamo.explain(sft.next_token_loss)(lm, blocks, "bf16")
    assert (traced.graph_count, traced.graph_break_count) == (1, 0)
    attention = [node.kwargs for node in traced.graphs[0].graph.nodes
                 if node.target is torch._C._nn.scaled_dot_product_attention]
    assert len(attention) == params.sft.n_layer
    assert all(kwargs["attn_mask"] is None and kwargs["is_causal"] for kwargs in attention)


def train_tiny(params: Params, compile_setting: bool, device: torch.device) -> tuple[list[float], list[torch.Tensor]]:
    """sft.train from one seeded init on structured blocks (labelled by their start, for sft.sentiment_coef): (its
    losses, each weight's change)."""
    params = params.model_copy(update={"sft": params.sft.model_copy(update={"compile": compile_setting})})
    torch.manual_seed(0)
    lm = sft.scratch_model(params.sft, VOCAB, 0).to(device)
    initial = [p.detach().clone() for p in lm.parameters()]
    blocks = structured_blocks(64, params.sft.block_size)
    labels = (blocks[:, :1] < VOCAB // 2).long().expand_as(blocks) if params.sft.sentiment_coef else None
    result = sft.train(lm, blocks, params, device, torch.Generator().manual_seed(0),
                       sft.compiled_step(params, device), labels)
    return result.losses, [(p.detach() - p0).cpu() for p, p0 in zip(lm.parameters(), initial, strict=True)]


@pytest.mark.slow
@pytest.mark.parametrize("sentiment_coef", [0.0, 1.0])
def test_the_compiled_sft_step_trains_as_the_eager_one(tokenizer_dir: Path, sentiment_coef: float) -> None:
    """fp32, 4 steps, with and without sft.sentiment_coef's term. Compiled and eager compute the same sums in other
    orders (fused reductions): float rounding, which moves a loss by ~1e-7 relative (rel 1e-5 is 30x the largest
    seen) and all the weights' changes together by ~1e-5 of their size (1e-3 is 50x it). A few single weights differ
    more: those whose exact gradient is 0 or nearly (a key bias: softmax ignores a shift shared by every key), where
    AdamW's m / sqrt(v) turns rounding noise into a move of up to the learning rate; so no bound per weight. A
    gradient that differs in kind (a missed or extra term) changes the weights' moves by order 1."""
    params = tiny_params(tokenizer_dir, max_tokens=8 * 32 * 4, warmup_steps=1, learning_rate=1e-3,
                         sentiment_coef=sentiment_coef)
    params = params.model_copy(update={"model": params.model.model_copy(update={"precision": "fp32"})})
    eager_losses, eager_moves = train_tiny(params, False, CPU)
    compiled_losses, compiled_moves = train_tiny(params, True, CPU)
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-5)
    assert eager_losses[-1] < eager_losses[0]
    eager, compiled = torch.cat([m.flatten() for m in eager_moves]), torch.cat([m.flatten() for m in compiled_moves])
    assert (compiled - eager).norm() <= 1e-3 * eager.norm()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU's host syncs and bf16 kernels need a GPU; the "
                                                          "loop's reads and the compiled step are tested on CPU")
def test_on_cuda_sft_waits_for_the_gpu_only_to_read_losses_and_compiles_to_eager_s_losses(tokenizer_dir: Path) -> None:
    """bf16 (model.precision auto). Eagerly, the only waits in sft.train are fit's reads of READ_EVERY steps' losses
    (torch flags every synchronizing call in its "warn" mode). Compiled, the losses are eager's to bf16 rounding: 8
    significant bits, rounded at other points where kernels are fused (fp32 kept inside), ~1e-3 of a tiny model's
    loss; rel 1e-2 is 10x that."""
    cuda, steps = torch.device("cuda"), READ_EVERY + 2
    params = tiny_params(tokenizer_dir, max_tokens=8 * 32 * steps, warmup_steps=1, learning_rate=1e-3)
    blocks, losses = structured_blocks(64, params.sft.block_size), {}
    for setting in (False, True):
        run = params.model_copy(update={"sft": params.sft.model_copy(update={"compile": setting})})
        torch.manual_seed(0)
        lm = sft.scratch_model(run.sft, VOCAB, 0).to(cuda)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn" if not setting else "default")  # compiling benchmarks kernels: waits
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                losses[setting] = sft.train(lm, blocks, run, cuda, torch.Generator().manual_seed(0),
                                            sft.compiled_step(run, cuda)).losses
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if not setting:
            waits = [w for w in caught if "synchronizing" in str(w.message)]
            assert len(waits) == math.ceil(steps / READ_EVERY), [str(w.message) for w in waits]
    assert losses[True] == pytest.approx(losses[False], rel=1e-2)
    assert losses[False][-1] < losses[False][0]


def test_sft_with_a_sentiment_coef_teaches_the_head_the_labels_and_drops_it(
        tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Labels a head can learn (a block counting up from the vocabulary's lower half is positive): the head's loss,
    as each step computed it, falls from ln 2 (untrained) to under a quarter of it in 20 steps (0.05-0.12 of it over
    seeds 0-3); with every token unlabelled the run is one without the term to the bit; the head is gone after."""
    blocks = structured_blocks(64, 32)
    labels = (blocks[:, :1] < VOCAB // 2).long().expand_as(blocks)
    head_losses, real = [], sft.review_label_loss

    def recorded(*args: torch.Tensor) -> torch.Tensor:
        head_losses.append((value := real(*args)).item())
        return value

    monkeypatch.setattr(sft, "review_label_loss", recorded)
    on, off = (tiny_params(tokenizer_dir, sentiment_coef=coef, max_tokens=8 * 32 * 20) for coef in (1.0, 0.0))
    runs = {}
    for name, params, run_labels in (("labelled", on, labels), ("unlabelled", on, torch.full_like(labels, -1)),
                                     ("off", off, None)):
        torch.manual_seed(0)
        lm = sft.scratch_model(params.sft, VOCAB, 0)
        names = [n for n, _ in lm.named_parameters()]
        runs[name] = sft.train(lm, blocks, params, CPU, torch.Generator().manual_seed(0), labels=run_labels).losses
        assert [n for n, _ in lm.named_parameters()] == names
        if name == "labelled":
            assert head_losses[0] == pytest.approx(math.log(2), abs=0.1)
            assert sum(head_losses[-5:]) / 5 < head_losses[0] / 4
    assert runs["unlabelled"] == runs["off"]


@pytest.mark.slow
def test_sft_loss_goes_down_and_reloads(tokenizer_dir: Path, imdb_dir: Path, tokenizer, tmp_path: Path) -> None:
    params = tiny_params(tokenizer_dir)
    torch.manual_seed(0)
    lm = sft.build_model(params, tokenizer)
    texts = pd.read_parquet(imdb_dir / "train.parquet")["text"]
    blocks = sft.pack(token_stream(texts, tokenizer, None)[0], 32, "the text")
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
