"""load_imdb: every source format gives the same columns; every kind of bad data is one DataError naming the file."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pandas as pd
import pytest
from conftest import make_split

from rlhf.data import imdb as data
from rlhf.data.imdb import COLUMNS, filter_reviews, load_imdb, warn_if_untracked
from rlhf.pipeline.errors import DataError

LABEL_DIRS = {1: "pos", 0: "neg", -1: "unsup"}


def write_aclimdb(root: Path, frames: dict[str, pd.DataFrame]) -> Path:
    """An extracted aclImdb/ folder: <split>/{pos,neg}/<id>_<rating>.txt, unlabelled reviews in train/unsup/."""
    for split, frame in frames.items():
        for i, row in frame.iterrows():
            sub = root / ("train" if row["label"] == -1 else split) / LABEL_DIRS[row["label"]]
            sub.mkdir(parents=True, exist_ok=True)
            (sub / f"{i}_{row['rating']}.txt").write_text(row["text"], encoding="utf-8")
    return root


def write_table(frame: pd.DataFrame, path: Path) -> Path:
    if path.suffix == ".csv":
        frame.to_csv(path, index=False, sep=";" if path.stem.endswith("semicolon") else ",")
    elif path.suffix == ".jsonl":
        frame.to_json(path, orient="records", lines=True)
    else:
        frame.to_parquet(path)
    return path


def kaggle_naming(frame: pd.DataFrame) -> pd.DataFrame:
    """Kaggle's "IMDB Dataset.csv": review, sentiment (positive/negative), nothing else."""
    return pd.DataFrame({"review": frame["text"], "sentiment": frame["label"].map({1: "positive", 0: "negative"})})


def error(source: Path | str, splits: tuple[str, ...] = ("train", "test")) -> str:
    with pytest.raises(DataError) as caught:
        load_imdb(str(source), None, splits)
    return str(caught.value)


# --- sources -----------------------------------------------------------------------------------------------------


def test_parquet_folder(imdb_dir: Path) -> None:
    splits = load_imdb(str(imdb_dir), None, ["train", "test", "unsupervised"])
    train, raw = splits["train"], pd.read_parquet(imdb_dir / "train.parquet")
    assert list(train.columns) == COLUMNS
    assert [str(train[c].dtype) for c in ("label", "rating")] == ["int64", "int64"]
    assert train["text"].tolist() == raw["text"].tolist()
    assert train["label"].tolist() == raw["label"].tolist() and train["rating"].tolist() == raw["rating"].tolist()
    # ids read like the review's aclImdb path, so they are unique across splits and labels
    assert train["review_id"].tolist() == [f"train/{LABEL_DIRS[lab]}/{i}"
                                           for lab, i in zip(raw["label"], raw["review_id"], strict=True)]
    assert set(splits["unsupervised"]["label"]) == {-1}
    assert splits["unsupervised"]["review_id"][0].startswith("unsupervised/unsup/")


def test_missing_rating_and_review_id(tmp_path: Path) -> None:
    for split in ("train", "test"):
        make_split(12, seed=4)[["text", "label"]].to_parquet(tmp_path / f"{split}.parquet")
    test = load_imdb(str(tmp_path), None, ["test"])["test"]
    assert set(test["rating"]) == {0}
    assert test["review_id"].tolist()[:3] == ["test/neg/0", "test/pos/1", "test/neg/2"]  # the row in the file
    assert load_imdb(str(tmp_path), None, ["test"])["test"]["review_id"].tolist() == test["review_id"].tolist()


@pytest.mark.parametrize(("name", "naming"), [("imdb.csv", "text/label"), ("imdb.csv", "review/sentiment"),
                                              ("imdb-semicolon.csv", "review/sentiment"),
                                              ("imdb.jsonl", "text/label"), ("imdb.parquet", "text/label")])
def test_one_file_source(tmp_path: Path, name: str, naming: str) -> None:
    frame = make_split(80, seed=5)[["text", "label"]]
    to_disk = kaggle_naming if naming == "review/sentiment" else (lambda f: f)
    splits = load_imdb(str(write_table(to_disk(frame), tmp_path / name)), None, ["train", "test"])
    together = pd.concat([splits["train"], splits["test"]])
    assert sorted(together["text"]) == sorted(frame["text"])
    assert dict(zip(together["text"], together["label"], strict=True)) == dict(
        zip(frame["text"], frame["label"], strict=True))
    assert 20 <= len(splits["test"]) <= 60 and set(together["rating"]) == {0}
    # ids are the row in the file; a review's side depends on its text alone, not on the other rows
    row = {t: i for i, t in enumerate(frame["text"])}
    assert all(rid.endswith(f"/{row[t]}") for t, rid in zip(together["text"], together["review_id"], strict=True))
    more = pd.concat([make_split(30, seed=9)[["text", "label"]], frame.iloc[::-1]], ignore_index=True)
    grown = load_imdb(str(write_table(to_disk(more), tmp_path / f"more{Path(name).suffix}")), None, ["test"])["test"]
    assert set(splits["test"]["text"]) == set(grown["text"]) & set(frame["text"])


def test_one_file_split_column(tmp_path: Path) -> None:
    frame = pd.concat([make_split(10, seed=1).assign(split="train"), make_split(5, seed=2).assign(split="test"),
                       make_split(4, seed=3, labelled=False).assign(split="unsupervised")], ignore_index=True)
    splits = load_imdb(str(write_table(frame, tmp_path / "imdb.csv")), None, ["train", "test", "unsupervised"])
    assert [len(splits[s]) for s in ("train", "test", "unsupervised")] == [10, 5, 4]
    assert splits["test"]["text"].tolist() == frame["text"][10:15].tolist()
    assert splits["test"]["review_id"][0] == f"test/neg/{frame['review_id'][10]}"


@pytest.mark.parametrize("parent", [False, True])
def test_aclimdb_folder(tmp_path: Path, parent: bool) -> None:
    frames = {"train": make_split(30, seed=1), "test": make_split(20, seed=2),
              "unsupervised": make_split(6, seed=3, labelled=False)}
    root = write_aclimdb(tmp_path / "aclImdb", frames)
    splits = load_imdb(str(tmp_path if parent else root), None, ["train", "test", "unsupervised"])
    for name, frame in frames.items():
        by_text = frame.set_index("text")
        got = splits[name].set_index("text")
        assert sorted(got.index) == sorted(by_text.index)
        assert (got["rating"] == by_text.loc[got.index, "rating"]).all()
        assert (got["label"] == by_text.loc[got.index, "label"]).all()
    positive = frames["test"].index[frames["test"]["label"] == 1][0]
    assert f"test/pos/{positive}" in set(splits["test"]["review_id"])


def test_hub_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hub path with the download replaced by a local DatasetDict (no network here)."""
    import datasets

    calls = []

    def fake_load_dataset(source: str, revision: str | None = None) -> datasets.DatasetDict:
        calls.append((source, revision))
        return datasets.DatasetDict({s: datasets.Dataset.from_pandas(make_split(8, seed=i)[["text", "label"]])
                                     for i, s in enumerate(("train", "test"))})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(data, "unreachable_hub_id", lambda value, repo_type: None)  # as if the Hub had it
    splits = load_imdb("someone/imdb", "v1.0", ["train", "test"])
    assert calls == [("someone/imdb", "v1.0")]
    assert splits["test"]["text"].tolist() == make_split(8, seed=1)["text"].tolist()
    assert splits["train"]["review_id"][1] == "train/pos/1"
    with pytest.raises(DataError, match=r"^data.source: Hub dataset 'someone/imdb' has no split 'unsupervised' "
                                        r"\(it has: train, test\)$"):
        load_imdb("someone/imdb", None, ["unsupervised"])


# --- the filter --------------------------------------------------------------------------------------------------


def test_filter_keeps_exactly_the_long_reviews(imdb_dir: Path) -> None:
    train = load_imdb(str(imdb_dir), None, ["train"])["train"]
    for min_chars in (0, 200, 400):
        kept = filter_reviews(train, min_chars, "x")
        assert kept["review_id"].tolist() == [r for r, t in zip(train["review_id"], train["text"], strict=True)
                                              if len(t) > min_chars]
    assert 0 < len(filter_reviews(train, 200, "x")) < len(train)


def test_nothing_left_after_filter(imdb_dir: Path) -> None:
    train = load_imdb(str(imdb_dir), None, ["train"])["train"]
    longest = train["text"].str.len().max()
    with pytest.raises(DataError, match=rf"^x: no review is longer than prepare.min_review_chars=100000 characters "
                                        rf"\(longest of 200: {longest}\)$"):
        filter_reviews(train, 100_000, "x")


# --- bad data ----------------------------------------------------------------------------------------------------


def split_folder(tmp_path: Path, train: pd.DataFrame, test: pd.DataFrame | None = None) -> Path:
    train.to_parquet(tmp_path / "train.parquet")
    (test if test is not None else make_split(10, seed=2)).to_parquet(tmp_path / "test.parquet")
    return tmp_path


def with_value(column: str, row: int, value: object) -> pd.DataFrame:
    """make_split(10) with one cell changed; a string goes into a column of strings (Parquet keeps one type)."""
    frame = make_split(10, seed=1)
    if isinstance(value, str):
        frame[column] = frame[column].astype(str)
    frame.loc[row, column] = value
    return frame


@pytest.mark.parametrize(("frame", "message"), [
    (make_split(10, seed=1).drop(columns="label"),
     r"train.parquet: missing column 'label' \(columns: text, rating, review_id; expected text/label or "
     r"review/sentiment\)$"),
    (make_split(10, seed=1).drop(columns="text"), r"train.parquet: missing column 'text'"),
    (with_value("label", 3, 2), r"train.parquet: row 3: label 2 is not one of \[0, 1\] or positive/negative "
                                r"\(1 such rows\)$"),
    (with_value("label", 4, -1), r"train.parquet: row 4: label -1 is not one of \[0, 1\]"),
    (with_value("label", 2, "meh"), r"train.parquet: row 2: label 'meh' is not one of"),
    (with_value("text", 5, None), r"train.parquet: row 5: text is missing or not a string \(nan\)$"),
    (with_value("rating", 1, "nine"), r"train.parquet: row 1: rating 'nine' is not a number$"),
    (with_value("review_id", 4, "r1_2"), r"train.parquet: row 4: review_id 'r1_2' appears twice among the neg "
                                         r"reviews$"),
    (make_split(10, seed=1).iloc[:0], r"train.parquet: no rows$"),
])
def test_bad_parquet_split(tmp_path: Path, frame: pd.DataFrame, message: str) -> None:
    source = split_folder(tmp_path, frame)
    assert re.search(f"^{re.escape(str(source))}/{message}", error(source))


def test_unsupervised_labels(tmp_path: Path) -> None:
    make_split(6, seed=3, labelled=False).to_parquet(tmp_path / "unsupervised.parquet")
    assert set(load_imdb(str(tmp_path), None, ["unsupervised"])["unsupervised"]["label"]) == {-1}
    with_value("label", 2, 7).to_parquet(tmp_path / "unsupervised.parquet")
    assert "unsupervised.parquet: row 2: label 7 is not one of [-1, 0, 1]" in error(tmp_path, ("unsupervised",))


def test_folder_without_train_parquet(tmp_path: Path) -> None:
    make_split(10, seed=1).to_parquet(tmp_path / "test.parquet")
    assert error(tmp_path).startswith(f"{tmp_path}: no train.parquet (a Parquet source folder holds train.parquet, "
                                      "test.parquet and optionally unsupervised.parquet;")


def test_unreadable_parquet(tmp_path: Path) -> None:
    (tmp_path / "train.parquet").write_bytes(b"not parquet at all")
    assert error(tmp_path).startswith(f"{tmp_path}/train.parquet: unreadable Parquet file: ")


@pytest.mark.parametrize("source", ["./nowhere/imdb", "data/raw/missing", "imdb.csv"])
def test_missing_local_source(source: str) -> None:
    assert error(source) == f"{source}: no such file or folder"


def test_unknown_split(imdb_dir: Path) -> None:
    assert error(imdb_dir, ("validation",)) == "unknown split 'validation' (known: train, test, unsupervised)"


@pytest.mark.parametrize(("name", "content", "message"), [
    ("imdb.csv", "text,label\ncaf\xe9 au lait,1\n".encode("latin-1"), r"imdb.csv: not UTF-8 text \(invalid "
                                                                     r"continuation byte\)$"),
    ("imdb.csv", b"", r"imdb.csv: unreadable CSV: No columns to parse from file$"),
    ("imdb.csv", b"review,stars\nok,9\n", r"imdb.csv: missing column 'label' \(columns: review, stars;"),
    ("imdb.csv", b"text,label,split\na,1,train\nb,0,dev\n", r"imdb.csv: row 1: split 'dev' is not one of "
                                                            r"train, test, unsupervised$"),
    ("imdb.csv", b"text,label,split\na,1,train\nb,0,train\n", r"imdb.csv: no 'test' rows \(a one-file source "
                                                              r"gets its splits from its split column\)$"),
    ("imdb.txt", b"text,label\n", r"imdb.txt: not a .csv, .jsonl or .parquet file"),
])
def test_bad_one_file_source(tmp_path: Path, name: str, content: bytes, message: str) -> None:
    (tmp_path / name).write_bytes(content)
    assert re.search(f"^{re.escape(str(tmp_path))}/{message}", error(tmp_path / name))


def test_one_file_without_unsupervised(tmp_path: Path) -> None:
    path = write_table(make_split(10, seed=1), tmp_path / "imdb.csv")
    assert error(path, ("unsupervised",)) == (f"{path}: no 'unsupervised' rows (a one-file source gets its splits "
                                              "from a split column (without one: half train, half test))")


def test_bad_aclimdb(tmp_path: Path) -> None:
    root = write_aclimdb(tmp_path / "aclImdb", {"train": make_split(6, seed=1)})
    assert error(root) == f"{root}: no reviews for split 'test' (expected test/pos and test/neg/*.txt)"
    write_aclimdb(root, {"test": make_split(6, seed=2)})
    (root / "test/pos/7_x.txt").write_text("a review", encoding="utf-8")
    assert error(root) == f"{root}/test/pos/7_x.txt: name is not <id>_<rating>.txt"
    (root / "test/pos/7_x.txt").unlink()
    (root / "test/neg/8_2.txt").write_bytes("na\xefve".encode("latin-1"))
    assert error(root) == f"{root}/test/neg/8_2.txt: not UTF-8 text (invalid continuation byte at byte 2)"


# --- DVC tracking --------------------------------------------------------------------------------------------------


def test_warn_if_untracked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data/raw/imdb").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    with caplog.at_level(logging.WARNING):
        for path in ("data/raw/imdb", "./data/raw/imdb", str(tmp_path / "data/raw/imdb"), "stanfordnlp/imdb"):
            warn_if_untracked(path, "data.source")
        assert caplog.messages == []
        warn_if_untracked("elsewhere", "data.source")
    assert caplog.messages == ["data.source: elsewhere is outside data/raw/, so editing it will not rerun prepare "
                               "(copy it under data/raw/)"]
