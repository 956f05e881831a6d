"""One rule for local path vs Hub id, used by every loader."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from rlhf.data.imdb import load_imdb
from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.pipeline import paths
from rlhf.pipeline.errors import DataError, ModelError
from rlhf.pipeline.params import defaults


@pytest.mark.parametrize("value", ["./model", "/abs/model", "~/model", "mydir/sub/model", "reviews.parquet",
                                   "reviews.CSV", "pairs.jsonl", "data/raw/imdb"])
def test_path_syntax_is_local(value: str) -> None:
    assert paths.is_local(value)


@pytest.mark.parametrize("value", ["gpt2", "lvwerra/gpt2-imdb", "EleutherAI/gpt-neo-1.3B", "stanfordnlp/imdb"])
def test_hub_ids_are_not_local(value: str) -> None:
    assert not paths.is_local(value)


def test_an_existing_folder_is_local_whatever_its_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert not paths.is_local("org/model")
    (tmp_path / "org/model").mkdir(parents=True)
    assert paths.is_local("org/model")


def test_loaders_agree_a_missing_local_path_is_local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing path-like value fails as a missing local path in every loader, never as a Hub download."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match=r"^sft.base: mydir/sub/model: no such directory$"):
        load_causal_lm("mydir/sub/model", defaults().model, what="sft.base")
    with pytest.raises(ModelError, match=r"^model.tokenizer: mydir/sub/tok: no such directory$"):
        load_tokenizer("mydir/sub/tok", defaults().model)
    with pytest.raises(DataError, match=r"^mydir/sub/imdb: no such file or folder$"):
        load_imdb("mydir/sub/imdb", None, ["train"])



def test_a_missing_path_read_as_a_hub_id_fails_in_one_line_naming_the_key(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``data/imdb`` is a Hub id by its syntax: when no such folder exists, one request (here: offline mode, as the
    tests run) says it cannot be had, rather than the loaders' retries and their tracebacks."""
    monkeypatch.chdir(tmp_path)
    unreachable = r"no such local path, and not reachable as a Hub id \(HF_HUB_OFFLINE is set"
    with pytest.raises(DataError, match=rf"^data.source: data/imdb: {unreachable}.*; without the Hub, the offline "
                                        r"recipe trains its own models: python -m tools.recipe offline-cpu --imdb"):
        load_imdb("data/imdb", None, ["train"])
    with pytest.raises(ModelError, match=rf"^model.policy: models/nope: {unreachable}"):
        load_causal_lm("models/nope", defaults().model, what="model.policy")
    with pytest.raises(ModelError, match=rf"^model.tokenizer: models/tok: {unreachable}"):
        load_tokenizer("models/tok", defaults().model)


def test_an_unreachable_hub_is_asked_once(tmp_path: Path) -> None:
    """Online, with nothing listening at the Hub's address: the first refused connection is the answer."""
    code = "from rlhf.models.hub import unreachable_hub_id; print(unreachable_hub_id('data/imdb', 'dataset'))"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env={
        **os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9",
        "HF_HUB_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("cannot reach the Hub: "), result.stdout
    assert "python -m tools.recipe offline-cpu" in result.stdout
