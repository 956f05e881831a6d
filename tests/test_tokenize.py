"""The tokenize stage: sft's corpus as ids, each review then EOS in the seeded order, read by sft only under the params
they were made with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import set_params
from helpers import TRAINING, interrupted_at_call
from safetensors.torch import load_file

from rlhf.data import tokens
from rlhf.data.imdb import load_imdb
from rlhf.models.loading import load_tokenizer
from rlhf.pipeline.errors import DataError, ParamsError
from rlhf.pipeline.params import defaults
from rlhf.train import sft
from stages import sft as sft_stage
from stages import tokenize as tokenize_stage


def ids_of(texts: list[str], tokenizer) -> list[int]:
    """The reference: each text's ids, then EOS."""
    return [i for text in texts for i in [*tokenizer(text, add_special_tokens=False).input_ids,
                                           tokenizer.eos_token_id]]


def test_the_stream_is_each_review_then_eos_in_the_drawn_order_up_to_the_budget(
        tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = load_tokenizer(str(tokenizer_dir), defaults().model)
    texts = pd.Series(["a great movie", "the plot was dull", "loved it", "a mess"])
    order = np.random.default_rng(3).permutation(len(texts))
    stream, reviews = tokens.token_stream(texts, tokenizer, None, np.random.default_rng(3))
    assert stream.dtype == np.uint16 and stream.tolist() == ids_of(texts.iloc[order].tolist(), tokenizer)
    assert reviews.tolist() == [i for i in order for _ in ids_of([texts.iloc[i]], tokenizer)]
    monkeypatch.setattr(tokens, "CHUNK", 2)  # the budget is reached in the first chunk of two reviews
    stream, reviews = tokens.token_stream(texts, tokenizer, 1)
    assert stream.tolist() == ids_of(texts.iloc[:2].tolist(), tokenizer) and reviews.max() == 1


def test_the_stage_writes_sft_s_ids_and_sft_refuses_ids_of_other_params(
        project: Path, imdb_dir: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(project)
    set_params(project, **{"data.source": str(imdb_dir), "model.tokenizer": str(tokenizer_dir), **TRAINING["sft"]})
    tokenize_stage.main()
    tokenizer = load_tokenizer(str(tokenizer_dir), defaults().model)
    train, test = (np.load(path) for path in (tokens.TRAIN_TOKENS, tokens.TEST_TOKENS))
    eval_reviews = TRAINING["sft"]["sft.eval_reviews"]
    held_out = tokenizer.decode(test).split(tokenizer.eos_token)
    assert held_out[-1] == "" and len(held_out) == eval_reviews + 1
    assert set(held_out[:-1]) <= set(load_imdb(str(imdb_dir), None, ["test"])["test"]["text"])
    assert train[-1] == tokenizer.eos_token_id and len(train) >= TRAINING["sft"]["sft.max_tokens"] / 2
    labels = np.load(tokens.TRAIN_LABELS)
    source = pd.concat(load_imdb(str(imdb_dir), None, ["train", "unsupervised"]).values())  # sft.splits
    reviews = tokenizer.decode(train).split(tokenizer.eos_token)[:-1]
    ends = np.flatnonzero(train == tokenizer.eos_token_id)  # a review's tokens and EOS: its row's label
    assert len(labels) == len(train) and len(ends) == len(reviews) and set(labels) == {-1, 0, 1}
    for review, start, end in zip(reviews, [0, *ends[:-1] + 1], ends, strict=True):
        assert len(set(labels[start: end + 1])) == 1
        assert labels[start] in set(source.loc[source["text"] == review, "label"])
    metrics = json.loads(Path("metrics/tokenize.json").read_text())["tokenize"]
    assert (metrics["tokens"], metrics["test_tokens"]) == (len(train), len(test))

    set_params(project, **{"sft.max_tokens": 8 * 32 * 50})
    with pytest.raises(DataError, match=r"^data/tokens: tokenized with other params \(sft\.max_tokens\): run the "
                                        r"tokenize stage"):
        sft_stage.main()
    assert not Path("models/sft").exists() and not Path("data/checkpoints/sft").exists()

    set_params(project, **{"sft.enabled": False})
    tokenize_stage.main()
    assert sorted(p.name for p in tokens.TOKENS_DIR.iterdir()) == ["DISABLED"]
    set_params(project, **{"sft.enabled": True})
    with pytest.raises(DataError, match=r"^data/tokens: holds no tokens \(run the tokenize stage"):
        sft_stage.main()


@pytest.mark.slow
def test_sft_with_a_sentiment_coef_saves_no_head_and_a_killed_run_resumes_to_the_same_model(
        project: Path, imdb_dir: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The head trains in the checkpoints (a resumed run would otherwise restart it from a new init) and never
    reaches models/sft."""
    monkeypatch.chdir(project)
    set_params(project, **{"data.source": str(imdb_dir), "model.tokenizer": str(tokenizer_dir), **TRAINING["sft"],
                           "sft.sentiment_coef": 1.0, "sft.max_tokens": 8 * 32 * 12})
    tokenize_stage.main()
    sft_stage.main()  # 12 steps, a checkpoint every 5
    saved = load_file("models/sft/model.safetensors")
    assert saved and not any("sentiment" in name for name in saved)
    assert "sentiment_head.weight" in load_file("data/checkpoints/sft/step-000011/model.safetensors")
    uninterrupted = {name: Path(name).read_bytes() for name in ("models/sft/model.safetensors",
                                                                "metrics/sft/loss.csv")}
    shutil.rmtree("data/checkpoints/sft")  # the finished run's last: the same run again would end at once

    with interrupted_at_call(sft, "next_token_loss", 8), pytest.raises(KeyboardInterrupt):  # in step 7
        sft_stage.main()
    sft_stage.main()
    assert {name: Path(name).read_bytes() for name in uninterrupted} == uninterrupted


def test_a_sentiment_coef_without_labelled_reviews_stops_before_training(
        project: Path, imdb_dir: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(project)
    set_params(project, **{"data.source": str(imdb_dir), "model.tokenizer": str(tokenizer_dir), **TRAINING["sft"],
                           "sft.splits": ["unsupervised"], "sft.sentiment_coef": 0.5})
    tokenize_stage.main()
    with pytest.raises(ParamsError, match=r"^sft\.sentiment_coef: 0\.5 needs labelled reviews, and sft\.splits "
                                          r"\(unsupervised\) hold none"):
        sft_stage.main()
    assert not Path("models/sft").exists() and not Path("data/checkpoints/sft").exists()
