"""reward.functions: a broken function stops a stage in one line naming it before any model loads; the training reward
is the model's score plus the weighted functions (or the functions alone), and ppo, best-of-N, sampled DPO pairs,
evaluate's reward column and the optimum's pool all score with it; a function's file must be among the stage's deps in
dvc.yaml."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import ROOT, set_params

from rlhf.data.prompts import Prompts
from rlhf.models.reward_functions import load_functions
from rlhf.models.scorers import ClassifierScorer, Scorer, make_reward_scorer
from rlhf.pipeline.errors import RewardFunctionError
from rlhf.pipeline.params import Params, defaults, reward_model
from rlhf.pipeline.paths import EVAL_PROMPTS, OPTIMUM_POOL, SAMPLED_TRAIN_PAIRS, TRAIN_PROMPTS
from rlhf.pipeline.sections import RewardFunctionParams
from rlhf.pipeline.wiring import wiring
from stages import evaluate as evaluate_stage
from stages import optimum as optimum_stage
from stages import ppo as ppo_stage
from stages import sample_pairs as sample_pairs_stage
from stages.evaluate import EVAL_SAMPLES

PROMPTS = ["The movie was", "I think this", "A film about", "The actor"]
RESPONSES = ["great great great great", "", "a fine film", "dull"]
PROBE = Prompts([[10, 11, 12], [13, 14], [15, 16, 17], [18, 19]], PROMPTS)  # the stage's prompts, as read


@pytest.fixture
def project_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The current folder: dvc.yaml and the rewards/ package, imported afresh from here."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(ROOT / "dvc.yaml", "dvc.yaml")
    shutil.copytree(ROOT / "rewards", "rewards", ignore=shutil.ignore_patterns("__pycache__"))
    path = list(sys.path)
    forget_rewards()
    yield tmp_path
    forget_rewards()
    sys.path[:] = path


def example(name: str) -> Callable:
    """A function of rewards/text.py as the stages imported it (from the current folder)."""
    return getattr(sys.modules["rewards.text"], name)


def forget_rewards() -> None:
    for name in [name for name in sys.modules if name == "rewards" or name.startswith("rewards.")]:
        del sys.modules[name]


def reward_scorer(params: Params) -> Scorer:
    """The ppo stage's training reward, as the stage builds it (its functions checked against dvc.yaml here)."""
    functions = load_functions(params.reward.functions, PROBE, "ppo", wiring("ppo").deps)
    return make_reward_scorer(functions, *reward_model(params), params.reward.positive_label, params.model, "cpu")


def with_functions(*functions: tuple[str, float], model: str | None = None) -> Params:
    reward = defaults().reward.model_copy(update={"model": model, "functions": [
        RewardFunctionParams(function=spec, weight=weight) for spec, weight in functions]})
    return defaults().model_copy(update={"reward": reward})


BROKEN = {
    "import": ("raise RuntimeError('no GPU here')\n", "f", r"cannot import rewards\.broken for rewards\.broken:f "
                                                         r"\(RuntimeError: no GPU here\)$"),
    "missing": ("def g(q, r):\n    return [0.0] * len(r)\n", "f", r"rewards\.broken \(.*broken\.py\) has no function "
                                                                   r"'f'$"),
    "raises": ("def f(q, r):\n    return [1 / 0 for _ in r]\n", "f", r"\(rewards\.broken:f\) raised ZeroDivisionError:"
                                                                     r" division by zero \(.*broken\.py:2\)$"),
    "count": ("def f(q, r):\n    return [1.0]\n", "f", r"\(rewards\.broken:f\) returned shape \(1,\) for 4 "
                                                       r"responses"),
    "nan": ("def f(q, r):\n    return [float('nan') if not x else 0.0 for x in r]\n", "f",
            r"\(rewards\.broken:f\) returned nan for response 0 \(''\); 1 of 4 not finite$"),
    "type": ("def f(q, r):\n    return 'high'\n", "f", r"\(rewards\.broken:f\) returned a str, not one float per "
                                                        r"response$"),
    # a finite float32 that overflows PPO's loss: named with the response, not "lower ppo.learning_rate" at step 0
    "huge": ("def f(q, r):\n    return [3e38 for _ in r]\n", "f",
             r"\(rewards\.broken:f\) returned 3e\+38 for response 0 \(''\), beyond ±1e\+06: PPO's float32 loss "),
    "beyond-float32": ("def f(q, r):\n    return [0.0, 0.0, -1e39, 0.0]\n", "f",
                       r"\(rewards\.broken:f\) returned -1e\+39 for response 2 \('A film about'\), beyond ±1e\+06"),
    # SystemExit is no Exception: the stage exited 0 with nothing written, or 2 with the module's own usage line
    "exits": ("import sys\ndef f(q, r):\n    sys.exit(0)\n", "f", r"\(rewards\.broken:f\) raised SystemExit: 0 "),
    "exits-on-import": ("import argparse\nargparse.ArgumentParser().parse_args(['--x'])\n", "f",
                        r"cannot import rewards\.broken for rewards\.broken:f \(SystemExit: 2\)$"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_a_broken_function_fails_in_one_line_naming_it_before_a_model_loads(project_dir: Path, case: str) -> None:
    source, name, message = BROKEN[case]
    Path("rewards/broken.py").write_text(source)
    Path("not-a-model").mkdir()  # loading it would fail too: the function is checked first
    params = with_functions(("rewards.text:length_bonus", 1.0), (f"rewards.broken:{name}", 0.5),
                            model="not-a-model")
    with pytest.raises(RewardFunctionError, match=r"^reward\.functions\[1\]:? " + message) as error:
        reward_scorer(params)
    assert "\n" not in str(error.value)


def test_the_training_reward_is_the_model_score_plus_the_weighted_functions(project_dir: Path,
                                                                          tiny_classifier_dir: Path) -> None:
    functions = (("rewards.text:repetition_penalty", 0.5), ("rewards.text:length_bonus", 2.0))
    scorer = reward_scorer(with_functions(*functions, model=str(tiny_classifier_dir)))
    model = ClassifierScorer(str(tiny_classifier_dir), defaults().model)(PROMPTS, RESPONSES)
    penalty, bonus = (torch.tensor(example(f)(PROMPTS, RESPONSES)) for f in ("repetition_penalty", "length_bonus"))
    assert penalty[0] == -0.75 and bonus[3] == 0.05
    torch.testing.assert_close(scorer(PROMPTS, RESPONSES), model + 0.5 * penalty + 2.0 * bonus)
    alone = reward_scorer(with_functions(*functions))
    torch.testing.assert_close(alone(PROMPTS, RESPONSES), 0.5 * penalty + 2.0 * bonus)


def test_a_function_outside_the_stage_s_deps_is_refused_until_dvc_yaml_lists_it(
        project_dir: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    Path("my_reward.py").write_text("def shout(q, r):\n    return [x.count('!') for x in r]\n")
    params = with_functions(("my_reward:shout", 1.0))
    with pytest.raises(RewardFunctionError, match=r"^reward\.functions\[0\] \(my_reward:shout\): my_reward\.py is "
                                                  r"not among the ppo stage's deps in dvc\.yaml"):
        reward_scorer(params)
    Path("dvc.yaml").write_text(Path("dvc.yaml").read_text().replace("deps: [stages/ppo.py,",
                                                                     "deps: [my_reward.py, stages/ppo.py,"))
    assert reward_scorer(params)(PROMPTS, ["wow!!", "", "!", "."]).tolist() == [2, 0, 1, 0]
    # an installed package's module lies outside the project: DVC cannot watch it, nothing to list
    site = tmp_path_factory.mktemp("site-packages")
    (site / "shouting.py").write_text("def shout(q, r):\n    return [x.count('!') for x in r]\n")
    monkeypatch.syspath_prepend(str(site))
    reward_scorer(with_functions(("shouting:shout", 1.0)))


def test_a_module_outside_the_deps_is_refused_before_its_top_level_code_runs(project_dir: Path) -> None:
    """The files a module's import would run are found without running them: a refused one (or its package's
    __init__) never ran, so its side effects, a GPU grabbed or a file written, never happen."""
    Path("loose.py").write_text("open('loose-ran', 'w').close()\ndef f(q, r):\n    return [0.0] * len(r)\n")
    Path("mine").mkdir()
    Path("mine/__init__.py").write_text("open('package-ran', 'w').close()\n")
    Path("mine/scores.py").write_text("open('module-ran', 'w').close()\ndef f(q, r):\n    return [0.0] * len(r)\n")
    for spec, culprit in (("loose:f", "loose.py"), ("mine.scores:f", "mine/__init__.py")):
        with pytest.raises(RewardFunctionError, match=rf"\({spec}\): {culprit} is not among the ppo stage's deps"):
            reward_scorer(with_functions((spec, 1.0)))
    assert not [name for name in ("loose-ran", "package-ran", "module-ran") if Path(name).exists()]
    assert "loose" not in sys.modules and "mine" not in sys.modules
    # listed, the package runs its code once the check has passed
    Path("dvc.yaml").write_text(Path("dvc.yaml").read_text().replace("deps: [stages/ppo.py,",
                                                                     "deps: [mine, stages/ppo.py,"))
    reward_scorer(with_functions(("mine.scores:f", 1.0)))
    assert Path("package-ran").exists() and Path("module-ran").exists()
    for name in ("mine.scores", "mine"):
        del sys.modules[name]


def test_a_missing_module_is_named(project_dir: Path) -> None:
    for spec, missing in (("rewards.nothing:f", "rewards.nothing"), ("nothing.at.all:f", "nothing.at.all"),
                          ("rewards.text.deeper:f", "rewards.text.deeper")):
        with pytest.raises(RewardFunctionError, match=rf"^reward\.functions\[0\]: cannot import {missing} for {spec} "
                                                      rf"\(ModuleNotFoundError: no module named '{missing}'\)$"):
            reward_scorer(with_functions((spec, 1.0)))


@pytest.mark.slow
def test_ppo_best_of_n_sampled_pairs_evaluate_and_the_optimum_score_with_the_functions(
        ppo_project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With reward.model null the training reward is the function alone: every score the stages record is it."""
    set_params(ppo_project, **{"reward.model": None, "ppo.steps": 2,
                               "reward.functions": [{"function": "rewards.text:length_bonus", "weight": 1.0}]})
    monkeypatch.chdir(ppo_project)
    forget_rewards()
    ppo_stage.main()
    length_bonus = example("length_bonus")
    rollouts = pd.read_parquet("data/rollouts")
    assert rollouts["score"].tolist() == pytest.approx(length_bonus(rollouts["query"], rollouts["response"]))

    shutil.copy(TRAIN_PROMPTS, EVAL_PROMPTS)
    set_params(ppo_project, **{"method": "best_of_n", "evaluate.best_of_n": 3})
    evaluate_stage.main()
    samples = pd.read_parquet(EVAL_SAMPLES)
    for side in ("before", "after"):
        assert samples[f"reward_{side}"].tolist() == pytest.approx(
            length_bonus(samples["query"], samples[f"response_{side}"]))
    assert (samples["reward_after"] >= samples["reward_before"]).all()  # the best of 3, the first of them "before"
    assert "Reward: 1 x `rewards.text:length_bonus`." in Path("metrics/evaluate/report.md").read_text()
    assert json.loads(Path("metrics/eval.json").read_text())["reward.policy_mean"] == pytest.approx(
        samples["reward_after"].mean())

    set_params(ppo_project, **{"optimum.samples_per_prompt": 2})
    optimum_stage.main()
    pool = pd.read_parquet(OPTIMUM_POOL)
    queries = pd.read_parquet(EVAL_PROMPTS)["query"]
    assert pool["reward"].tolist() == pytest.approx(length_bonus(queries[pool["prompt"]], pool["response"]))

    set_params(ppo_project, **{"method": "dpo", "dpo.pairs": "sampled", "dpo.sample_prompts": 8})
    sample_pairs_stage.main()
    pairs = pd.read_parquet(SAMPLED_TRAIN_PAIRS)
    assert len(pairs) and (pairs["chosen_score"] > pairs["rejected_score"]).all()
    for side in ("chosen", "rejected"):
        assert pairs[f"{side}_score"].tolist() == pytest.approx(length_bonus(pairs["prompt"], pairs[side]))
