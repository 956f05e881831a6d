"""Every param a stage reads is one dvc.yaml lists for it (a stage reading any other stops: rlhf/pipeline/params.py's
``for_stage``): the whole pipeline runs in-process on tiny models, as the classic recipe, with sft and reward trained,
and as DPO on sampled pairs."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from conftest import set_params, write_prompts

from rlhf.pipeline.wiring import stages, wiring

TINY = {"prepare.train_prompts": 16, "prepare.eval_prompts": 8, "prepare.train_pairs": 32, "prepare.test_pairs": 8,
        "ppo.steps": 2, "ppo.batch_size": 4, "ppo.mini_batch_size": 2, "ppo.checkpoint_every": 1,
        "ppo.response_min_tokens": 2, "ppo.response_max_tokens": 6, "evaluate.batch_size": 8,
        "evaluate.examples": 2}
TRAINED = {"sft.enabled": True, "sft.n_layer": 1, "sft.n_embd": 32, "sft.n_head": 2, "sft.n_positions": 64,
           "sft.block_size": 32, "sft.batch_size": 8, "sft.max_tokens": 8 * 32 * 4, "sft.eval_reviews": 8,
           "sft.checkpoint_every": 2, "reward.train": True, "reward.batch_size": 8, "reward.max_length": 32,
           "reward.checkpoint_every": 2}


DPO = {"method": "dpo", "dpo.pairs": "sampled", "dpo.sample_prompts": 8, "dpo.batch_size": 4, "dpo.max_length": 24,
       "dpo.checkpoint_every": 1}


@pytest.mark.slow
@pytest.mark.parametrize(("trained", "method"), [(False, {}), (True, {}), (False, DPO)],
                         ids=["classic", "sft-and-reward-trained", "dpo-on-sampled-pairs"])
def test_stages_read_only_the_params_dvc_yaml_lists(trained: bool, method: dict, project: Path, imdb_dir: Path,
                                                    tokenizer_dir: Path, tiny_gpt2_dir: Path,
                                                    tiny_classifier_dir: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    write_prompts(project, tokenizer_dir)
    set_params(project, **{"data.source": str(imdb_dir), "model.policy": str(tiny_gpt2_dir),
                           "reward.model": str(tiny_classifier_dir),
                           "evaluate.judges": ["vader", str(tiny_classifier_dir)], **TINY, **method,
                           **({"model.tokenizer": str(tokenizer_dir), **TRAINED} if trained else {})})
    monkeypatch.chdir(project)
    for stage in stages():
        importlib.import_module(f"stages.{stage}").main()  # a key dvc.yaml does not list raises ParamsError
        # and it ran to the end: every output dvc.yaml lists for it is there (a switched-off stage's markers too)
        missing = [str(path) for path in wiring(stage).outputs if not path.exists()]
        assert not missing, (stage, missing)
