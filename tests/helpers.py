"""Helpers that several test modules share (conftest.py holds the fixtures and the tiny-model builders).

Test modules import from here or from conftest, never from one another.
"""

from __future__ import annotations

import contextlib
import functools
import json
import locale
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import set_params

from rlhf.models.loading import load_causal_lm, load_tokenizer
from rlhf.models.lora import add_lora
from rlhf.models.policy import PolicyWithValueHead, disable_dropout
from rlhf.pipeline.params import defaults
from rlhf.pipeline.wiring import wiring
from rlhf.train.ppo_trainer import PPOTrainer, Rollout

# read at run time, not at import: a zygote serves runs that differ in these alone (pytest sets the second per test)
PER_RUN = {"PYTHONPATH", "PYTEST_CURRENT_TEST"}


@functools.cache
def zygote(environment: tuple[tuple[str, str], ...]) -> subprocess.Popen:
    """tests/zygote.py in ``environment``, its libraries imported, for the rest of this test process."""
    errors = tempfile.TemporaryFile()  # noqa: SIM115 (open while the zygote lives; a pipe nobody read could fill)
    server = subprocess.Popen([sys.executable, str(Path(__file__).parent / "zygote.py")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=errors, text=True, env=dict(environment))
    if server.stdout.readline() != "ready\n":
        errors.seek(0)
        raise RuntimeError(f"tests/zygote.py failed to start:\n{errors.read().decode(errors='replace')}")
    return server


def run(project: Path, *command: str) -> subprocess.CompletedProcess:
    """Run ``command`` (default: the ppo stage) in ``project`` with its own ``stages`` package. This Python's runs
    are forked from tests/zygote.py, libraries already imported; any other command (torchrun) runs afresh."""
    command = list(command or (sys.executable, "-m", "stages.ppo"))
    env = {**os.environ, "PYTHONPATH": str(project)}
    if command[0] != sys.executable:
        return subprocess.run(command, cwd=project, capture_output=True, text=True, env=env)
    server = zygote(tuple(sorted((key, value) for key, value in env.items() if key not in PER_RUN)))
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder, "out"), Path(folder, "err")
        request = {"argv": command[1:], "cwd": str(project), "env": env, "out": str(out), "err": str(err)}
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        status = server.stdout.readline()
        if not status:
            raise RuntimeError("tests/zygote.py ended before its child did")
        # as subprocess.run(text=True) reads them: the locale's encoding, universal newlines
        stdout, stderr = (path.read_bytes().decode(locale.getpreferredencoding(False)).replace("\r\n", "\n")
                          .replace("\r", "\n") for path in (out, err))
    return subprocess.CompletedProcess(command, int(status), stdout, stderr)


def ran_stages(result: subprocess.CompletedProcess) -> set[str]:
    """The stages a ``dvc repro`` / ``dvc exp run`` ran."""
    return set(re.findall(r"Running stage '(\w+)'", result.stdout + result.stderr))


def run_cli(project: Path, stage: str) -> subprocess.CompletedProcess:
    """``python -m stages.<stage>`` in ``project``."""
    return run(project, sys.executable, "-m", f"stages.{stage}")


# sft and reward on a tiny model: ~40 steps each with a checkpoint every 5
SHAPE = {"sft.n_layer": 1, "sft.n_embd": 32, "sft.n_head": 2, "sft.n_positions": 64, "sft.block_size": 32}
TRAINING = {
    "sft": SHAPE | {"sft.enabled": True, "sft.batch_size": 8, "sft.max_tokens": 8 * 32 * 40,
                    "sft.eval_reviews": 8, "sft.warmup_steps": 10, "sft.checkpoint_every": 5},
    "reward": SHAPE | {"reward.train": True, "reward.base": "scratch", "reward.batch_size": 8, "reward.epochs": 2,
                       "reward.max_length": 16, "reward.checkpoint_every": 5},
}


def training_project(project: Path, stage: str, imdb_dir: Path, tokenizer_dir: Path) -> None:
    """``project`` set up for the tiny ``TRAINING[stage]`` run (sft or reward): the local IMDb, the tokenizer, sft's
    token ids (the tokenize stage's) and 320 train / 16 test pairs (2 epochs x 40 reward steps)."""
    set_params(project, **{"data.source": str(imdb_dir), "model.tokenizer": str(tokenizer_dir), **TRAINING[stage]})
    if stage == "sft":
        result = run_cli(project, "tokenize")
        assert result.returncode == 0, result.stderr
    (project / "data/pairs").mkdir(parents=True, exist_ok=True)
    signal_pairs(320, 0).to_parquet(project / "data/pairs/train.parquet")
    signal_pairs(16, 1).to_parquet(project / "data/pairs/test.parquet")


def write_pool(project: Path) -> None:
    """An optimum pool on 2 eval prompts (the train prompts' first two), 4 samples each, and the params that make the
    ppo stage probe it: the curve's objective share needs one beta (a fixed kl_coef)."""
    import pyarrow.parquet as pq

    prompts = project / "data/prompts"
    pq.write_table(pq.read_table(prompts / "train.parquet"), prompts / "eval.parquet")
    (project / "data/optimum").mkdir(parents=True, exist_ok=True)
    rewards = [0.1, -0.4, 0.9, 0.2, -1.0, 0.5, 0.3, 0.0]  # 2 prompts x 4 samples
    pd.DataFrame({"prompt": [0] * 4 + [1] * 4, "sample": list(range(4)) * 2, "reward": rewards}).to_parquet(
        project / "data/optimum/pool.parquet")
    set_params(project, **{"optimum.samples_per_prompt": 4, "ppo.adap_kl_ctrl": False})


def snapshot(project: Path, stage: str) -> dict[str, bytes]:
    """The bytes of every file of ``stage``'s outputs (dvc.yaml's) in ``project``."""
    files = {}
    for output in wiring(stage, project / "dvc.yaml").outputs:
        path = project / output
        for file in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
            files[file.relative_to(project).as_posix()] = file.read_bytes()
    return files


def leftovers(project: Path, stage: str) -> list[str]:
    """Staging folders, moved-aside outputs and temporaries next to ``stage``'s outputs (a finished run, failed or
    not, leaves none)."""
    return sorted(item.relative_to(project).as_posix() for output in wiring(stage, project / "dvc.yaml").outputs
                  if (project / output.parent).is_dir()
                  for item in (project / output.parent).iterdir() if item.name.startswith(f".{output.name}."))


def signal_pairs(n: int, seed: int) -> pd.DataFrame:
    """Pairs with an obvious signal: chosen texts say 'great', rejected ones 'awful'."""
    g = torch.Generator().manual_seed(seed)
    filler = ["the movie", "a plot", "this film was", "the actor", "it is"]
    pick = torch.randint(len(filler), (n, 2), generator=g).tolist()
    return pd.DataFrame({"chosen": [f"{filler[a]} great {filler[b]}" for a, b in pick],
                         "rejected": [f"{filler[a]} awful {filler[b]}" for a, b in pick],
                         "chosen_rating": 8, "rejected_rating": 2})


def eos_only_gpt2(source: Path, path: Path) -> Path:
    """A copy of the tiny GPT-2 ``source`` that answers EOS at once, always: its last layer norm outputs a constant
    along EOS's embedding (tied to the LM head), scaled so that EOS's logit leads the others by tens of nats."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lm = AutoModelForCausalLM.from_pretrained(source)
    eos = lm.config.eos_token_id
    with torch.no_grad():
        direction = lm.transformer.wte.weight[eos]
        lm.transformer.ln_f.weight.zero_()
        lm.transformer.ln_f.bias.copy_(direction * 100 / direction.square().sum())
    lm.save_pretrained(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return path


# --- PPOTrainer on a tiny GPT-2 with a synthetic reward ----------------------------------------------------------

QUERIES = ["The movie was", "I think", "This film", "A story of", "The actor", "What a", "It was a", "My favourite"]


class TokenShareScorer:
    """Share of response tokens whose id is below ``cutoff``: a reward the policy can only get by changing."""

    name = "token_share"

    def __init__(self, tokenizer, cutoff: int) -> None:
        self.tokenizer, self.cutoff = tokenizer, cutoff

    def __call__(self, queries: list[str], responses: list[str], response_ids: object = None) -> torch.Tensor:
        shares = []
        for text in responses:
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
            shares.append(sum(i < self.cutoff for i in ids) / max(len(ids), 1))
        return torch.tensor(shares, dtype=torch.float32)


@contextlib.contextmanager
def interrupted_at_call(owner: object, name: str, n: int) -> Iterator[None]:
    """Inside the block ``owner.name`` raises KeyboardInterrupt (a Ctrl-C) on its ``n``-th call."""
    real, calls = getattr(owner, name), 0

    def interrupting(*args: object, **kwargs: object) -> object:
        nonlocal calls
        calls += 1
        if calls == n:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    setattr(owner, name, interrupting)
    try:
        yield
    finally:
        setattr(owner, name, real)


def projections(n_layer: int = 2, suffix: str = "") -> set[str]:
    """The names of a GPT-2's attention and MLP projections (LoRA's default targets), each + ``suffix``."""
    return {f"transformer.h.{i}.{proj}{suffix}" for i in range(n_layer)
            for proj in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}


def moved_weights(trained: torch.nn.Module, initial: torch.nn.Module) -> set[str]:
    """The names of the weights that differ between two models of one architecture."""
    before = initial.state_dict()
    return {name for name, weight in trained.state_dict().items() if not torch.equal(weight, before[name])}


def make_trainer(tiny_gpt2_dir: Path, scorer_cls: type = TokenShareScorer, precision: str = "auto", lora_r: int = 0,
                 device: str = "cpu", **overrides: object) -> PPOTrainer:
    """A PPOTrainer on the tiny GPT-2 (dropout off) on ``device`` with a scorer of ``scorer_cls``; ``overrides`` are
    ppo.* params. ``lora_r`` > 0: the policy trains rank-``lora_r`` adapters and the reference is it with them off."""
    torch.manual_seed(0)
    settings = dict(batch_size=16, mini_batch_size=8, ppo_epochs=4, learning_rate=3e-3, adap_kl_ctrl=False,
                    init_kl_coef=0.01, response_min_tokens=4, response_max_tokens=8)
    cfg = defaults().ppo.model_copy(update=settings | overrides)
    tokenizer = load_tokenizer(str(tiny_gpt2_dir), defaults().model)
    lm = load_causal_lm(str(tiny_gpt2_dir), defaults().model)
    if lora_r:
        add_lora(lm, defaults().model.lora.model_copy(update={"r": lora_r}))
        ref = None
    else:
        ref = load_causal_lm(str(tiny_gpt2_dir), defaults().model)
        disable_dropout(ref)
    disable_dropout(lm)
    scorer = scorer_cls(tokenizer, cutoff=len(tokenizer) // 4)
    policy = PolicyWithValueHead(lm, cfg.critic).to(device)
    return PPOTrainer(policy, ref if ref is None else ref.to(device), tokenizer, scorer, cfg, torch.device(device),
                      precision)


def batch(trainer: PPOTrainer, n: int | None = None) -> tuple[list[list[int]], list[str]]:
    """``n`` prompts (default: the ppo.prompts_per_step of one step; token ids, texts) cycling through QUERIES."""
    queries = [QUERIES[i % len(QUERIES)] for i in range(n or trainer.cfg.prompts_per_step)]
    return [trainer.tokenizer(q).input_ids for q in queries], queries


def make_rollout(trainer: PPOTrainer, query_ids: list[list[int]], queries: list[str]) -> Rollout:
    """Steps 1-5 of an iteration (generate, score, make the experience), as ``PPOTrainer.step`` runs them."""
    samples, queries, responses = trainer.generate(query_ids, queries)
    return trainer.make_experience(samples, queries, responses, trainer.score(samples, queries, responses, step=0))


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")
"""The tensor methods that copy a value to the host, each waiting for the device to finish the work queued before."""


def count_host_reads(monkeypatch: pytest.MonkeyPatch, callers_under: Path | None = None) -> Counter:
    """From now on, how often each of HOST_READS is called (calling through to torch's own); ``callers_under``: only
    the calls made by code in that folder."""
    counts: Counter = Counter()

    def counting(name: str):
        method = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args, **kwargs):
            if callers_under is None or Path(sys._getframe(1).f_code.co_filename).is_relative_to(callers_under):
                counts[name] += 1
            return method(self, *args, **kwargs)

        return counted

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    return counts


def add_plot_columns(columns: dict[str, list[str]], plot: dict) -> None:
    """Add the files a top-level dvc.yaml plot reads to ``columns`` ({file: its columns, x first}, over several plots:
    some read one file). An x read from a file of its own is matched row for row by a ``step`` column in every file."""
    x = plot["x"]
    if isinstance(x, dict):
        ((name, field),) = x.items()
        names = columns.setdefault(name, ["step"])
        names += [field] if field not in names else []
        x = "step"
    for name, fields in plot["y"].items():
        names = columns.setdefault(name, [x])
        names += [f for f in ([fields] if isinstance(fields, str) else fields) if f not in names]
