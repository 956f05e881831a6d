"""Guarded inputs and resources not covered elsewhere: each fails with one line naming the culprit.

CUDA out-of-memory is tested on CPU by a model or scorer that raises torch.OutOfMemoryError inside a real PPO step,
so what is tested is our handler, not a mock of it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import build_tiny_gpt2, error_line, set_params
from helpers import TokenShareScorer, batch, make_trainer, run

from rlhf.data.prompts import read_prompts
from rlhf.models.scorers import ClassifierScorer
from rlhf.pipeline.cli import one_line
from rlhf.pipeline.errors import DataError, ModelError
from rlhf.pipeline.params import defaults
from stages import ppo as ppo_stage


class OutOfMemoryScorer(TokenShareScorer):
    def __call__(self, queries: list[str], responses: list[str], response_ids: object = None) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize("phase", ["rollout", "update"])
def test_out_of_memory_in_a_ppo_step_names_the_batch_sizes(tiny_gpt2_dir: Path, phase: str) -> None:
    trainer = make_trainer(tiny_gpt2_dir, OutOfMemoryScorer if phase == "rollout" else TokenShareScorer)

    def out_of_memory_with_grad(module: torch.nn.Module, args: tuple, output: object) -> None:
        if torch.is_grad_enabled():  # only the update's forward passes build a graph
            raise torch.OutOfMemoryError("CUDA out of memory")

    trainer.policy.lm.transformer.register_forward_hook(out_of_memory_with_grad)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        trainer.step(*batch(trainer), step=2)
    message = one_line(caught.value, "ppo", ppo_stage.OUT_OF_MEMORY)
    assert message.startswith("out of GPU memory in ppo: ")
    assert "ppo.batch_size" in message and "ppo.mini_batch_size" in message


def test_a_causal_lm_is_not_a_reward_model(tiny_gpt2_dir: Path) -> None:
    with pytest.raises(ModelError, match=r"^reward.model: .*: a GPT2LMHeadModel, not a sequence classifier"):
        ClassifierScorer(str(tiny_gpt2_dir), defaults().model)


def test_a_many_label_classifier_needs_the_positive_label(tmp_path: Path, tokenizer_dir: Path) -> None:
    from conftest import build_tiny_classifier

    three = build_tiny_classifier(tmp_path / "three", tokenizer_dir, num_labels=3)
    with pytest.raises(ModelError, match=r"^reward.model: 3 outputs labelled LABEL_0, LABEL_1, LABEL_2, none of them "
                                         r"reward.positive_label='POSITIVE'"):
        ClassifierScorer(str(three), defaults().model)


def write_ids(project: Path, ids: list[list[int]]) -> None:
    pq.write_table(pa.table({"query": [str(i) for i in range(len(ids))],
                             "input_ids": pa.array(ids, pa.list_(pa.int32()))}),
                   project / "data/prompts/train.parquet")


def test_prompts_from_another_tokenizer_are_refused(ppo_project: Path) -> None:
    write_ids(ppo_project, [[5, 6, 7]] * 7 + [[5, 4000, 7]] * 5)
    error_line(run(ppo_project), "data/prompts/train.parquet", "row 7: token id 4000 outside the tokenizer's 400 ids")
    assert not (ppo_project / "models/policy").exists() and not (ppo_project / "data/rollouts").exists()


def test_an_unreadable_prompts_file_is_named(ppo_project: Path) -> None:
    """A truncated prompts file (a copy cut short) gave pyarrow's traceback."""
    path = ppo_project / "data/prompts/train.parquet"
    path.write_bytes(path.read_bytes()[:100])
    result = run(ppo_project)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: data/prompts/train.parquet: unreadable (Could not open Parquet input source")
    assert result.stderr.strip().splitlines()[-1].endswith("): rerun the prepare stage")


@pytest.mark.parametrize(("query", "ids", "problem"), [
    (["a", "b"], pa.array([[5], None], pa.list_(pa.int32())), "row 1: a query or token id is missing"),
    (["a", None], pa.array([[5], [6]], pa.list_(pa.int32())), "row 1: a query or token id is missing"),
    (["a", "b"], pa.array([[5], [6, None]], pa.list_(pa.int32())), "row 1: a query or token id is missing"),
    (["a", "b"], pa.array(["[5]", "[6]"]), "input_ids is string and query string, not lists of token ids"),
], ids=["ids-null", "query-null", "a-token-null", "ids-as-text"])
def test_a_prompts_file_with_missing_or_mistyped_values_is_named(query: list, ids: pa.Array, problem: str,
                                                                 tmp_path: Path) -> None:
    """A null or mistyped value was a traceback: at the start, or mid-run when its batch came (a null query)."""
    pq.write_table(pa.table({"query": query, "input_ids": ids}), tmp_path / "train.parquet")
    with pytest.raises(DataError, match=rf"^{tmp_path}/train.parquet: {re.escape(problem)}.*: rerun the prepare"):
        read_prompts(tmp_path / "train.parquet")


def test_prompts_longer_than_the_context_are_refused(ppo_project: Path, tokenizer_dir: Path, tmp_path: Path) -> None:
    short = build_tiny_gpt2(tmp_path / "short", tokenizer_dir, n_positions=16)
    set_params(ppo_project, **{"model.policy": str(short)})  # 8 prompt + 6 response tokens fit by params
    write_ids(ppo_project, [[5, 6, 7]] * 11 + [[5] * 12])
    error_line(run(ppo_project), "data/prompts/train.parquet",
               "row 11: a 12-token prompt + ppo.response_max_tokens=6 exceed the 16 positions")
