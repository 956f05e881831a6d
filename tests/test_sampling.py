"""The decoding loop's sampler: filtered logits as Hugging Face's warpers make them, draws at the right frequencies."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from rlhf.models.sampling import SamplingParams, filter_logits, sample_tokens

V = 12


def hf_filtered(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """Hugging Face's temperature -> top-k -> top-p chain, the reference for ``filter_logits``."""
    if sampling.temperature != 1.0:
        logits = TemperatureLogitsWarper(sampling.temperature)(None, logits)
    if sampling.top_k > 0:
        logits = TopKLogitsWarper(sampling.top_k)(None, logits)
    if sampling.top_p < 1.0:
        logits = TopPLogitsWarper(sampling.top_p)(None, logits)
    return logits


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(top_k=3), SamplingParams(top_p=0.7),
                                      SamplingParams(top_k=5, top_p=0.8, temperature=0.7),
                                      SamplingParams(temperature=1.6)], ids=str)
def test_filter_logits_matches_hugging_face_warpers(sampling: SamplingParams) -> None:
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0)) * 2
    torch.testing.assert_close(filter_logits(logits, sampling), hf_filtered(logits.clone(), sampling))


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(top_k=3), SamplingParams(top_p=0.6)], ids=str)
def test_draws_follow_the_filtered_distribution(sampling: SamplingParams) -> None:
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(1)) * 1.5
    probs = hf_filtered(logits.clone(), sampling).softmax(-1)[0]
    torch.manual_seed(0)
    n = 40_000
    draws = sample_tokens(logits.expand(n, V), sampling)
    freq = torch.bincount(draws, minlength=V).double() / n
    assert (freq[probs == 0] == 0).all()  # a filtered-out token is never drawn
    # 5 standard errors of a binomial frequency: fails for a biased sampler, not for noise
    tolerance = 5 * (probs.double() * (1 - probs.double()) / n).sqrt() + 1e-9
    assert ((freq - probs.double()).abs() <= tolerance).all(), (freq, probs)


def test_top_k_one_is_greedy_and_draws_nothing() -> None:
    logits = torch.randn(8, V, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    state = torch.get_rng_state()
    assert torch.equal(sample_tokens(logits, SamplingParams(top_k=1)), logits.argmax(-1))
    assert torch.equal(torch.get_rng_state(), state)
