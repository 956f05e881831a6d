"""reward.functions written for TRL's GRPO/RLOO trainers work here unchanged: a function whose signature names
``prompts``, ``completions`` or ``completion_ids`` (or takes only ``**kwargs``) is called by keyword with the prompt
texts, the response texts and the responses' token ids; ours, ``f(queries, responses)``, keep their positional call;
a signature that fits both conventions or neither is refused at load, in one line naming the function."""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import ROOT, set_params, write_prompts

from rlhf.data.prompts import Prompts
from rlhf.models.reward_functions import load_functions
from rlhf.models.scorers import Scorer, make_reward_scorer
from rlhf.pipeline.errors import RewardFunctionError
from rlhf.pipeline.params import defaults
from rlhf.pipeline.sections import RewardFunctionParams
from rlhf.pipeline.wiring import wiring
from stages import ppo as ppo_stage

# TRL's documented examples, as a TRL user brings them: `reward_len` from TRL's GRPO quick start, verbatim;
# `format_reward_func` from the GRPO trainer's docs ("Example 2"), the one line that reads a conversational
# completion (`completion[0]["content"]`) read as the standard, text format we sample in (TRL's docs: "For standard
# format, prompts and completions will be lists of strings"); `token_count` is the docs' "Example 1" with the keyword
# TRL's trainer passes (`completion_ids`).
TRL_EXAMPLES = '''import re


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def token_count(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]


def prompt_minus_completion(completions, prompts):
    """No **kwargs, the parameters out of ours' order: only a call by keyword gets this right."""
    return [len(p) - len(c) for p, c in zip(prompts, completions)]


def ours(queries, responses):
    return [len(q) - len(r) for q, r in zip(queries, responses)]
'''

PROMPTS = ["The movie was", "I think this", "A film about", "The actor"]
PROBE = Prompts([[10, 11, 12], [13, 14], [15, 16, 17], [18, 19]], PROMPTS)
RESPONSES = ["<think>a</think><answer>b</answer>", "", " a fine film, truly great", " dull"]
RESPONSE_IDS = [[5, 6, 7, 8, 9], [0], [1, 2, 3, 4], [7, 0]]


@pytest.fixture
def project_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The current folder: dvc.yaml and rewards/ with TRL's examples, imported afresh from here."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(ROOT / "dvc.yaml", "dvc.yaml")
    shutil.copytree(ROOT / "rewards", "rewards", ignore=shutil.ignore_patterns("__pycache__"))
    Path("rewards/trl_examples.py").write_text(TRL_EXAMPLES)
    path = list(sys.path)
    forget_rewards()
    yield tmp_path
    forget_rewards()
    sys.path[:] = path


def forget_rewards() -> None:
    for name in [name for name in sys.modules if name == "rewards" or name.startswith("rewards.")]:
        del sys.modules[name]


def reward_of(*functions: tuple[str, float]) -> Scorer:
    """The ppo stage's reward with ``functions`` alone (reward.model null), loaded as the stage loads it."""
    specs = [RewardFunctionParams(function=spec, weight=weight) for spec, weight in functions]
    loaded = load_functions(specs, PROBE, "ppo", wiring("ppo").deps)
    return make_reward_scorer(loaded, None, "reward.model", "POSITIVE", defaults().model, "cpu")


def score(spec: str) -> list[float]:
    return reward_of((spec, 1.0))(PROMPTS, RESPONSES, RESPONSE_IDS).tolist()


def test_trl_functions_get_prompts_completions_and_token_ids_by_keyword(project_dir: Path) -> None:
    assert score("rewards.trl_examples:reward_len") == [-abs(20 - len(r)) for r in RESPONSES]
    assert score("rewards.trl_examples:format_reward_func") == [1.0, 0.0, 0.0, 0.0]
    assert score("rewards.trl_examples:token_count") == [5.0, 1.0, 4.0, 2.0]
    differences = [len(p) - len(r) for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    assert score("rewards.trl_examples:prompt_minus_completion") == differences
    assert score("rewards.trl_examples:ours") == differences
    assert score("rewards.text:length_bonus") == pytest.approx([0.05, 0.0, 0.25, 0.05])


def test_the_probe_passes_each_response_s_token_ids(project_dir: Path) -> None:
    """At load each function is called on the first prompts, answered by an empty response and by the other
    prompts: their token ids go with them (an empty response has none)."""
    Path("rewards/spy.py").write_text("CALLS = []\ndef f(completions, completion_ids, **kwargs):\n"
                                      "    CALLS.append((completions, completion_ids))\n"
                                      "    return [0.0] * len(completions)\n")
    reward_of(("rewards.spy:f", 1.0))
    assert sys.modules["rewards.spy"].CALLS == [(["", "The actor", "A film about", "I think this"],
                                                 [[], [18, 19], [15, 16, 17], [13, 14]])]


REFUSED = {
    "both": ("def f(*args, **kwargs):\n    return [0.0]\n", r"\(\*args, \*\*kwargs\) is neither ours.*: name its "
                                                           r"parameters one way$"),
    "mixed": ("def f(queries, completions):\n    return [0.0]\n",
              r"\(queries, completions\) is neither ours.*: it also requires queries, "),
    "dataset-column": ("def f(completions, ground_truth, **kwargs):\n    return [0.0]\n",
                       r"\(completions, ground_truth, \*\*kwargs\) is neither ours.*requires ground_truth, which is "
                       r"no keyword TRL's convention gives here \(dataset columns are not passed\)$"),
    "neither": ("def f(text):\n    return [0.0]\n", r"\(text\) is neither ours, f\(queries, responses\), nor TRL's, "
                                                    r"f\(prompts=\.\.\., completions=\.\.\., completion_ids=\.\.\., "
                                                    r"\*\*kwargs\)$"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_signature_that_fits_both_conventions_or_neither_is_refused_in_one_line(project_dir: Path,
                                                                                 case: str) -> None:
    source, message = REFUSED[case]
    Path("rewards/odd.py").write_text(source)
    with pytest.raises(RewardFunctionError, match=r"^reward\.functions\[0\] \(rewards\.odd:f\): the signature "
                                                  + message) as error:
        reward_of(("rewards.odd:f", 1.0))
    assert "\n" not in str(error.value)


def test_an_async_trl_function_is_awaited(project_dir: Path) -> None:
    Path("rewards/remote.py").write_text("import asyncio\nasync def f(prompts, completions, **kwargs):\n"
                                         "    await asyncio.sleep(0)\n"
                                         "    return [1.0 if c else 0.0 for c in completions]\n")
    assert score("rewards.remote:f") == [1.0, 0.0, 1.0, 1.0]


@pytest.mark.slow
def test_ppo_learns_from_trl_s_example_functions(ppo_project: Path, tokenizer_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The ppo stage trains against TRL's examples alone (reward.model null): every logged score is their sum on the
    logged response and its token count, and the reward goes up."""
    write_prompts(ppo_project, tokenizer_dir, n=32)
    (ppo_project / "rewards/trl_examples.py").write_text(TRL_EXAMPLES)
    functions = [{"function": f"rewards.trl_examples:{name}", "weight": weight}
                 for name, weight in (("reward_len", 1.0), ("format_reward_func", 1.0), ("token_count", 0.5))]
    set_params(ppo_project, **{"reward.model": None, "reward.functions": functions, "ppo.steps": 40,
                               "ppo.batch_size": 32, "ppo.mini_batch_size": 8, "ppo.learning_rate": 3e-3,
                               "ppo.adap_kl_ctrl": False, "ppo.init_kl_coef": 0.01, "ppo.checkpoint_every": 0,
                               "ppo.response_min_tokens": 4, "ppo.response_max_tokens": 8})
    monkeypatch.chdir(ppo_project)
    forget_rewards()
    ppo_stage.main()
    rollouts = pd.read_parquet("data/rollouts")
    examples = sys.modules["rewards.trl_examples"]
    expected = (torch.tensor(examples.reward_len(rollouts["response"]), dtype=torch.float32)
                + torch.tensor(examples.format_reward_func(rollouts["response"]))
                + 0.5 * torch.tensor(rollouts["response_length"].tolist(), dtype=torch.float32))
    torch.testing.assert_close(torch.tensor(rollouts["score"].tolist()), expected)
    # the stage's use of the machine lands beside its curves and in its metrics (rlhf/train/system_use.py)
    system = pd.read_csv("metrics/ppo/system.csv")
    assert len(system) and (system["cpu"] > 0).any() and (system["ram_gb"] > 0).all()
    assert (system["cpu"] <= os.cpu_count()).all()  # cores, not a percentage
    assert system["gpu_busy"].isna().all()  # no GPU here
    assert json.loads(Path("metrics/ppo.json").read_text())["ppo"]["system"]["cpu_cores"] > 0
    by_step = rollouts.groupby("step")["score"].mean()
    # reward_len dominates: about -5 at first. With batches of 16 the gain was +1.2 to +3.0 over six seeds, and
    # +0.99 on one CI machine at seed 0 (CPUs round apart); with 32, +2.1 to +3.0 (EPYC-BF16)
    first, last = by_step.iloc[:10].mean(), by_step.iloc[-10:].mean()
    assert last > first + 1, by_step.round(2).tolist()
