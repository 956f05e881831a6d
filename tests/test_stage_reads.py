"""Every param a stage actually reads is declared in its record (and so in dvc.yaml): the whole pipeline runs
in-process on tiny models, once as the classic recipe and once with sft and reward trained, recording each access to
a params field after load_params returned."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from conftest import set_params, write_prompts

from rlhf.pipeline.registry import stage as stage_record
from rlhf.pipeline.registry import stage_names
from rlhf.pipeline.schema import Params, params_model
from rlhf.pipeline.sections import Section, dotted_keys

SECTIONS = {field.annotation: name for name, field in params_model().model_fields.items()}
TINY = {"prepare.train_prompts": 16, "prepare.eval_prompts": 8, "prepare.train_pairs": 32, "prepare.test_pairs": 8,
        "ppo.steps": 2, "ppo.batch_size": 4, "ppo.mini_batch_size": 2, "ppo.checkpoint_every": 1,
        "ppo.response_min_tokens": 2, "ppo.response_max_tokens": 6, "evaluate.batch_size": 8,
        "evaluate.examples": 2}
TRAINED = {"sft.enabled": True, "sft.n_layer": 1, "sft.n_embd": 32, "sft.n_head": 2, "sft.n_positions": 64,
           "sft.block_size": 32, "sft.batch_size": 8, "sft.max_tokens": 8 * 32 * 4, "sft.eval_reviews": 8,
           "sft.checkpoint_every": 2, "reward.train": True, "reward.batch_size": 8, "reward.max_length": 32,
           "reward.checkpoint_every": 2}


def declared(stage: str) -> set[str]:
    return {key for entry in stage_record(stage).params for key in dotted_keys(params_model())
            if key == entry or key.startswith(entry + ".")}


def run_recording(stage: str, monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Run ``stages.<stage>.main`` in the current folder; the dotted keys it read after loading params."""
    reads: set[str] = set()
    plain = Section.__getattribute__

    def recording(self: Section, name: str) -> object:
        value = plain(self, name)
        if name in type(self).model_fields and not isinstance(value, Section):
            section = SECTIONS.get(type(self))
            reads.add(f"{section}.{name}" if section else name)
        return value

    module = importlib.import_module(f"stages.{stage}")
    real_load = module.load_params

    def load_then_record() -> Params:
        params = real_load()
        reads.clear()  # validation reads every field
        return params

    with monkeypatch.context() as patch:
        patch.setattr(Section, "__getattribute__", recording)
        patch.setattr(module, "load_params", load_then_record)
        module.main()
    return reads


DPO = {"method": "dpo", "dpo.pairs": "sampled", "dpo.sample_prompts": 8, "dpo.batch_size": 4, "dpo.max_length": 24,
       "dpo.checkpoint_every": 1}


@pytest.mark.slow
@pytest.mark.parametrize(("trained", "method"), [(False, {}), (True, {}), (False, DPO)],
                         ids=["classic", "sft-and-reward-trained", "dpo-on-sampled-pairs"])
def test_stages_read_only_declared_params(trained: bool, method: dict, project: Path, imdb_dir: Path,
                                          tokenizer_dir: Path, tiny_gpt2_dir: Path, tiny_classifier_dir: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    write_prompts(project, tokenizer_dir)
    set_params(project, **{"data.source": str(imdb_dir), "model.policy": str(tiny_gpt2_dir),
                           "reward.model": str(tiny_classifier_dir),
                           "evaluate.judges": ["vader", str(tiny_classifier_dir)], **TINY, **method,
                           **({"model.tokenizer": str(tokenizer_dir), **TRAINED} if trained else {})})
    monkeypatch.chdir(project)
    for stage in stage_names():
        reads = run_recording(stage, monkeypatch)
        assert reads, f"{stage}: no params read (the recording is broken)"
        assert reads <= declared(stage), f"{stage} reads {sorted(reads - declared(stage))}, not in its record"
