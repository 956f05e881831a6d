"""The one model loader: local dirs load, bad paths and pickled checkpoints are refused with a message."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhf.models.loading import (
    FAST_GELU,
    check_vocab_match,
    fast_activations,
    load_causal_lm,
    load_sequence_classifier,
    load_tokenizer,
)
from rlhf.pipeline.errors import ModelError
from rlhf.pipeline.params import defaults

SAFE = defaults().model
PICKLE_OK = defaults().model.model_copy(update={"allow_pickle": True})


def pickled_copy(src: Path, dest: Path) -> Path:
    """The same model with its weights as a pickled pytorch_model.bin instead of safetensors."""
    from safetensors.torch import load_file

    shutil.copytree(src, dest)
    state = load_file(dest / "model.safetensors")
    (dest / "model.safetensors").unlink()
    torch.save(state, dest / "pytorch_model.bin")
    return dest


def test_local_dir_loads_with_its_tokenizer(tiny_gpt2_dir: Path) -> None:
    lm = load_causal_lm(str(tiny_gpt2_dir), SAFE)
    tokenizer = load_tokenizer(str(tiny_gpt2_dir), SAFE)
    check_vocab_match(tokenizer, lm, "model.policy")
    assert tokenizer.padding_side == "left"


def test_missing_pad_token_becomes_eos(tokenizer_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO")
    tokenizer = load_tokenizer(str(tokenizer_dir), SAFE)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert "has no pad token; padding with EOS" in caplog.text


def test_missing_dir_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=rf"^model.policy: {tmp_path}/nope: no such directory$"):
        load_causal_lm(str(tmp_path / "nope"), SAFE)
    with pytest.raises(ModelError, match=rf"^model.tokenizer: {tmp_path}/nope: no such directory$"):
        load_tokenizer(str(tmp_path / "nope"), SAFE)


def test_folder_without_config_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"^reward.model: .*: not a model folder \(no config.json\)$"):
        load_sequence_classifier(str(tmp_path), SAFE)


def test_pickled_checkpoint_is_refused_unless_allowed(tiny_gpt2_dir: Path, tmp_path: Path) -> None:
    pickled = pickled_copy(tiny_gpt2_dir, tmp_path / "pickled")
    with pytest.raises(ModelError, match=r"^model.policy: .*only pickled weights .*model.allow_pickle: true"):
        load_causal_lm(str(pickled), SAFE)
    lm = load_causal_lm(str(pickled), PICKLE_OK)
    reference = load_causal_lm(str(tiny_gpt2_dir), SAFE)
    for (name, a), (_, b) in zip(lm.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_folder_without_weights(tiny_gpt2_dir: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    shutil.copytree(tiny_gpt2_dir, empty)
    (empty / "model.safetensors").unlink()
    with pytest.raises(ModelError, match=r"no weights found \(expected model.safetensors\)"):
        load_causal_lm(str(empty), SAFE)


def test_tokenizer_larger_than_the_embedding_is_refused(tokenizer_dir: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    lm = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=8, n_layer=1, n_head=1))
    tokenizer = load_tokenizer(str(tokenizer_dir), SAFE)
    with pytest.raises(ModelError, match=r"^model.tokenizer: the tokenizer has 400 tokens but the model's "
                                         r"embedding has only 50 rows"):
        check_vocab_match(tokenizer, lm, "model.tokenizer")


def test_fast_activations_keep_the_outputs_and_say_so_in_the_config(tiny_gpt2_dir: Path, tmp_path: Path) -> None:
    original = AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir).eval()
    assert original.config.activation_function == "gelu_new"
    fast = fast_activations(copy.deepcopy(original))
    assert fast.config.activation_function == FAST_GELU
    ids = torch.arange(12).view(2, 6)
    with torch.no_grad():
        torch.testing.assert_close(fast(ids).logits, original(ids).logits, rtol=1e-5, atol=1e-5)
        fast.save_pretrained(tmp_path)
        assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits, fast(ids).logits)
