"""Resumable data orders: which items each training step reads, drawn from a generator that serves nothing else.

Every order resumes the same way: its state is the number of batches drawn, and restoring rewinds the generator to
its initial state and draws that many again (index draws only: milliseconds), so the order continues exactly where
it stopped.
"""

from __future__ import annotations

import torch


class Batches:
    """Endless batches of indices into ``n`` items; resumable with ``state_dict`` / ``load_state_dict``."""

    def __init__(self, n: int, batch_size: int, generator: torch.Generator) -> None:
        self.n, self.batch_size = n, batch_size
        self.generator, self.initial_state = generator, generator.get_state()
        self.drawn = 0
        self.reset()

    def __iter__(self) -> Batches:
        return self

    def __next__(self) -> torch.Tensor:
        self.drawn += 1
        return self.draw()

    def draw(self) -> torch.Tensor:
        """The next batch of indices (1-D int64)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget what was drawn beyond the generator's state (nothing, for an order that keeps nothing else)."""

    def state_dict(self) -> dict[str, int]:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.generator.set_state(self.initial_state)
        self.drawn = 0
        self.reset()
        for _ in range(state["drawn"]):
            next(self)


class ShuffledBatches(Batches):
    """One permutation of the items after another, each cut into consecutive global batches of
    ``batch_size x world`` indices (a shorter remainder is dropped); process ``rank`` takes its slice of each."""

    def __init__(self, n: int, batch_size: int, generator: torch.Generator, rank: int = 0, world: int = 1) -> None:
        self.rank, self.world = rank, world
        super().__init__(n, batch_size, generator)

    def reset(self) -> None:
        self.order: torch.Tensor | None = None
        self.position = 0

    def draw(self) -> torch.Tensor:
        global_size = self.batch_size * self.world
        if self.order is None or self.position + global_size > self.n:
            self.order, self.position = torch.randperm(self.n, generator=self.generator), 0
        start = self.position + self.rank * self.batch_size
        self.position += global_size
        return self.order[start: start + self.batch_size]


class RandomBatches(Batches):
    """Indices drawn uniformly with replacement, ``batch_size`` at a time."""

    def draw(self) -> torch.Tensor:
        return torch.randint(self.n, (self.batch_size,), generator=self.generator)


def repeat_each(items: list, k: int) -> list:
    """Each item k times in a row: [a, b] -> [a, a, b, b] for k = 2 (a prompt's samples are contiguous)."""
    return [item for item in items for _ in range(k)]

