"""model.gradient_checkpointing (``policy.checkpoint_activations``): the update's backward recomputes the blocks of
the policy and of a separate critic, and its gradients are those without it."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from rlhf.models.loading import load_causal_lm
from rlhf.models.policy import PolicyWithValueHead, checkpoint_activations, disable_dropout
from rlhf.models.rollout import Samples, forward
from rlhf.pipeline.params import defaults


@pytest.mark.parametrize("value_model", ["shared", "separate"])
def test_recomputed_activations_give_the_same_gradients(tiny_gpt2_dir: Path, value_model: str) -> None:
    torch.manual_seed(0)
    lm = load_causal_lm(str(tiny_gpt2_dir), defaults().model)
    disable_dropout(lm)
    plain = PolicyWithValueHead(lm, value_model)
    recomputed = copy.deepcopy(plain)
    checkpoint_activations(recomputed)
    ids = torch.randint(0, lm.config.vocab_size, (4, 10), generator=torch.Generator().manual_seed(1))
    responses = torch.ones(4, 6, dtype=torch.bool)
    samples = Samples(ids, torch.ones_like(ids), 4, responses, torch.zeros(4, dtype=torch.bool))
    # an inner module of each block, entered again by the recompute (transformers checkpoints the block's forward,
    # inside its hooks; the recompute stops once it has what the backward needs, before the block's last hooks)
    mlp_calls = []
    for block in (*recomputed.lm.transformer.h, *(recomputed.critic.h if recomputed.critic is not None else ())):
        block.mlp.register_forward_pre_hook(lambda *_: mlp_calls.append(1))

    def gradients(policy: PolicyWithValueHead) -> dict[str, torch.Tensor]:
        policy.train()
        out = forward(policy, samples, 1.0)
        (out.logprobs.sum() + out.values.square().sum()).backward()
        return {name: p.grad for name, p in policy.named_parameters()}

    expected = gradients(plain)
    forward_calls = 2 * lm.config.n_layer if value_model == "separate" else lm.config.n_layer
    got = gradients(recomputed)
    assert len(mlp_calls) == 2 * forward_calls  # each block ran again in the backward
    assert got.keys() == expected.keys()
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-6, atol=1e-7, msg=name)
