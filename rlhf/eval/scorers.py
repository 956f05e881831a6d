"""What evaluate and optimum score with: the training reward and the independent judges, from the params."""

from __future__ import annotations

import torch

from rlhf.data.prompts import Prompts
from rlhf.models.reward_functions import load_functions
from rlhf.models.scorers import REWARD, Scorer, make_reward_scorer, make_scorer
from rlhf.pipeline.params import Params, reward_model
from rlhf.pipeline.wiring import wiring


def load_scorers(params: Params, prompts: Prompts, stage: str, device: torch.device,
                 max_tokens: int) -> dict[str, Scorer]:
    """The training reward (REWARD, its functions checked against ``stage``'s deps and tried on ``prompts``) and each
    of evaluate.judges under its name, each loaded (or refused naming its key) before any sampling, reading at most
    ``max_tokens`` tokens a text and scoring evaluate.batch_size texts a forward pass."""
    functions = load_functions(params.reward.functions, prompts, stage, wiring(stage).deps)
    label, batch_size = params.reward.positive_label, params.evaluate.batch_size
    scorers = {REWARD: make_reward_scorer(functions, *reward_model(params), label, params.model, device, max_tokens,
                                          batch_size)}
    for i, (name, spec) in enumerate(zip(params.evaluate.judge_names, params.evaluate.judges, strict=True)):
        scorers[name] = make_scorer(spec, params.model, label, device, f"evaluate.judges[{i}]", max_tokens,
                                    batch_size)
    return scorers
