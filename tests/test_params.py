"""params.yaml -> typed config: every key documented, dvc.yaml's params being keys, and every validation rule failing
with one line naming its key and its rule."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from conftest import ROOT

from rlhf.pipeline.errors import ParamsError
from rlhf.pipeline.params import (
    changed_since_read,
    declaration,
    defaults,
    dotted_keys,
    expand,
    load_params,
    parse_params,
    read_yaml,
)
from rlhf.pipeline.wiring import stages, wiring
from rlhf.rl.estimators import ESTIMATORS

DVC_YAML = ROOT / "dvc.yaml"


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


def refused(raw: dict | None, key: str, rule: str) -> ParamsError:
    """The one line a bad ``raw`` gets: it names ``key`` and states ``rule`` (a part of the rule that says which)."""
    with pytest.raises(ParamsError) as err:
        parse_params(raw, ROOT)
    assert err.value.key == key, str(err.value)
    assert str(err.value).startswith(f"params.yaml: {key}: ") and rule in str(err.value), str(err.value)
    assert "\n" not in str(err.value)
    return err.value


def test_classic_recipe_defaults() -> None:
    p = defaults()
    assert (p.data.source, p.model.policy, p.reward.model) == (
        "stanfordnlp/imdb", "lvwerra/gpt2-imdb", "lvwerra/distilbert-imdb")
    assert (p.prepare.min_review_chars, p.prepare.prompt_min_tokens, p.prepare.prompt_max_tokens) == (200, 2, 8)
    assert (p.ppo.learning_rate, p.ppo.batch_size, p.ppo.mini_batch_size, p.ppo.ppo_epochs, p.ppo.steps) == (
        1.41e-5, 128, 128, 4, 194)
    assert (p.ppo.init_kl_coef, p.ppo.target, p.ppo.horizon, p.ppo.gamma, p.ppo.lam) == (0.2, 6.0, 10000.0, 1.0, 0.95)


def test_every_key_is_documented() -> None:
    assert not [key for key in dotted_keys() if not declaration(key).description]


@pytest.mark.parametrize("stage", list(stages(DVC_YAML)))
def test_every_params_entry_of_dvc_yaml_is_a_key_or_a_section(stage: str) -> None:
    for entry in wiring(stage, DVC_YAML).params:
        assert expand([entry]), f"dvc.yaml: stage {stage}: {entry} is no params key"


def test_only_ppo_reads_ppo_params_beyond_the_sampling_settings() -> None:
    """The stages that sample as ppo samples (evaluate, sample_pairs, optimum) read its sampling settings and no other
    ppo.* key but the beta of the objective that evaluate measures, which reads ppo's policy anyway: a change to PPO's
    training keys reruns ppo and what reads its policy, nothing else."""
    sampling = {"ppo.response_min_tokens", "ppo.response_max_tokens", "ppo.top_k", "ppo.top_p", "ppo.temperature"}
    beta = {"ppo.adap_kl_ctrl", "ppo.init_kl_coef"}
    for name in set(stages(DVC_YAML)) - {"ppo"}:
        read = {key for key in expand(wiring(name, DVC_YAML).params) if key.startswith("ppo.")}
        allowed = sampling | (beta if "models/policy" in wiring(name, DVC_YAML).deps else set())
        assert read <= allowed, f"{name} reads {sorted(read - allowed)}"


def test_a_stage_reads_only_the_keys_dvc_yaml_lists_for_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage's view of the params: a key dvc.yaml does not list for it raises, naming the stage and the key (a
    property that reads one too)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "params.yaml").write_bytes((ROOT / "params.yaml").read_bytes())
    (tmp_path / "dvc.yaml").write_text("stages:\n  toy:\n    cmd: x\n    params: [seed, ppo, model.policy]\n")
    params = load_params("toy")
    assert (params.seed, params.ppo.steps, params.model.policy) == (0, 194, "lvwerra/gpt2-imdb")
    with pytest.raises(ParamsError, match=r"^toy reads sft.enabled, which dvc.yaml does not list"):
        _ = params.sft.enabled
    with pytest.raises(ParamsError, match=r"^toy reads model.tokenizer, which dvc.yaml does not list"):
        _ = params.tokenizer_path
    assert load_params().sft.enabled is False  # no stage: every key


def test_params_caught_halfway_through_a_write_are_read_once_written(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``dvc exp run -S`` rewrites params.yaml while a stage runs: a check in the middle of the write saw a file
    without its last keys and stopped the run on "seed: missing" instead of naming the value that changed. The check
    reads until two reads agree (the writer finishes in the wait between them)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dvc.yaml").write_bytes((ROOT / "dvc.yaml").read_bytes())
    full = (ROOT / "params.yaml").read_text()
    (tmp_path / "params.yaml").write_text(full)
    load_params("ppo")
    changed = full.replace("learning_rate: 1.41e-5", "learning_rate: 2.0e-5", 1)
    assert changed != full
    lines = changed.splitlines(keepends=True)
    (tmp_path / "params.yaml").write_text("".join(lines[:len(lines) // 2]))  # the writer's first half
    monkeypatch.setattr("rlhf.pipeline.params.time.sleep", lambda _: (tmp_path / "params.yaml").write_text(changed))
    assert changed_since_read("ppo") == "ppo.learning_rate: 1.41e-05 -> 2e-05"
    (tmp_path / "params.yaml").write_text("".join(lines[:len(lines) // 2]))
    monkeypatch.setattr("rlhf.pipeline.params.time.sleep", lambda _: None)  # the half is all there is
    assert changed_since_read("ppo").startswith("it no longer validates: params.yaml: ")


@pytest.mark.parametrize(("dotted", "value", "key", "rule"), [
    ("ppo.batch_size", -4, "ppo.batch_size", "greater than or equal to 2"),
    ("ppo.batch_size", "many", "ppo.batch_size", "valid integer"),
    ("ppo.learning_rate", True, "ppo.learning_rate", "valid number"),
    ("ppo.adap_kl_ctrl", "yes", "ppo.adap_kl_ctrl", "valid boolean"),
    ("ppo.kl_penalty", "kk", "ppo.kl_penalty", "'kl', 'abs', 'mse', 'full', 'k3' or 'exact'"),
    ("ppo.gamma", 1.5, "ppo.gamma", "less than or equal to 1"),
    ("ppo.top_p", 0.0, "ppo.top_p", "greater than 0"),
    ("ppo.batch_size", 100, "ppo.batch_size", "multiple of ppo.mini_batch_size x ppo.gradient_accumulation_steps"),
    ("ppo.response_min_tokens", 20, "ppo.response_min_tokens", "<= ppo.response_max_tokens"),
    ("prepare.prompt_min_tokens", 9, "prepare.prompt_min_tokens", "<= prepare.prompt_max_tokens"),
    ("prepare.eval_prompts", 0, "prepare.eval_prompts", "greater than 0"),
    ("prepare.pairs_source", "pairs.txt", "prepare.pairs_source", ".parquet/.jsonl"),
    ("data.source", "./no/such/folder", "data.source", "does not exist"),
    ("model.tokenizer", "../no-such-tokenizer", "model.tokenizer", "does not exist"),
    ("sft.n_embd", 100, "sft.n_embd", "divisible by sft.n_head"),
    ("sft.block_size", 512, "sft.block_size", "<= sft.n_positions"),
    ("sft.splits", ["train", "test"], "sft.splits", "'test'"),
    ("sft.splits", "train", "sft.splits", "valid list"),
    ("evaluate.judges", ["vader", 3], "evaluate.judges[1]", "valid string"),
    ("seed", -1, "seed", "greater than or equal to 0"),
    ("seed", 2**32, "seed", "less than 4294967296"),  # NumPy's seeds are 32-bit: ppo died in numpy
    ("ppo.temperature", 1e-30, "ppo.temperature", "greater than or equal to 0.01"),  # logits / 1e-30 lose every digit
    ("ppo.batch_size", 1, "ppo.batch_size", "greater than or equal to 2"),  # one token cannot be whitened
    ("sft.block_size", 1, "sft.block_size", "greater than or equal to 2"),  # one token: no next token
    ("sft.max_tokens", 100, "sft.max_tokens", "at least one optimizer step's tokens"),  # trained one step anyway
])
def test_each_rule_names_key_and_rule(raw: dict, dotted: str, value: object, key: str, rule: str) -> None:
    assert str(refused(with_value(raw, dotted, value), key, rule)).endswith(")")  # "(got <value>)"


def test_unknown_keys_are_refused(raw: dict) -> None:
    raw["ppo"]["lr"] = 1e-5
    assert "learning_rate" in str(refused(raw, "ppo.lr", "unknown key"))  # the known keys are listed
    refused({"trainer": {}}, "trainer", "unknown key")


def test_section_must_be_a_mapping(raw: dict) -> None:
    raw["ppo"] = [1, 2]
    refused(raw, "ppo", "valid dictionary")


def test_reward_from_sft_needs_sft(raw: dict) -> None:
    raw["reward"]["train"] = True
    refused(raw, "reward.base", "sft.enabled is false")


def test_scratch_model_must_hold_prompt_and_response(raw: dict) -> None:
    raw["sft"].update(enabled=True, n_positions=16, block_size=16)
    refused(raw, "ppo.response_max_tokens", "must fit sft.n_positions (16)")


def test_a_reward_needs_a_model_or_a_function(raw: dict) -> None:
    raw["reward"]["model"] = None
    refused(raw, "reward.model", "nothing would score the responses")
    raw["reward"]["functions"] = [{"function": "rewards.text:length_bonus", "weight": 1.0}]
    assert parse_params(raw).reward.model is None
    raw["reward"]["functions"] = [{"function": "rewards/text.py", "weight": 1.0}]
    refused(raw, "reward.functions[0].function", "'module:callable'")


def test_lora_keeps_one_copy_of_the_weights(raw: dict) -> None:
    raw["model"]["lora"]["r"] = 16
    raw["ppo"]["value_model"] = "separate"
    refused(raw, "ppo.value_model", "'shared' with model.lora.r > 0")


def test_a_critic_from_the_reward_model_needs_a_trained_one(raw: dict) -> None:
    raw["ppo"]["value_model"] = "reward"
    refused(raw, "ppo.value_model", "'reward' needs reward.train: true")


def test_dpo_responses_must_fit_a_scratch_policy(raw: dict) -> None:
    raw["sft"].update(enabled=True, base="scratch", n_positions=32, block_size=32)
    raw["ppo"]["response_max_tokens"] = 16
    raw["dpo"]["max_length"] = 48
    refused(raw, "dpo.max_length", "must fit sft.n_positions (32)")


def test_ints_are_accepted_for_floats(raw: dict) -> None:
    raw["ppo"]["learning_rate"] = 1
    p = parse_params(raw, ROOT)
    assert p.ppo.learning_rate == 1.0 and isinstance(p.ppo.learning_rate, float)


@pytest.mark.parametrize(("dotted", "value", "rule"), [
    ("ppo.steps", True, "valid integer"),
    ("ppo.steps", 2.0, "valid integer"),
    ("ppo.steps", "8", "valid integer (got '8')"),
    ("ppo.learning_rate", "5e-05", "valid number (got '5e-05')"),
    ("ppo.learning_rate", "fast", "valid number (got 'fast')"),
    ("ppo.learning_rate", float("nan"), "finite number"),
    ("ppo.checkpoint_every", "10", "valid integer (got '10')"),
    ("ppo.max_grad_norm", 0, "greater than 0"),
    ("sft.dropout", 1.0, "less than 1"),
    ("sft.splits", [], "at least 1 item"),
    ("model.precision", "fp16", "'auto', 'fp32' or 'bf16'"),
    ("data.source", 3, "valid string"),
    ("method", "rlhf", "'ppo', 'dpo' or 'best_of_n'"),
    ("dpo.beta", 0, "greater than 0"),
    ("dpo.tau", -0.1, "greater than 0"),
    ("dpo.label_smoothing", 0.5, "less than 0.5"),
    ("dpo.loss", "sigmoid", "'dpo' or 'ipo'"),
    ("dpo.pairs", "human", "'prepare' or 'sampled'"),
    ("dpo.samples_per_prompt", 1, "greater than or equal to 2"),
    ("dpo.sample_prompts", 0, "greater than 0"),
    ("evaluate.best_of_n", 0, "greater than or equal to 1"),
    ("model.lora.r", -1, "greater than or equal to 0"),
    ("model.lora.alpha", 0, "greater than 0"),
    ("model.lora.dropout", 1.0, "less than 1"),
    ("model.lora.target_modules", [], "at least 1 item"),
    ("model.lora.target_modules", "c_attn", "valid list"),
])
def test_strict_types_and_declared_bounds(raw: dict, dotted: str, value: object, rule: str) -> None:
    refused(with_value(raw, dotted, value), dotted, rule)


@pytest.mark.parametrize(("dotted", "doc"), [
    ("ppo.steps", "PPO iterations"),
    ("evaluate", "a section"),
    ("dpo.beta", "DPO's KL coefficient"),
])
def test_a_missing_key_is_an_error_not_a_default(raw: dict, dotted: str, doc: str) -> None:
    """...whose message says why every key must be written out, and what the missing one is."""
    *parents, last = dotted.split(".")
    node = raw
    for key in parents:
        node = node[key]
    del node[last]
    assert doc in str(refused(raw, dotted, "missing (every key must be written out"))


def test_an_unknown_key_is_named_before_a_missing_one(raw: dict) -> None:
    raw["ppo"]["lr"] = raw["ppo"].pop("learning_rate")  # a typo
    refused(raw, "ppo.lr", "unknown key")


def test_two_judges_with_one_name_fail_naming_both_keys(raw: dict) -> None:
    error = refused(with_value(raw, "evaluate.judges", ["a/clf", "vader", "b/clf"]), "evaluate.judges[2]",
                    "judge name 'clf' repeats evaluate.judges[0]")
    assert "(got 'b/clf')" in str(error)
    assert parse_params(with_value(raw, "evaluate.judges", ["a/clf", "vader"]), ROOT).evaluate.judge_names == [
        "clf", "vader"]


def test_relative_local_paths_resolve_against_the_params_folder(tmp_path: Path, raw: dict) -> None:
    (tmp_path / "imdb").mkdir()
    raw["data"]["source"] = "./imdb"
    path = tmp_path / "params.yaml"
    path.write_text(json.dumps(raw))  # JSON is YAML
    assert load_params(path=path).data.source == "./imdb"


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
    loaded = getattr(load_params(path=write_spelled(tmp_path, dotted, spelling)).ppo, dotted.split(".")[1])
    assert loaded == value and isinstance(loaded, float)


@pytest.mark.parametrize(("dotted", "spelling", "rule"), [
    ("ppo.learning_rate", "'5e-05'", "valid number (got '5e-05')"),
    ("ppo.steps", '"194"', "valid integer (got '194')"),
    ("ppo.adap_kl_ctrl", "yes", "valid boolean (got 'yes')"),  # YAML 1.2: only true/false are booleans
])
def test_quoted_numbers_and_yaml_1_1_booleans_are_strings(tmp_path: Path, dotted: str, spelling: str,
                                                          rule: str) -> None:
    with pytest.raises(ParamsError) as err:
        load_params(path=write_spelled(tmp_path, dotted, spelling))
    assert err.value.key == dotted and rule in str(err.value)


def test_unreadable_params_file(tmp_path: Path) -> None:
    with pytest.raises(ParamsError, match="params.yaml: not found"):
        load_params(path=tmp_path / "params.yaml")
    (tmp_path / "params.yaml").write_text("ppo: [unclosed\n")
    with pytest.raises(ParamsError, match="params.yaml: not valid YAML"):
        load_params(path=tmp_path / "params.yaml")
    # a latin-1 byte in a comment (an editor's encoding) was UnicodeDecodeError's traceback (issue 33)
    (tmp_path / "params.yaml").write_bytes((ROOT / "params.yaml").read_bytes().replace(b"# ", b"# caf\xe9 ", 1))
    with pytest.raises(ParamsError, match=r"params.yaml: not UTF-8 text \(byte 5: b'\\xe9'\)$"):
        load_params(path=tmp_path / "params.yaml")
    (tmp_path / "params.yaml").unlink()
    (tmp_path / "params.yaml").mkdir()  # was IsADirectoryError's traceback
    with pytest.raises(ParamsError, match=r"params.yaml: cannot be read \(Is a directory\)$"):
        load_params(path=tmp_path / "params.yaml")


def test_tokenizer_defaults_to_the_policy_or_sft_base() -> None:
    p = defaults()
    assert p.tokenizer_path == "lvwerra/gpt2-imdb"
    p = p.model_copy(update={"sft": p.sft.model_copy(update={"enabled": True, "base": "gpt2"})})
    assert p.tokenizer_path == "gpt2"


@pytest.mark.parametrize(("updates", "key", "rule"), [
    ({"advantage_estimator": "rloo"}, "ppo.samples_per_prompt", ">= 2 with ppo.advantage_estimator rloo"),
    ({"advantage_estimator": "grpo", "samples_per_prompt": 1}, "ppo.samples_per_prompt",
     ">= 2 with ppo.advantage_estimator grpo"),
    ({"samples_per_prompt": 3}, "ppo.batch_size", "multiple of ppo.samples_per_prompt (3)"),
    ({"samples_per_prompt": 0}, "ppo.samples_per_prompt", "greater than 0"),
    ({"kl_loss_coef": 0.04}, "ppo.kl_loss_coef", "0 with ppo.advantage_estimator gae"),
    ({"advantage_estimator": "reinforce_pp", "kl_loss_coef": 0.04}, "ppo.kl_loss_coef",
     "0 with ppo.advantage_estimator reinforce_pp"),
    ({"advantage_estimator": "rloo", "samples_per_prompt": 4, "value_model": "separate"}, "ppo.value_model",
     "'shared' with ppo.advantage_estimator rloo"),
    ({"advantage_estimator": "dpg", "samples_per_prompt": 4, "init_kl_coef": 0.0}, "ppo.init_kl_coef",
     "> 0 with ppo.advantage_estimator dpg"),
    ({"advantage_estimator": "dpg", "samples_per_prompt": 4, "kl_penalty": "k3"}, "ppo.kl_penalty",
     "kl with ppo.advantage_estimator dpg"),
    ({"advantage_estimator": "dpg"}, "ppo.samples_per_prompt", ">= 2 with ppo.advantage_estimator dpg"),
    ({"advantage_estimator": "grpo", "samples_per_prompt": 4, "kl_penalty": "exact"}, "ppo.kl_penalty",
     "exact needs an estimator whose advantages keep one scale of the rewards (not grpo)"),
    ({"advantage_estimator": "ppo"}, "ppo.advantage_estimator", "should be " + ", ".join(map(repr, ESTIMATORS))[:20]),
    ({"ema_decay": 0.99, "shard": True}, "ppo.ema_decay", "null with ppo.shard: true"),
    ({"kl_penalty": "exact", "shard": True}, "ppo.kl_penalty", "exact is not run with ppo.shard: true"),
    ({"ema_decay": 1.0}, "ppo.ema_decay", "less than 1"),
])
def test_estimator_rules_name_the_key(raw: dict, updates: dict, key: str, rule: str) -> None:
    raw["ppo"].update(updates)
    refused(raw, key, rule)


CRITIC = ["value_model", "vf_coef", "cliprange_value", "value_learning_rate"]


@pytest.mark.parametrize(("estimator", "k", "unused"), [
    ("gae", 1, []),
    ("gae", 4, []),
    ("rloo", 4, CRITIC + ["gamma", "lam", "whiten_rewards"]),
    ("grpo", 2, CRITIC + ["gamma", "lam", "whiten_rewards"]),
    ("dpg", 4, CRITIC + ["gamma", "lam", "whiten_rewards"]),
    ("reinforce_pp", 1, CRITIC + ["lam", "whiten_rewards"]),
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
