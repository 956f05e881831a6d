"""The prompts prepare writes (data/prompts/{train,eval}.parquet): reading, checking against the model, batching."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.models.loading import context_size
from rlhf.pipeline.errors import DataError


@dataclass
class Prompts:
    input_ids: list[list[int]]
    queries: list[str]

    def __len__(self) -> int:
        return len(self.queries)

    @property
    def longest(self) -> int:
        """Tokens of the longest prompt."""
        return max(map(len, self.input_ids))

    def take(self, indices: Sequence[int]) -> Prompts:
        """The prompts at ``indices``, in that order."""
        return Prompts([self.input_ids[i] for i in indices], [self.queries[i] for i in indices])


def read_prompts(path: Path) -> Prompts:
    if not path.exists():
        raise DataError(f"{path}: missing (run the prepare stage first)")
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises many types for a truncated or foreign file
        raise DataError(f"{path}: unreadable ({str(e).splitlines()[0]}): rerun the prepare stage") from None
    for column in ("query", "input_ids"):
        if column not in table.column_names:
            raise DataError(f"{path}: missing column {column!r} (columns: {', '.join(table.column_names)})")
    if table.num_rows == 0:
        raise DataError(f"{path}: no prompts")
    ids, queries = table["input_ids"], table["query"]
    lists = pa.types.is_list(ids.type) or pa.types.is_large_list(ids.type)  # pandas writes large strings too
    if not (lists and pa.types.is_integer(ids.type.value_type)) \
            or not (pa.types.is_string(queries.type) or pa.types.is_large_string(queries.type)):
        raise DataError(f"{path}: input_ids is {ids.type} and query {queries.type}, not lists of token ids and "
                        "texts: rerun the prepare stage")
    prompts = Prompts(ids.to_pylist(), queries.to_pylist())
    for row, (token_ids, query) in enumerate(zip(prompts.input_ids, prompts.queries, strict=True)):
        if query is None or token_ids is None or None in token_ids:  # would fail mid-run, when its batch comes
            raise DataError(f"{path}: row {row}: a query or token id is missing (null): rerun the prepare stage")
    return prompts


def check_prompts(path: Path, prompts: Prompts, tokenizer: PreTrainedTokenizerBase, lm: PreTrainedModel,
                  response_max_tokens: int, what: str) -> None:
    """Prompts tokenized with another tokenizer, or too long for the positions of ``lm`` (named ``what``), fail
    before any sampling."""
    limit, vocab = context_size(lm) - response_max_tokens, len(tokenizer)
    for row, ids in enumerate(prompts.input_ids):
        if not ids:
            raise DataError(f"{path}: row {row}: empty prompt")
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise DataError(f"{path}: row {row}: token id {bad[0]} outside the tokenizer's {vocab} ids "
                            "(prompts tokenized with another tokenizer: rerun prepare)")
        if len(ids) > limit:
            raise DataError(f"{path}: row {row}: a {len(ids)}-token prompt + ppo.response_max_tokens="
                            f"{response_max_tokens} exceed the {context_size(lm)} positions of {what}")
