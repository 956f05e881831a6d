"""One rule for local path vs Hub id, used by every loader; dvc.yaml names no path that stages/core/paths.py lacks."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import ROOT

from stages.core import paths
from stages.core.data import load_imdb
from stages.core.errors import DataError, ModelError
from stages.core.modeling import load_causal_lm, load_tokenizer
from stages.core.params import ModelParams


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
        load_causal_lm("mydir/sub/model", ModelParams(), what="sft.base")
    with pytest.raises(ModelError, match=r"^model.tokenizer: mydir/sub/tok: no such directory$"):
        load_tokenizer("mydir/sub/tok", ModelParams())
    with pytest.raises(DataError, match=r"^mydir/sub/imdb: no such file or folder$"):
        load_imdb("mydir/sub/imdb", None, ["train"])


def dvc_paths() -> set[str]:
    """Every data, model and metrics path the stages of dvc.yaml depend on or write (code aside)."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    names: set[str] = set()
    for stage in stages.values():
        for section in ("deps", "outs", "metrics", "plots"):
            for entry in stage.get(section, []):
                names |= set(entry) if isinstance(entry, dict) else {entry}
    return {name for name in names if not name.startswith("stages/")}


def test_dvc_yaml_names_only_paths_of_the_paths_module() -> None:
    known = {value.as_posix() for value in vars(paths).values() if isinstance(value, Path)}
    assert dvc_paths() - known == set()
