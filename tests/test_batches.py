"""Resumable data orders: each resumes exactly where it stopped, and the shuffled one is a sequence of permutations
split between processes."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf.data.prompts import Prompts
from rlhf.train.batches import Batches, RandomBatches, ShuffledBatches


def draw(order: Batches, n: int) -> list[list[int]]:
    return [next(order).tolist() for _ in range(n)]


@pytest.mark.parametrize("make", [lambda g: ShuffledBatches(10, 3, g), lambda g: RandomBatches(10, 3, g)])
def test_an_order_resumes_where_it_stopped(make) -> None:
    expected = draw(make(torch.Generator().manual_seed(0)), 8)  # the shuffled one crosses two reshuffles
    first = make(torch.Generator().manual_seed(0))
    seen = draw(first, 5)
    state = json.loads(json.dumps(first.state_dict()))
    draw(first, 2)  # the generator moves on; restoring rewinds it
    resumed = make(torch.Generator().manual_seed(0))
    resumed.load_state_dict(state)
    assert seen + draw(resumed, 3) == expected


def test_shuffled_batches_cut_consecutive_permutations_and_drop_the_remainder() -> None:
    generator = torch.Generator().manual_seed(3)
    batches = draw(ShuffledBatches(10, 3, torch.Generator().manual_seed(3)), 6)
    permutations = [torch.randperm(10, generator=generator).tolist() for _ in range(2)]
    assert batches == [p[i: i + 3] for p in permutations for i in (0, 3, 6)]


def test_processes_take_disjoint_slices_of_each_global_batch() -> None:
    one = draw(ShuffledBatches(12, 2, torch.Generator().manual_seed(1), rank=0, world=1), 6)
    ranks = [draw(ShuffledBatches(12, 1, torch.Generator().manual_seed(1), rank=r, world=2), 6) for r in range(2)]
    assert [a + b for a, b in zip(*ranks, strict=True)] == one


def test_prompts_take_keeps_the_order_of_the_indices() -> None:
    prompts = Prompts([[1], [2, 2], [3]], ["a", "b", "c"])
    assert len(prompts) == 3
    assert prompts.take([2, 0]) == Prompts([[3], [1]], ["c", "a"])
