"""prepare: every source format, the filter, prompt lengths, pairs, bad data, atomic outputs, DVC caching."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import dvc, make_split, set_params

from stages.core.data import filter_reviews, load_imdb
from stages.core.errors import DataError
from stages.core.modeling import load_tokenizer
from stages.core.params import ModelParams
from stages.core.tokenization import build_pairs, build_prompts, read_pairs_file, tokenize


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path):
    return load_tokenizer(str(tokenizer_dir), ModelParams())


def write_aclimdb(root: Path, frames: dict[str, pd.DataFrame]) -> Path:
    for split, frame in frames.items():
        for i, row in frame.iterrows():
            sub = {1: f"{split}/pos", 0: f"{split}/neg", -1: "train/unsup"}[row["label"]]
            (root / sub).mkdir(parents=True, exist_ok=True)
            (root / sub / f"{i}_{row['rating']}.txt").write_text(row["text"], encoding="utf-8")
    return root


# --- sources -----------------------------------------------------------------------------------------------------


def test_parquet_folder(imdb_dir: Path) -> None:
    splits = load_imdb(str(imdb_dir), None, ["train", "test", "unsupervised"])
    assert list(splits["train"].columns) == ["text", "label", "rating", "review_id"]
    expected = pd.read_parquet(imdb_dir / "train.parquet")
    assert splits["train"]["text"].tolist() == expected["text"].tolist()
    assert set(splits["unsupervised"]["label"]) == {-1}


@pytest.mark.parametrize("naming", ["text/label", "review/sentiment"])
def test_csv(tmp_path: Path, naming: str) -> None:
    frame = make_split(60, seed=5)
    if naming == "review/sentiment":
        frame = frame.rename(columns={"text": "review", "label": "sentiment"})
        frame["sentiment"] = frame["sentiment"].map({1: "positive", 0: "negative"})
    frame[["review" if "review" in frame else "text", "sentiment" if "sentiment" in frame else "label"]].to_csv(
        tmp_path / "imdb.csv", index=False)
    splits = load_imdb(str(tmp_path / "imdb.csv"), None, ["train", "test"])
    together = pd.concat([splits["train"], splits["test"]])
    assert sorted(together["text"]) == sorted(make_split(60, seed=5)["text"])
    assert 0 < len(splits["test"]) < 60
    assert set(together["label"]) == {0, 1} and set(together["rating"]) == {0}
    # the train/test cut does not depend on anything but the file
    again = load_imdb(str(tmp_path / "imdb.csv"), None, ["train", "test"])
    assert again["test"]["text"].tolist() == splits["test"]["text"].tolist()


def test_csv_split_column(tmp_path: Path) -> None:
    frame = make_split(20, seed=5)
    frame["split"] = ["test" if i < 5 else "train" for i in range(20)]
    frame.to_csv(tmp_path / "imdb.csv", index=False)
    assert len(load_imdb(str(tmp_path / "imdb.csv"), None, ["test"])["test"]) == 5


def test_aclimdb_folder(tmp_path: Path) -> None:
    frames = {"train": make_split(30, seed=1), "test": make_split(20, seed=2)}
    root = write_aclimdb(tmp_path / "aclImdb", frames)
    splits = load_imdb(str(root), None, ["train", "test"])
    assert sorted(splits["train"]["text"]) == sorted(frames["train"]["text"])
    by_text = dict(zip(frames["test"]["text"], frames["test"]["rating"], strict=True))
    assert all(by_text[t] == r for t, r in zip(splits["test"]["text"], splits["test"]["rating"], strict=True))


# --- bad data ----------------------------------------------------------------------------------------------------


def test_missing_column(tmp_path: Path) -> None:
    make_split(10, seed=1).drop(columns="label").to_parquet(tmp_path / "train.parquet")
    with pytest.raises(DataError, match=rf"^{tmp_path} \[train\]: missing column 'label' \(columns: text, rating, "):
        load_imdb(str(tmp_path), None, ["train"])


def test_missing_split_file(tmp_path: Path) -> None:
    make_split(10, seed=1).to_parquet(tmp_path / "train.parquet")
    with pytest.raises(DataError, match=r"test.parquet: missing \(a Parquet source folder needs test.parquet\)"):
        load_imdb(str(tmp_path), None, ["train", "test"])


def test_labels_outside_0_1(tmp_path: Path) -> None:
    frame = make_split(10, seed=1)
    frame.loc[3, "label"] = 2
    frame.to_parquet(tmp_path / "train.parquet")
    with pytest.raises(DataError, match=r"\[train\]: label 2 outside \[0, 1\] \(1 rows\)"):
        load_imdb(str(tmp_path), None, ["train"])


def test_non_utf8_csv(tmp_path: Path) -> None:
    (tmp_path / "imdb.csv").write_bytes("text,label\ncaf\xe9 au lait,1\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"imdb.csv: not UTF-8 text"):
        load_imdb(str(tmp_path / "imdb.csv"), None, ["train"])


def test_unreadable_parquet(tmp_path: Path) -> None:
    (tmp_path / "train.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"train.parquet: unreadable Parquet file"):
        load_imdb(str(tmp_path), None, ["train"])


def test_nothing_left_after_filter(imdb_dir: Path) -> None:
    train = load_imdb(str(imdb_dir), None, ["train"])["train"]
    with pytest.raises(DataError, match=r"^x: no review is longer than prepare.min_review_chars=100000 characters$"):
        filter_reviews(train, 100_000, "x")


# --- prompts and pairs -------------------------------------------------------------------------------------------


def test_filter_keeps_exactly_the_long_reviews(imdb_dir: Path) -> None:
    train = load_imdb(str(imdb_dir), None, ["train"])["train"]
    kept = filter_reviews(train, 200, "x")
    assert kept["review_id"].tolist() == [r for r, t in zip(train["review_id"], train["text"], strict=True)
                                          if len(t) > 200]
    assert 0 < len(kept) < len(train)


def test_prompt_lengths(imdb_dir: Path, tokenizer) -> None:
    reviews = filter_reviews(load_imdb(str(imdb_dir), None, ["train"])["train"], 200, "x")
    ids = tokenize(reviews["text"], tokenizer)

    def prompts(seed: int):
        return build_prompts(reviews, ids, tokenizer, None, 2, 8, np.random.default_rng(seed)).to_pandas()

    table = prompts(0)
    lengths = table["input_ids"].map(len)
    assert set(lengths) == set(range(2, 9))  # every length in [2, 8] drawn, none outside
    for row, prefix in zip(ids, table["input_ids"], strict=True):
        assert list(prefix) == row[: len(prefix)]
    assert table["query"].tolist() == tokenizer.batch_decode([list(p) for p in table["input_ids"]])
    assert prompts(0)["input_ids"].map(list).tolist() == table["input_ids"].map(list).tolist()
    assert prompts(1)["input_ids"].map(len).tolist() != lengths.tolist()


def test_pairs(imdb_dir: Path, tokenizer) -> None:
    reviews = filter_reviews(load_imdb(str(imdb_dir), None, ["train"])["train"], 200, "x")
    ids = tokenize(reviews["text"], tokenizer)
    pairs = build_pairs(reviews, ids, tokenizer, 50, 4, 6, False, np.random.default_rng(0), "x").to_pandas()
    label = dict(zip(reviews["review_id"], reviews["label"], strict=True))
    assert len(pairs) == 50
    assert all(label[c] == 1 and label[r] == 0 for c, r in zip(pairs["chosen_id"], pairs["rejected_id"], strict=True))
    lengths = [len(tokenizer(t, add_special_tokens=False).input_ids) for t in pairs["chosen"]]
    assert min(lengths) >= 3 and max(lengths) <= 7  # a decoded cut may re-tokenize one token differently


def test_pairs_by_rating(imdb_dir: Path, tokenizer) -> None:
    reviews = filter_reviews(load_imdb(str(imdb_dir), None, ["train"])["train"], 200, "x")
    ids = tokenize(reviews["text"], tokenizer)
    pairs = build_pairs(reviews, ids, tokenizer, 40, 4, 6, True, np.random.default_rng(0), "x").to_pandas()
    assert (pairs["chosen_rating"] > pairs["rejected_rating"]).all()


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_pairs_file_passthrough(tmp_path: Path, suffix: str) -> None:
    frame = pd.DataFrame({"chosen": [f"good {i}" for i in range(40)], "rejected": [f"bad {i}" for i in range(40)]})
    path = tmp_path / f"pairs{suffix}"
    frame.to_parquet(path) if suffix == ".parquet" else frame.to_json(path, orient="records", lines=True)
    tables = read_pairs_file(path, np.random.default_rng(0))
    together = pd.concat([tables["train"].to_pandas(), tables["test"].to_pandas()])
    assert sorted(together["chosen"]) == sorted(frame["chosen"]) and tables["test"].num_rows > 0


@pytest.mark.parametrize(("frame", "message"), [
    (pd.DataFrame({"chosen": ["a"], "other": ["b"]}), r"missing column 'rejected'"),
    (pd.DataFrame({"chosen": ["a", "b"], "rejected": ["b", " "]}), r"column 'rejected' has an empty or non-text "
                                                                  r"value in row 1"),
    (pd.DataFrame({"chosen": pd.Series([], dtype=str), "rejected": pd.Series([], dtype=str)}), r"no pairs"),
])
def test_bad_pairs_file(tmp_path: Path, frame: pd.DataFrame, message: str) -> None:
    frame.to_parquet(tmp_path / "pairs.parquet")
    with pytest.raises(DataError, match=message):
        read_pairs_file(tmp_path / "pairs.parquet", np.random.default_rng(0))


# --- the stage ---------------------------------------------------------------------------------------------------


def configure(project: Path, imdb_dir: Path, tokenizer_dir: Path, **extra: object) -> None:
    set_params(project, **{"data.source": str(imdb_dir), "model.tokenizer": str(tokenizer_dir),
                           "prepare.eval_prompts": 20, "prepare.train_pairs": 30, "prepare.test_pairs": 10, **extra})


def run_prepare(project: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stages.prepare"], cwd=project, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(project)})


def test_stage_outputs(project: Path, imdb_dir: Path, tokenizer_dir: Path) -> None:
    configure(project, imdb_dir, tokenizer_dir)
    result = run_prepare(project)
    assert result.returncode == 0, result.stderr
    train = pq.read_table(project / "data/prompts/train.parquet")
    assert train.schema.field("input_ids").type.value_type.bit_width == 32
    n_long = sum(len(t) > 200 for t in pd.read_parquet(imdb_dir / "train.parquet")["text"])
    assert train.num_rows == n_long
    assert pq.read_table(project / "data/prompts/eval.parquet").num_rows == 20
    test_ids = set(pd.read_parquet(imdb_dir / "test.parquet")["review_id"])
    pairs_test = pd.read_parquet(project / "data/pairs/test.parquet")
    assert len(pairs_test) == 10 and set(pairs_test["chosen_id"]) <= test_ids
    metrics = yaml.safe_load((project / "metrics/prepare.json").read_text())
    assert metrics["prompts"] == {"train": n_long, "eval": 20}


def test_failed_run_leaves_previous_outputs(project: Path, imdb_dir: Path, tokenizer_dir: Path,
                                            tmp_path: Path) -> None:
    configure(project, imdb_dir, tokenizer_dir)
    assert run_prepare(project).returncode == 0
    before = (project / "data/prompts/train.parquet").read_bytes()
    bad = tmp_path / "bad"
    bad.mkdir()
    make_split(10, seed=1).to_parquet(bad / "train.parquet")  # no test split
    set_params(project, **{"data.source": str(bad)})
    result = run_prepare(project)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {bad}/test.parquet: missing")
    assert (project / "data/prompts/train.parquet").read_bytes() == before
    assert not [p for p in (project / "data").rglob("*.tmp")]


def test_dvc_repro_caches_and_ignores_ppo_params(project: Path, imdb_dir: Path, tokenizer_dir: Path) -> None:
    raw = project / "data/raw/imdb"
    raw.parent.mkdir(parents=True, exist_ok=True)
    import shutil

    shutil.copytree(imdb_dir, raw)
    configure(project, Path("data/raw/imdb"), tokenizer_dir)
    dvc(project, "repro", "prepare")
    assert (project / "data/pairs/train.parquet").exists()
    assert "didn't change, skipping" in dvc(project, "repro", "prepare").stdout
    set_params(project, **{"ppo.init_kl_coef": 0.05, "evaluate.batch_size": 3})
    assert "prepare" not in dvc(project, "status", "prepare").stdout
    frame = pd.read_parquet(raw / "train.parquet")
    frame.loc[1, "text"] = frame.loc[1, "text"] + " An edited review that is now surely long enough to pass. " * 5
    frame.to_parquet(raw / "train.parquet")
    assert "changed deps" in dvc(project, "status", "prepare").stdout


@pytest.mark.slow
def test_real_imdb_gives_24895_train_prompts(shared_dir: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(shared_dir / "gpt2-tokenizer"), ModelParams())
    train = filter_reviews(load_imdb(str(shared_dir / "imdb"), None, ["train"])["train"], 200, "x")
    assert len(train) == 24_895
    ids = tokenize(train["text"], tokenizer)
    prompts = build_prompts(train, ids, tokenizer, None, 2, 8, np.random.default_rng(0))
    assert prompts.num_rows == 24_895

