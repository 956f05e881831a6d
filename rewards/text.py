"""Reward functions of the response text alone: f(queries, responses) -> one float per response."""

from __future__ import annotations


def repetition_penalty(queries: list[str], responses: list[str]) -> list[float]:
    """Minus the share of a response's words that repeat an earlier word of it: 0 without repeats, -0.75 for
    'great great great great'."""
    scores = []
    for response in responses:
        words = response.lower().split()
        scores.append(-(len(words) - len(set(words))) / len(words) if words else 0.0)
    return scores


def length_bonus(queries: list[str], responses: list[str]) -> list[float]:
    """The response's words as a share of 20, at most 1: a reward for not stopping early."""
    return [min(len(response.split()), 20) / 20 for response in responses]
