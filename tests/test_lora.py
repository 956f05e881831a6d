"""LoRA adapters (rlhf/models/lora.py): where they go, that switching them off gives back the base model bit for bit,
that a saved model is the merged one from_pretrained loads, and that a bad target fails naming its key."""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import ROOT, set_params
from helpers import TRAINING, interrupted_at_call, moved_weights, projections
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, PreTrainedModel

from rlhf.models.loading import load_causal_lm, load_tokenizer, save_pretrained
from rlhf.models.lora import adapters_disabled, add_lora, lora_layers
from rlhf.models.policy import backbone_hidden, lm_head
from rlhf.pipeline.errors import ModelError
from rlhf.pipeline.params import defaults
from rlhf.pipeline.sections import LoraParams
from rlhf.train import sft
from stages import sft as sft_stage
from stages import tokenize as tokenize_stage


def lora(**updates: object) -> LoraParams:
    return defaults().model.lora.model_copy(update={"r": 4} | updates)


def tiny(tiny_gpt2_dir: Path) -> PreTrainedModel:
    torch.manual_seed(0)
    return load_causal_lm(str(tiny_gpt2_dir), defaults().model).eval()


def logits(lm: PreTrainedModel) -> torch.Tensor:
    ids = torch.arange(24).view(2, 12) % lm.config.vocab_size
    with torch.no_grad():
        return lm_head(lm, backbone_hidden(lm.base_model, ids, torch.ones_like(ids), 5))


def perturb(lm: PreTrainedModel) -> None:
    """Random B: adapters that change the output (B starts at 0)."""
    with torch.no_grad():
        for name, weight in lm.named_parameters():
            if "lora_B" in name:
                weight.normal_(std=0.1)


def test_by_default_every_attention_and_mlp_projection_gets_an_adapter_and_nothing_else_trains(
        tiny_gpt2_dir: Path) -> None:
    lm = add_lora(tiny(tiny_gpt2_dir), lora())
    assert {name for name, _ in lora_layers(lm)} == projections()
    trained = [name for name, p in lm.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in name or ".lora_B." in name for name in trained)
    only = add_lora(tiny(tiny_gpt2_dir), lora(target_modules=["c_attn"]))
    assert [name for name, _ in lora_layers(only)] == ["transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn"]


def test_with_adapters_off_the_model_is_the_base_model_bit_for_bit(tiny_gpt2_dir: Path) -> None:
    base = logits(tiny(tiny_gpt2_dir))
    lm = add_lora(tiny(tiny_gpt2_dir), lora())
    assert torch.equal(logits(lm), base)  # B = 0: the first PPO ratio is 1, the first KL 0
    perturb(lm)
    adapted = logits(lm)
    assert (adapted - base).abs().max() > 0.1
    with adapters_disabled(lm):
        assert torch.equal(logits(lm), base)
    assert torch.equal(logits(lm), adapted)
    assert all(p.requires_grad for name, p in lm.named_parameters() if "lora_" in name)  # on again, trainable


def test_a_saved_model_is_the_merged_one_from_pretrained_loads(tiny_gpt2_dir: Path, tmp_path: Path) -> None:
    lm = add_lora(tiny(tiny_gpt2_dir), lora())
    perturb(lm)
    adapted = logits(lm)
    save_pretrained(lm, load_tokenizer(str(tiny_gpt2_dir), defaults().model), tmp_path / "out")
    names = load_file(tmp_path / "out" / "model.safetensors").keys()
    assert names == AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir).state_dict().keys() - {"lm_head.weight"}
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    torch.testing.assert_close(logits(reloaded), adapted, rtol=0, atol=1e-5)  # W + scaling B A, rounded once


@pytest.mark.parametrize("targets", [["no_such_layer"], ["ln_1"], ["wte"], ["lm_head"]])
def test_a_target_that_is_not_a_projection_fails_naming_the_key(tiny_gpt2_dir: Path, targets: list[str]) -> None:
    with pytest.raises(ModelError, match=r"^model\.lora\.target_modules: "):
        add_lora(tiny(tiny_gpt2_dir), lora(target_modules=targets))


@pytest.mark.parametrize("r", [33, 10**9])
def test_a_rank_above_a_targeted_layers_is_refused(tiny_gpt2_dir: Path, r: int) -> None:
    """A rank-r adapter of a 32-wide layer can add no more than rank 32; r = 10**9 was a traceback from allocating
    its 128 GB."""
    with pytest.raises(ModelError, match=rf"^model\.lora\.r: {r} is above the rank of transformer\.h\.0\.attn\."
                                         r"c_attn \(32 x 96: at most 32\)$"):
        add_lora(tiny(tiny_gpt2_dir), lora(r=r))
    assert lora_layers(add_lora(tiny(tiny_gpt2_dir), lora(r=32)))


@pytest.mark.slow
def test_sft_with_lora_trains_the_adapters_of_its_base_and_a_killed_run_resumes_to_the_same_model(
        tmp_path: Path, imdb_dir: Path, adaptable_gpt2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for name in ("params.yaml", "dvc.yaml"):
        shutil.copy(ROOT / name, name)
    set_params(tmp_path, **{**TRAINING["sft"], "data.source": str(imdb_dir), "sft.base": str(adaptable_gpt2_dir),
                            "model.lora.r": 4, "sft.learning_rate": 1e-2, "sft.max_tokens": 8 * 32 * 12})
    tokenize_stage.main()
    sft_stage.main()  # 12 steps, a checkpoint every 5
    losses = pd.read_csv("metrics/sft/loss.csv")["loss"]
    assert losses.iloc[-3:].mean() < losses.iloc[0] - 0.5
    trained = AutoModelForCausalLM.from_pretrained("models/sft")
    initial = AutoModelForCausalLM.from_pretrained(adaptable_gpt2_dir)
    assert moved_weights(trained, initial) == projections(suffix=".weight")
    uninterrupted = {name: Path(name).read_bytes() for name in ("models/sft/model.safetensors",
                                                                "metrics/sft/loss.csv")}
    shutil.rmtree("data/checkpoints/sft")  # the finished run's last: the same run again would end at once

    with interrupted_at_call(sft, "next_token_loss", 8), pytest.raises(KeyboardInterrupt):  # in step 7
        sft_stage.main()
    weights = load_file(Path("data/checkpoints/sft/step-000004/model.safetensors"))
    assert weights and all(".lora_A." in name or ".lora_B." in name for name in weights), sorted(weights)
    sft_stage.main()
    assert {name: Path(name).read_bytes() for name in uninterrupted} == uninterrupted
