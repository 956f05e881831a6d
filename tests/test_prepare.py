"""Prompts and pairs: batched tokenization of openings, prompt lengths, pairing rules, seeding, user pair files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import make_split

from rlhf.data.imdb import filter_reviews, load_imdb
from rlhf.data.prepare import (
    CHARS_PER_TOKEN,
    TAIL_TOKENS,
    Tokenized,
    build_pairs,
    build_prompts,
    generator,
    read_pairs_file,
    tokenize,
)
from rlhf.models.loading import load_tokenizer
from rlhf.pipeline.errors import DataError
from rlhf.pipeline.params import defaults


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path):
    return load_tokenizer(str(tokenizer_dir), defaults().model)


@pytest.fixture(scope="module")
def reviews(imdb_dir: Path) -> dict[str, pd.DataFrame]:
    splits = load_imdb(str(imdb_dir), None, ["train", "test"])
    return {name: filter_reviews(frame, 200, name) for name, frame in splits.items()}


@pytest.fixture(scope="module")
def ids(reviews: dict[str, pd.DataFrame], tokenizer) -> dict[str, list[list[int]]]:
    return {name: tokenize(frame["text"].tolist(), tokenizer, 32) for name, frame in reviews.items()}


def whole(texts: list[str], tokenizer) -> list[list[int]]:
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


# --- tokenization ------------------------------------------------------------------------------------------------


def test_tokenize_gives_the_whole_texts_first_tokens(tokenizer) -> None:
    chars = CHARS_PER_TOKEN * (8 + TAIL_TOKENS)
    texts = make_split(60, seed=7)["text"].tolist() + [
        "short review",
        "x" * (3 * chars),  # no space to cut at
        "great " * 10 + "superb" * 40 + " end",  # one long word across the cut
        "a " + "superb" * 100,  # the opening ("a") is too short: the whole text is tokenized
        "the  film\n\n was   dull " * 30,  # runs of spaces and newlines around the cut
        "!?" * chars + " and then some words",  # dense punctuation: few characters per token
    ]
    assert sum(len(t) > chars for t in texts) > 40  # most texts really are cut
    for max_tokens in (8, 32):
        assert tokenize(texts, tokenizer, max_tokens) == [row[:max_tokens] for row in whole(texts, tokenizer)]


# --- prompts -----------------------------------------------------------------------------------------------------


def prompts(reviews: pd.DataFrame, ids: list[list[int]], tokenizer, seed: int, n: int | None = None) -> pd.DataFrame:
    return build_prompts(Tokenized(reviews, ids, tokenizer), n, (2, 8), np.random.default_rng(seed)).to_pandas()


def test_prompt_lengths(reviews, ids, tokenizer) -> None:
    table = prompts(reviews["train"], ids["train"], tokenizer, seed=0)
    lengths = table["input_ids"].map(len)
    assert len(table) == len(reviews["train"])
    assert set(lengths) == set(range(2, 9))  # every length in [2, 8] drawn, none outside
    full = whole(reviews["train"]["text"].tolist(), tokenizer)
    assert all(list(p) == row[: len(p)] for p, row in zip(table["input_ids"], full, strict=True))
    assert table["query"].tolist() == tokenizer.batch_decode([list(p) for p in table["input_ids"]])
    assert table["review_id"].tolist() == reviews["train"]["review_id"].tolist()
    assert table["label"].tolist() == reviews["train"]["label"].tolist()


def test_prompts_are_seeded(reviews, ids, tokenizer) -> None:
    first = prompts(reviews["train"], ids["train"], tokenizer, seed=0)["input_ids"].map(list).tolist()
    assert prompts(reviews["train"], ids["train"], tokenizer, seed=0)["input_ids"].map(list).tolist() == first
    assert prompts(reviews["train"], ids["train"], tokenizer, seed=1)["input_ids"].map(list).tolist() != first
    # one generator per output: the eval prompts do not shift when another output draws more numbers
    assert generator(0, "prompts/eval").random(4).tolist() == generator(0, "prompts/eval").random(4).tolist()
    assert generator(0, "prompts/eval").random(4).tolist() != generator(0, "pairs/test").random(4).tolist()


def test_prompt_cap(reviews, ids, tokenizer) -> None:
    test, n = reviews["test"], 20
    table = prompts(test, ids["test"], tokenizer, seed=0, n=n)
    assert len(table) == n and table["review_id"].is_unique
    position = {rid: i for i, rid in enumerate(test["review_id"])}
    assert sorted(table["review_id"], key=position.get) == table["review_id"].tolist()  # file order
    assert table["review_id"].tolist() != prompts(test, ids["test"], tokenizer, seed=1, n=n)["review_id"].tolist()


# --- pairs -------------------------------------------------------------------------------------------------------


def pairs(reviews, ids, tokenizer, split: str, n: int, by_rating: bool = False, seed: int = 0) -> pd.DataFrame:
    return build_pairs(Tokenized(reviews[split], ids[split], tokenizer), n, (4, 12), by_rating,
                       np.random.default_rng(seed), split).to_pandas()


def assert_openings(table: pd.DataFrame, reviews: pd.DataFrame, ids: list[list[int]], tokenizer) -> None:
    """Each side is its review's first k tokens, decoded, with k in [4, 12]; ratings are the review's."""
    row = {rid: i for i, rid in enumerate(reviews["review_id"])}
    for side in ("chosen", "rejected"):
        for text, rid, rating in zip(table[side], table[f"{side}_id"], table[f"{side}_rating"], strict=True):
            tokens = ids[row[rid]]
            assert text in {tokenizer.decode(tokens[:k]) for k in range(4, 13)}
            assert rating == reviews["rating"][row[rid]]


def test_pairs_positive_over_negative(reviews, ids, tokenizer) -> None:
    table = pairs(reviews, ids, tokenizer, "train", 50)
    label = dict(zip(reviews["train"]["review_id"], reviews["train"]["label"], strict=True))
    assert len(table) == 50
    assert all(label[c] == 1 and label[r] == 0 for c, r in zip(table["chosen_id"], table["rejected_id"], strict=True))
    assert table["chosen_id"].is_unique and table["rejected_id"].is_unique  # no repeats while reviews last
    assert_openings(table, reviews["train"], ids["train"], tokenizer)
    lengths = {len(tokenizer(t, add_special_tokens=False).input_ids) for t in table["chosen"]}
    assert len(lengths) > 4  # each side draws its own length
    assert table.equals(pairs(reviews, ids, tokenizer, "train", 50))
    assert not table.equals(pairs(reviews, ids, tokenizer, "train", 50, seed=1))


def test_test_pairs_come_from_the_test_split(reviews, ids, tokenizer) -> None:
    table = pairs(reviews, ids, tokenizer, "test", 30)
    test_ids = set(reviews["test"]["review_id"])
    assert set(table["chosen_id"]) | set(table["rejected_id"]) <= test_ids
    assert not test_ids & set(reviews["train"]["review_id"])
    assert_openings(table, reviews["test"], ids["test"], tokenizer)


def test_pairs_repeat_reviews_evenly_only_when_needed(reviews, ids, tokenizer) -> None:
    n_pos = int((reviews["test"]["label"] == 1).sum())
    table = pairs(reviews, ids, tokenizer, "test", 2 * n_pos + 3)
    uses = table["chosen_id"].value_counts()
    assert len(uses) == n_pos and set(uses) == {2, 3}


def test_pairs_by_rating(reviews, ids, tokenizer) -> None:
    table = pairs(reviews, ids, tokenizer, "train", 300, by_rating=True)  # more pairs than one round gives
    assert len(table) == 300
    assert (table["chosen_rating"] > table["rejected_rating"]).all()
    label = dict(zip(reviews["train"]["review_id"], reviews["train"]["label"], strict=True))
    assert {label[c] for c in table["chosen_id"]} == {0, 1}  # a 4-star review beats a 2-star one
    assert_openings(table, reviews["train"], ids["train"], tokenizer)


def test_pairs_need_both_sides(reviews, ids, tokenizer) -> None:
    train = reviews["train"]
    with pytest.raises(DataError, match=r"^x: pairs need positive and negative reviews \(\d+ positive, 0 negative "
                                        r"after the filter\)$"):
        build_pairs(Tokenized(train[train["label"] == 1].reset_index(drop=True), ids["train"], tokenizer), 5, (4, 12),
                    False, np.random.default_rng(0), "x")
    with pytest.raises(DataError, match=r"^x: prepare.pairs_by_rating needs reviews with at least two different "
                                        r"star ratings \(this source has none or one; ratings 0 mean unknown\)$"):
        build_pairs(Tokenized(train.assign(rating=0), ids["train"], tokenizer), 5, (4, 12), True,
                    np.random.default_rng(0), "x")


# --- a user's pairs file -----------------------------------------------------------------------------------------


def write_pairs(frame: pd.DataFrame, path: Path) -> Path:
    frame.to_parquet(path) if path.suffix == ".parquet" else frame.to_json(path, orient="records", lines=True)
    return path


def user_pairs(n: int) -> pd.DataFrame:
    return pd.DataFrame({"chosen": [f"good {i}" for i in range(n)], "rejected": [f"{i}" for i in range(n)],
                         "note": "dropped"})


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_pairs_file_passthrough(tmp_path: Path, suffix: str) -> None:
    frame = user_pairs(40)
    tables = read_pairs_file(write_pairs(frame, tmp_path / f"pairs{suffix}"), np.random.default_rng(0))
    train, test = tables["train"].to_pandas(), tables["test"].to_pandas()
    assert list(train.columns) == ["chosen", "rejected", "chosen_id", "rejected_id", "chosen_rating",
                                   "rejected_rating"]
    assert len(test) == 4 and len(train) == 36  # a seeded tenth is held out
    together = pd.concat([train, test]).sort_values("chosen_id", key=lambda ids: ids.str[7:].astype(int))
    assert together["chosen"].tolist() == frame["chosen"].tolist()
    assert together["rejected"].tolist() == frame["rejected"].tolist()  # "5" stays a string
    assert together["chosen_id"].tolist() == [f"chosen_{i}" for i in range(40)]
    assert set(together["chosen_rating"]) == {0}
    again = read_pairs_file(tmp_path / f"pairs{suffix}", np.random.default_rng(0))["test"].to_pandas()
    assert again.equals(test)
    assert not read_pairs_file(tmp_path / f"pairs{suffix}", np.random.default_rng(1))["test"].to_pandas().equals(test)


def test_pairs_file_split_ids_and_ratings(tmp_path: Path) -> None:
    frame = user_pairs(6).assign(split=["train", "test"] * 3, chosen_id=list("abcdef"), chosen_rating=[9.0] * 6,
                                 rejected_rating=[2, None, 3, 4, 1, 1])
    tables = read_pairs_file(write_pairs(frame, tmp_path / "pairs.parquet"), np.random.default_rng(0))
    test = tables["test"].to_pandas()
    assert test["chosen"].tolist() == ["good 1", "good 3", "good 5"]
    assert test["chosen_id"].tolist() == ["b", "d", "f"] and test["rejected_id"].tolist() == [
        "rejected_1", "rejected_3", "rejected_5"]
    assert test["chosen_rating"].tolist() == [9, 9, 9] and test["rejected_rating"].tolist() == [0, 4, 1]


def test_trl_preference_data_with_a_prompt_column_scores_prompt_and_completion(tmp_path: Path) -> None:
    frame = pd.DataFrame({"prompt": ["The film", "The film", ""], "chosen": [" was great", " moved me", "Loved it"],
                          "rejected": [" was dull", " bored me", "Hated it"], "split": ["train", "train", "test"]})
    tables = read_pairs_file(write_pairs(frame, tmp_path / "pairs.jsonl"), np.random.default_rng(0))
    train = tables["train"].to_pandas()
    assert train["chosen"].tolist() == ["The film was great", "The film moved me"]
    assert train["rejected"].tolist() == ["The film was dull", "The film bored me"]
    assert tables["test"].to_pandas()["chosen"].tolist() == ["Loved it"]


def test_trl_conversational_pairs_are_refused_naming_the_chat_template(tmp_path: Path) -> None:
    turn = [{"role": "user", "content": "Review?"}, {"role": "assistant", "content": "Great"}]
    path = write_pairs(pd.DataFrame({"chosen": [turn], "rejected": [turn[:1]]}), tmp_path / "pairs.jsonl")
    with pytest.raises(DataError, match=f"^{path}: chosen holds lists of messages .*chat template"):
        read_pairs_file(path, np.random.default_rng(0))


@pytest.mark.parametrize(("name", "frame", "message"), [
    ("pairs.parquet", pd.DataFrame({"chosen": ["a"], "other": ["b"]}),
     r"missing column 'rejected' \(columns: chosen, other\)$"),
    ("pairs.parquet", pd.DataFrame({"chosen": ["a", "b"], "rejected": ["b", " "]}),
     r"row 1: rejected is ' ', not a non-empty string$"),
    ("pairs.jsonl", pd.DataFrame({"chosen": ["a", 5], "rejected": ["b", "c"]}), r"row 1: chosen is 5, not a "
                                                                                r"non-empty string$"),
    ("pairs.parquet", pd.DataFrame({"chosen": pd.Series([], dtype=str), "rejected": pd.Series([], dtype=str)}),
     r"no pairs$"),
    ("pairs.parquet", pd.DataFrame({"chosen": ["a", "b"], "rejected": ["c", "d"], "split": ["train", "dev"]}),
     r"row 1: split 'dev' is not train or test$"),
    ("pairs.parquet", pd.DataFrame({"chosen": ["a", "b"], "rejected": ["c", "d"], "split": ["train", "train"]}),
     r"needs pairs for both train and test \(0 of 2 are test\)$"),
    ("pairs.parquet", pd.DataFrame({"chosen": ["a"], "rejected": ["c"]}), r"needs pairs for both train and test "
                                                                          r"\(0 of 1 are test\)$"),
    ("pairs.parquet", pd.DataFrame({"chosen": ["a"], "rejected": ["c"], "chosen_rating": ["ten"]}),
     r"row 0: chosen_rating 'ten' is not a number$"),
])
def test_bad_pairs_file(tmp_path: Path, name: str, frame: pd.DataFrame, message: str) -> None:
    path = write_pairs(frame, tmp_path / name)
    with pytest.raises(DataError, match=f"^{path}: {message}"):
        read_pairs_file(path, np.random.default_rng(0))


@pytest.mark.parametrize(("name", "content", "message"), [
    ("pairs.jsonl", b"", "empty file"),
    ("pairs.jsonl", b'{"chosen": "a", "rejected": \n', "unreadable pairs file: "),
    ("pairs.parquet", b"PAR1 not really", "unreadable pairs file: "),
    ("pairs.csv", b"chosen,rejected\na,b\n", "prepare.pairs_source must be a .parquet or .jsonl file"),
])
def test_unreadable_pairs_file(tmp_path: Path, name: str, content: bytes, message: str) -> None:
    (tmp_path / name).write_bytes(content)
    with pytest.raises(DataError) as caught:
        read_pairs_file(tmp_path / name, np.random.default_rng(0))
    assert str(caught.value).startswith(f"{tmp_path / name}: {message}")
    assert "\n" not in str(caught.value)


# --- the real data -----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.shared
def test_real_imdb_gives_24895_train_prompts(shared_dir: Path) -> None:
    tokenizer = load_tokenizer(str(shared_dir / "gpt2-tokenizer"), defaults().model)
    train = filter_reviews(load_imdb(str(shared_dir / "imdb"), None, ["train"])["train"], 200, "train")
    assert len(train) == 24_895
    ids = tokenize(train["text"].tolist(), tokenizer, 8)
    table = build_prompts(Tokenized(train, ids, tokenizer), None, (2, 8), np.random.default_rng(0)).to_pandas()
    assert len(table) == 24_895 and set(table["input_ids"].map(len)) == set(range(2, 9))
    sample = train["text"].tolist()[::25]  # 1,000 reviews: the openings give exactly the whole texts' tokens
    assert tokenize(sample, tokenizer, 32) == [row[:32] for row in whole(sample, tokenizer)]
