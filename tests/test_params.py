"""params.yaml -> typed config: every key documented, the stages' reads, and every validation rule failing with a
message naming its key."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from rlhf.pipeline.errors import ParamsError
from rlhf.pipeline.params import defaults, load_params, parse_params, stage_params
from rlhf.pipeline.registry import stage, stage_names
from rlhf.pipeline.schema import params_model
from rlhf.pipeline.sections import declaration, dotted_keys
from rlhf.pipeline.yaml_files import read_yaml
from rlhf.rl.estimators import ESTIMATORS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def raw() -> dict:
    return read_yaml(ROOT / "params.yaml")


def with_value(raw: dict, dotted: str, value: object) -> dict:
    raw = copy.deepcopy(raw)
    node = raw
    *parents, last = dotted.split(".")
    for key in parents:
        node = node[key]
    node[last] = value
    return raw


def test_classic_recipe_defaults() -> None:
    p = defaults()
    assert (p.data.source, p.model.policy, p.reward.model) == (
        "stanfordnlp/imdb", "lvwerra/gpt2-imdb", "lvwerra/distilbert-imdb")
    assert (p.prepare.min_review_chars, p.prepare.prompt_min_tokens, p.prepare.prompt_max_tokens) == (200, 2, 8)
    assert (p.ppo.learning_rate, p.ppo.batch_size, p.ppo.mini_batch_size, p.ppo.ppo_epochs, p.ppo.steps) == (
        1.41e-5, 128, 128, 4, 194)
    assert (p.ppo.init_kl_coef, p.ppo.target, p.ppo.horizon, p.ppo.gamma, p.ppo.lam) == (0.2, 6.0, 10000.0, 1.0, 0.95)


def test_every_key_is_documented() -> None:
    undocumented = [key for key in dotted_keys(params_model()) if not declaration(params_model(), key).description]
    assert not undocumented


def test_stage_params_are_json_ready_and_honour_exclude() -> None:
    p = defaults()
    ppo = stage_params(p, "ppo", exclude=("ppo.nan_policy",))
    assert json.loads(json.dumps(ppo)) == ppo
    assert ppo["prepare.prompt_max_tokens"] == 8 and ppo["model.precision"] == "auto" and ppo["ppo.steps"] == 194
    assert "ppo.nan_policy" not in ppo and "ppo.checkpoint_every" in ppo and "reward.base" not in ppo
    keys = dotted_keys(params_model())
    assert set(stage_params(p, "sft")) == {"seed", *(k for k in keys if k.startswith(("data.", "model.", "sft.")))}


def test_ppo_params_are_read_only_by_ppo_and_evaluate() -> None:
    """...and by sample_pairs, for the sampling settings only: sampled pairs are what the initial policy writes when
    sampled as ppo and evaluate sample."""
    readers = {name for name in stage_names() for k in stage(name).params if k == "ppo" or k.startswith("ppo.")}
    assert readers == {"ppo", "evaluate", "sample_pairs"}
    sampling = {"ppo.response_min_tokens", "ppo.response_max_tokens", "ppo.top_k", "ppo.top_p", "ppo.temperature"}
    assert {k for k in stage("sample_pairs").params if k.startswith("ppo.")} == sampling
    assert not any(k.startswith("ppo") or k == "evaluate" for k in stage("prepare").params)


def test_every_entry_a_stage_reads_is_a_param() -> None:
    sections = set(params_model().model_fields)
    for name in stage_names():
        for entry in stage(name).params:
            assert entry in dotted_keys(params_model()) or entry in sections, f"stage {name}: {entry} is no param"


@pytest.mark.parametrize(
    ("dotted", "value", "message"),
    [
        ("ppo.batch_size", -4, "params.yaml: ppo.batch_size: must be > 0 (got -4)"),
        ("ppo.batch_size", "many", "params.yaml: ppo.batch_size: must be an integer (got 'many')"),
        ("ppo.learning_rate", True, "params.yaml: ppo.learning_rate: must be a number (got True)"),
        ("ppo.adap_kl_ctrl", "yes", "params.yaml: ppo.adap_kl_ctrl: must be a bool (got 'yes')"),
        ("ppo.kl_penalty", "kk", "params.yaml: ppo.kl_penalty: must be one of kl, abs, mse, full, k3 (got 'kk')"),
        ("ppo.gamma", 1.5, "params.yaml: ppo.gamma: must be in [0, 1] (got 1.5)"),
        ("ppo.top_p", 0.0, "params.yaml: ppo.top_p: must be in (0, 1] (got 0.0)"),
        ("ppo.batch_size", 100, "params.yaml: ppo.batch_size: must be a multiple of ppo.mini_batch_size x "
                                "ppo.gradient_accumulation_steps (128) (got 100)"),
        ("ppo.response_min_tokens", 20, "params.yaml: ppo.response_min_tokens: must be <= ppo.response_max_tokens "
                                        "(16) (got 20)"),
        ("prepare.prompt_min_tokens", 9, "params.yaml: prepare.prompt_min_tokens: must be <= "
                                         "prepare.prompt_max_tokens (8) (got 9)"),
        ("prepare.eval_prompts", 0, "params.yaml: prepare.eval_prompts: must be > 0 (got 0)"),
        ("prepare.pairs_source", "pairs.txt", "params.yaml: prepare.pairs_source: must be 'imdb' or a local "
                                              ".parquet/.jsonl file (got 'pairs.txt')"),
        ("data.source", "./no/such/folder", "params.yaml: data.source: local path does not exist "
                                            "(got './no/such/folder')"),
        ("model.tokenizer", "../no-such-tokenizer", "params.yaml: model.tokenizer: local path does not exist "
                                                    "(got '../no-such-tokenizer')"),
        ("sft.n_embd", 100, "params.yaml: sft.n_embd: must be divisible by sft.n_head (6) (got 100)"),
        ("sft.block_size", 512, "params.yaml: sft.block_size: must be <= sft.n_positions (256) (got 512)"),
        ("sft.splits", ["train", "test"], "params.yaml: sft.splits: must not contain 'test' (held out for "
                                          "perplexity) (got ['train', 'test'])"),
        ("sft.splits", "train", "params.yaml: sft.splits: must be a list of str (got 'train')"),
        ("evaluate.judges", ["vader", 3], "params.yaml: evaluate.judges[1]: must be a str (got 3)"),
        ("seed", -1, "params.yaml: seed: must be >= 0 (got -1)"),
    ],
)
def test_each_rule_names_key_and_rule(raw: dict, dotted: str, value: object, message: str) -> None:
    with pytest.raises(ParamsError) as err:
        parse_params(with_value(raw, dotted, value), ROOT)
    assert str(err.value) == message


def test_unknown_keys_are_refused(raw: dict) -> None:
    raw["ppo"]["lr"] = 1e-5
    with pytest.raises(ParamsError, match=r"^params.yaml: ppo.lr: unknown key \(known: .*learning_rate"):
        parse_params(raw, ROOT)
    with pytest.raises(ParamsError, match="^params.yaml: trainer: unknown key"):
        parse_params({"trainer": {}}, ROOT)


def test_section_must_be_a_mapping(raw: dict) -> None:
    raw["ppo"] = [1, 2]
    with pytest.raises(ParamsError, match=r"^params.yaml: ppo: must be a mapping"):
        parse_params(raw, ROOT)


def test_reward_from_sft_needs_sft(raw: dict) -> None:
    raw["reward"]["train"] = True
    with pytest.raises(ParamsError, match="^params.yaml: reward.base: is 'sft' but sft.enabled is false"):
        parse_params(raw, ROOT)


def test_scratch_model_must_hold_prompt_and_response(raw: dict) -> None:
    raw["sft"].update(enabled=True, n_positions=16, block_size=16)
    with pytest.raises(ParamsError, match=r"^params.yaml: ppo.response_max_tokens: prompt_max_tokens \+ "
                                          r"response_max_tokens \(24\) must fit sft.n_positions \(16\)"):
        parse_params(raw, ROOT)


def test_dpo_responses_must_fit_a_scratch_policy(raw: dict) -> None:
    raw["sft"].update(enabled=True, base="scratch", n_positions=32, block_size=32)
    raw["ppo"]["response_max_tokens"] = 16
    raw["dpo"]["max_length"] = 48
    with pytest.raises(ParamsError) as err:
        parse_params(raw, ROOT)
    assert str(err.value) == "params.yaml: dpo.max_length: must fit sft.n_positions (32) (got 48)"


def test_ints_are_accepted_for_floats(raw: dict) -> None:
    raw["ppo"]["learning_rate"] = 1
    p = parse_params(raw, ROOT)
    assert p.ppo.learning_rate == 1.0 and isinstance(p.ppo.learning_rate, float)


@pytest.mark.parametrize(("dotted", "value", "rule"), [
    ("ppo.steps", True, "must be an integer (got True)"),
    ("ppo.steps", 2.0, "must be an integer (got 2.0)"),
    ("ppo.steps", "8", "must be an integer (got '8' (a string): write it without quotes)"),
    ("ppo.learning_rate", "5e-05", "must be a number (got '5e-05' (a string): write it without quotes)"),
    ("ppo.learning_rate", "fast", "must be a number (got 'fast')"),
    ("ppo.learning_rate", float("nan"), "must be a finite number (got nan)"),
    ("ppo.checkpoint_every", "10", "must be an integer (got '10' (a string): write it without quotes)"),
    ("ppo.max_grad_norm", 0, "must be > 0 (got 0)"),
    ("sft.dropout", 1.0, "must be in [0, 1) (got 1.0)"),
    ("sft.splits", [], "must not be empty (got [])"),
    ("model.precision", "fp16", "must be one of auto, fp32, bf16 (got 'fp16')"),
    ("data.source", 3, "must be a str (got 3)"),
    ("method", "rlhf", "must be one of ppo, dpo, best_of_n (got 'rlhf')"),
    ("dpo.beta", 0, "must be > 0 (got 0)"),
    ("dpo.tau", -0.1, "must be > 0 (got -0.1)"),
    ("dpo.label_smoothing", 0.5, "must be in [0, 0.5) (got 0.5)"),
    ("dpo.loss", "sigmoid", "must be one of dpo, ipo (got 'sigmoid')"),
    ("dpo.pairs", "human", "must be one of prepare, sampled (got 'human')"),
    ("dpo.samples_per_prompt", 1, "must be >= 2 (got 1)"),
    ("dpo.sample_prompts", 0, "must be > 0 (got 0)"),
    ("evaluate.best_of_n", 0, "must be >= 1 (got 0)"),
])
def test_strict_types_and_declared_bounds(raw: dict, dotted: str, value: object, rule: str) -> None:
    with pytest.raises(ParamsError) as err:
        parse_params(with_value(raw, dotted, value), ROOT)
    assert str(err.value) == f"params.yaml: {dotted}: {rule}"


@pytest.mark.parametrize(("dotted", "message"), [
    ("ppo.steps", "params.yaml: ppo.steps: missing (params.yaml is the DVC cache key: every key must be written out; "
                  "PPO iterations; each samples batch_size prompts (194 x 128 is one pass over the 24,895 train "
                  "prompts).)"),
    ("evaluate", "params.yaml: evaluate: missing (params.yaml is the DVC cache key: every key must be written out; "
                 "a section)"),
    ("dpo.beta", "params.yaml: dpo.beta: missing (params.yaml is the DVC cache key: every key must be written out; "
                 "DPO's KL coefficient: small lets the policy move far from the reference.)"),
])
def test_a_missing_key_is_an_error_not_a_default(raw: dict, dotted: str, message: str) -> None:
    *parents, last = dotted.split(".")
    node = raw
    for key in parents:
        node = node[key]
    del node[last]
    with pytest.raises(ParamsError) as err:
        parse_params(raw, ROOT)
    assert str(err.value) == message


def test_an_unknown_key_is_named_before_a_missing_one(raw: dict) -> None:
    raw["ppo"]["lr"] = raw["ppo"].pop("learning_rate")  # a typo
    with pytest.raises(ParamsError, match="^params.yaml: ppo.lr: unknown key"):
        parse_params(raw, ROOT)


def test_two_judges_with_one_name_fail_naming_both_keys(raw: dict) -> None:
    with pytest.raises(ParamsError) as err:
        parse_params(with_value(raw, "evaluate.judges", ["a/clf", "vader", "b/clf"]), ROOT)
    assert str(err.value) == ("params.yaml: evaluate.judges[2]: judge name 'clf' repeats evaluate.judges[0] (names "
                              "are the model's basename; list each judge once) (got 'b/clf')")
    assert parse_params(with_value(raw, "evaluate.judges", ["a/clf", "vader"]), ROOT).evaluate.judge_names == [
        "clf", "vader"]


def test_relative_local_paths_resolve_against_the_params_folder(tmp_path: Path, raw: dict) -> None:
    (tmp_path / "imdb").mkdir()
    raw["data"]["source"] = "./imdb"
    path = tmp_path / "params.yaml"
    path.write_text(json.dumps(raw))  # JSON is YAML
    assert load_params(path).data.source == "./imdb"


def write_spelled(folder: Path, dotted: str, spelling: str) -> Path:
    """The shipped params.yaml with one ppo.* value written as ``spelling``, verbatim."""
    section, key = dotted.split(".")
    text, n = re.subn(rf"(?ms)^({section}:.*?^  {key}: )\S+", lambda m: m[1] + spelling,
                      (ROOT / "params.yaml").read_text(), count=1)
    assert n == 1
    (folder / "params.yaml").write_text(text)
    return folder / "params.yaml"


@pytest.mark.parametrize(("dotted", "spelling", "value"), [
    ("ppo.learning_rate", "1e-5", 1e-5),
    ("ppo.learning_rate", "5e-05", 5e-5),
    ("ppo.learning_rate", "3E-4", 3e-4),
    ("ppo.learning_rate", ".5", 0.5),
    ("ppo.horizon", "1_000", 1000.0),
])
def test_yaml_1_2_numbers_are_numbers(tmp_path: Path, dotted: str, spelling: str, value: float) -> None:
    """DVC reads and writes params.yaml as YAML 1.2 (`-S lr=1e-5` is written back as `1e-05`), so must we."""
    loaded = getattr(load_params(write_spelled(tmp_path, dotted, spelling)).ppo, dotted.split(".")[1])
    assert loaded == value and isinstance(loaded, float)


@pytest.mark.parametrize(("dotted", "spelling", "rule"), [
    ("ppo.learning_rate", "'5e-05'", "must be a number (got '5e-05' (a string): write it without quotes)"),
    ("ppo.steps", '"194"', "must be an integer (got '194' (a string): write it without quotes)"),
    ("ppo.adap_kl_ctrl", "yes", "must be a bool (got 'yes')"),  # YAML 1.2: only true/false are booleans
])
def test_quoted_numbers_and_yaml_1_1_booleans_are_strings(tmp_path: Path, dotted: str, spelling: str,
                                                          rule: str) -> None:
    with pytest.raises(ParamsError) as err:
        load_params(write_spelled(tmp_path, dotted, spelling))
    assert str(err.value) == f"params.yaml: {dotted}: {rule}"


def test_unreadable_params_file(tmp_path: Path) -> None:
    with pytest.raises(ParamsError, match="params.yaml: not found"):
        load_params(tmp_path / "params.yaml")
    (tmp_path / "params.yaml").write_text("ppo: [unclosed\n")
    with pytest.raises(ParamsError, match="params.yaml: not valid YAML"):
        load_params(tmp_path / "params.yaml")


def test_tokenizer_defaults_to_the_policy_or_sft_base() -> None:
    p = defaults()
    assert p.tokenizer_path == "lvwerra/gpt2-imdb"
    p = p.model_copy(update={"sft": p.sft.model_copy(update={"enabled": True, "base": "gpt2"})})
    assert p.tokenizer_path == "gpt2"


@pytest.mark.parametrize(("updates", "message"), [
    ({"advantage_estimator": "rloo"}, "ppo.samples_per_prompt: must be >= 2 with ppo.advantage_estimator rloo (its "
                                      "baseline is the prompt's other samples) (got 1)"),
    ({"advantage_estimator": "grpo", "samples_per_prompt": 1}, "ppo.samples_per_prompt: must be >= 2 with "
                                                               "ppo.advantage_estimator grpo (its baseline is the "
                                                               "prompt's other samples) (got 1)"),
    ({"samples_per_prompt": 3}, "ppo.batch_size: must be a multiple of ppo.samples_per_prompt (3) (got 128)"),
    ({"samples_per_prompt": 0}, "ppo.samples_per_prompt: must be > 0 (got 0)"),
    ({"kl_loss_coef": 0.04}, "ppo.kl_loss_coef: must be 0 with ppo.advantage_estimator gae (a KL loss term is "
                             "GRPO's; the others keep the KL penalty in the reward: ppo.init_kl_coef) (got 0.04)"),
    ({"advantage_estimator": "reinforce_pp", "kl_loss_coef": 0.04},
     "ppo.kl_loss_coef: must be 0 with ppo.advantage_estimator reinforce_pp (a KL loss term is GRPO's; the others "
     "keep the KL penalty in the reward: ppo.init_kl_coef) (got 0.04)"),
    ({"advantage_estimator": "rloo", "samples_per_prompt": 4, "value_model": "separate"},
     "ppo.value_model: must be 'shared' with ppo.advantage_estimator rloo, which trains no critic (a separate critic "
     "would never be used) (got 'separate')"),
    ({"advantage_estimator": "ppo"}, f"ppo.advantage_estimator: must be one of {', '.join(ESTIMATORS)} (got 'ppo')"),
])
def test_estimator_rules_name_the_key(raw: dict, updates: dict, message: str) -> None:
    raw["ppo"].update(updates)
    with pytest.raises(ParamsError) as err:
        parse_params(raw, ROOT)
    assert str(err.value) == f"params.yaml: {message}"


@pytest.mark.parametrize(("estimator", "k", "unused"), [
    ("gae", 1, []),
    ("gae", 4, []),
    ("rloo", 4, ["value_model", "vf_coef", "cliprange_value", "gamma", "lam", "whiten_rewards"]),
    ("grpo", 2, ["value_model", "vf_coef", "cliprange_value", "gamma", "lam", "whiten_rewards"]),
    ("reinforce_pp", 1, ["value_model", "vf_coef", "cliprange_value", "lam", "whiten_rewards"]),
])
def test_critic_free_estimators_accept_the_default_value_settings_and_name_what_they_ignore(
        raw: dict, estimator: str, k: int, unused: list[str]) -> None:
    raw["ppo"].update(advantage_estimator=estimator, samples_per_prompt=k)
    ppo = parse_params(raw, ROOT).ppo
    assert ppo.critic == ("shared" if estimator == "gae" else None)
    assert ppo.unused_keys == [f"ppo.{key}" for key in unused]
    assert ppo.prompts_per_step == 128 // k


def test_grpo_takes_a_kl_loss_coef(raw: dict) -> None:
    raw["ppo"].update(advantage_estimator="grpo", samples_per_prompt=4, kl_loss_coef=0.04, init_kl_coef=0.0)
    assert parse_params(raw, ROOT).ppo.kl_loss_coef == 0.04
