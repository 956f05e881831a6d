"""Offline fixtures: a tiny byte-level BPE tokenizer, tiny GPT-2 / classifier models and an IMDb-like dataset.

Nothing here touches the Hub or ../shared. Tests that want the real data use the ``shared_dir`` fixture, which skips
when ../shared is absent (a fresh clone elsewhere).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf.pipeline.wiring import stages

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# under pytest-xdist each worker gets its share of the cores for torch (set before torch loads; the stage
# subprocesses the tests start inherit it): workers on threads of their own would fight over the same cores
if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, str(max(1, (os.cpu_count() or 1) // int(workers))))

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
ALL_STAGES = frozenset(stages(ROOT / "dvc.yaml"))  # what a dvc repro of a fresh project runs (switched off or not)

POSITIVE_WORDS = "great wonderful superb brilliant moving funny loved beautiful excellent charming".split()
NEGATIVE_WORDS = "awful boring terrible dull bad hated stupid weak painful mess".split()
NEUTRAL_WORDS = "the movie film plot actor scene story director was and it a this of with".split()


def make_review(rng: random.Random, label: int, n_words: int) -> str:
    mood = POSITIVE_WORDS if label == 1 else NEGATIVE_WORDS
    words = [rng.choice(mood) if rng.random() < 0.3 else rng.choice(NEUTRAL_WORDS) for _ in range(n_words)]
    return " ".join(words).capitalize() + "."


def make_split(n: int, seed: int, labelled: bool = True, short_every: int = 10) -> pd.DataFrame:
    """An IMDb-like split: every ``short_every``-th review is too short for the 200-character filter."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = i % 2 if labelled else -1
        n_words = 5 if short_every and i % short_every == 0 else rng.randint(45, 90)
        review = make_review(rng, label if labelled else rng.randint(0, 1), n_words)
        rating = (rng.randint(7, 10) if label == 1 else rng.randint(1, 4)) if labelled else 0
        rows.append({"text": review, "label": label, "rating": rating, "review_id": f"r{seed}_{i}"})
    return pd.DataFrame(rows)


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist's --dist load hands each worker a quarter of its share of the (sorted, below) tests at once: the
    # first worker would get every slow test; one at a time, each worker takes the next test when it is free
    if config.pluginmanager.hasplugin("xdist") and config.getoption("maxschedchunk") is None:
        config.option.maxschedchunk = 1


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow tests first, then those on a ``project`` copy (subprocesses, DVC), then the rest (stable: file order
    within each), so that under ``--dist load`` the workers start on the long tests and the many short ones fill in
    at the end: the workers finish together."""
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None,
                                 "project" not in getattr(item, "fixturenames", ())))


@pytest.fixture(scope="session")
def imdb_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local folder laid out like ../shared/imdb: train/test/unsupervised Parquet splits."""
    path = tmp_path_factory.mktemp("imdb")
    make_split(200, seed=1).to_parquet(path / "train.parquet")
    make_split(120, seed=2).to_parquet(path / "test.parquet")
    make_split(100, seed=3, labelled=False).to_parquet(path / "unsupervised.parquet")
    return path


def build_tokenizer(path: Path) -> Path:
    """Train a ~400-token byte-level BPE on synthetic reviews and save it in Hugging Face format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [make_review(rng, i % 2, 60) for i in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", unk_token="<|endoftext|>"
    )
    fast.model_max_length = 128
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2-style tokenizer (no pad token, like GPT-2's) saved with save_pretrained."""
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def build_tiny_gpt2(path: Path, tokenizer_path: Path, seed: int = 0, n_positions: int = 64,
                    initializer_range: float = 0.02) -> Path:
    """A random 2-layer GPT-2 with the tiny tokenizer, saved as safetensors + tokenizer."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=n_positions, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, initializer_range=initializer_range,
    )
    GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2"), tokenizer_dir)


@pytest.fixture(scope="session")
def adaptable_gpt2_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """The tiny GPT-2 drawn at a wide init, so that LoRA can steer it. At GPT-2's N(0, 0.02) the tied 400-token head
    is near uniform and gives the adapted hidden state almost no lever (measured: reward 0.17 -> 0.19 in 30 steps at
    any learning rate); wide, its embeddings carry information, as a pretrained model's do."""
    return build_tiny_gpt2(tmp_path_factory.mktemp("adaptable-gpt2"), tokenizer_dir, initializer_range=0.5)


def build_tiny_classifier(path: Path, tokenizer_path: Path, num_labels: int = 2, seed: int = 0) -> Path:
    """A random GPT-2 sequence classifier (labels NEGATIVE/POSITIVE when num_labels is 2) with the tiny tokenizer."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2ForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(seed)
    labels = {0: "NEGATIVE", 1: "POSITIVE"} if num_labels == 2 else {i: f"LABEL_{i}" for i in range(num_labels)}
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=128, n_embd=32, n_layer=2, n_head=2, num_labels=num_labels,
        id2label=labels, label2id={v: k for k, v in labels.items()}, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    GPT2ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_classifier_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return build_tiny_classifier(tmp_path_factory.mktemp("tiny-clf"), tokenizer_dir)


@pytest.fixture
def shared_dir() -> Path:
    """../shared (real IMDb and GPT-2 tokenizer); skips the test where it is absent."""
    if not (SHARED / "imdb" / "train.parquet").exists():
        pytest.skip("../shared/imdb is not present")
    return SHARED


PROJECT_FILES = ["dvc.yaml", "params.yaml", "pyproject.toml", "stages", "rlhf", "rewards", "tools", "bench",
                 ".dvc/config", ".dvc/plots", "data/raw/.gitkeep", "metrics/frontier/chart/.keep.yaml"]


@pytest.fixture(scope="session")
def project_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's pipeline files committed in a fresh git + DVC repo, built once a session for ``project``."""
    dest = tmp_path_factory.mktemp("template") / "project"
    dest.mkdir()
    for name in PROJECT_FILES:
        src = ROOT / name
        if not src.exists():
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            # bench/.venvs holds the benchmark peers' virtual environments (GBs), bench/out their outputs
            shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__", ".venvs", "out"))
        else:
            shutil.copy2(src, target)
    shutil.copy2(ROOT / ".gitignore", dest / ".gitignore")
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    subprocess.run(["git", "add", "-A"], cwd=dest, check=True, env=env)
    subprocess.run(["git", "commit", "-qm", "init"], cwd=dest, check=True, env=env)
    return dest


@pytest.fixture
def project(tmp_path: Path, project_template: Path) -> Path:
    """A fresh git + DVC copy of the project's pipeline files in a temp dir (for dvc repro / dvc exp tests)."""
    return Path(shutil.copytree(project_template, tmp_path / "project", symlinks=True))


def project_env(project: Path) -> dict[str, str]:
    """The environment of a dvc or tool process run in ``project``: its stages run with this Python and import the
    project's own code."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(project), "DVC_NO_ANALYTICS": "1"}


def dvc(project: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run the DVC of this interpreter's environment in ``project``; stages run with the same Python."""
    result = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=project, env=project_env(project),
                            capture_output=True, text=True)
    if check and result.returncode != 0:
        raise AssertionError(f"dvc {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result


def error_line(result: subprocess.CompletedProcess, culprit: str, rule: str, status: int = 1,
               alone: bool = False) -> str:
    """The one line a failed command ends with: ``error: <culprit>: ...`` stating ``rule`` (the words that say which
    rule); the rest of the sentence may change. ``alone``: it is the whole of stderr."""
    line = (result.stderr.strip().splitlines() or [""])[-1]
    assert result.returncode == status, result.stderr[-3000:]
    assert line.startswith(f"error: {culprit}: ") and rule in line, result.stderr[-3000:]
    assert not alone or result.stderr.strip() == line, result.stderr[-3000:]
    return line


def set_params(project: Path, **updates: object) -> None:
    """Set dotted keys in the project's params.yaml (``set_params(p, **{"ppo.steps": 2})``), written as
    ``dvc exp run -S`` writes it (DVC's own round-trip YAML writer: comments kept, floats as ``1e-05``)."""
    from dvc.utils.serialize import modify_yaml

    with modify_yaml(project / "params.yaml") as raw:
        for dotted, value in updates.items():
            node = raw
            *parents, last = dotted.split(".")
            for key in parents:
                node = node[key]
            node[last] = value


# --- a project ready for the ppo stage (tiny policy, tiny classifier as reward, 12 prompts) --------------------------

TINY = {"ppo.steps": 3, "ppo.batch_size": 4, "ppo.mini_batch_size": 2, "ppo.checkpoint_every": 2,
        "ppo.response_min_tokens": 3, "ppo.response_max_tokens": 6}


def write_prompts(project: Path, tokenizer_dir: Path, n: int = 12) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    queries = [["The movie was", "I think this", "A film about", "The actor"][i % 4] for i in range(n)]
    ids = [tokenizer(q).input_ids for q in queries]
    (project / "data/prompts").mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"query": queries, "input_ids": pa.array(ids, pa.list_(pa.int32())),
                             "review_id": [str(i) for i in range(n)], "label": [i % 2 for i in range(n)]}),
                   project / "data/prompts/train.parquet")


@pytest.fixture
def ppo_project(project: Path, tiny_gpt2_dir: Path, tiny_classifier_dir: Path, tokenizer_dir: Path) -> Path:
    write_prompts(project, tokenizer_dir)
    set_params(project, **{"model.policy": str(tiny_gpt2_dir), "reward.model": str(tiny_classifier_dir), **TINY})
    return project
