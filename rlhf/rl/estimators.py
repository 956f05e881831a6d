"""The advantage estimators' records: what each needs and leaves unused, read by the params validation and ``--help``
without loading torch (a switched-off stage validates its params and stops), and by the trainer, whose call
``ESTIMATORS[name].advantages`` is the function in rlhf/rl/advantages.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlhf.rl.advantages import Advantages

# the ppo.* keys only a value head reads
CRITIC_KEYS = ("value_model", "vf_coef", "cliprange_value", "value_learning_rate")
GROUP_IGNORES = ("gamma", "lam", "whiten_rewards")


@dataclass(frozen=True)
class Estimator:
    """``name``: its ppo.advantage_estimator value; ``doc``: what the advantage is, and whose; ``trains_critic``:
    learns a value head (GAE); ``min_samples_per_prompt``: the k its baseline needs (the prompt's other samples);
    ``kl_loss``: accepts GRPO's KL loss term (ppo.kl_loss_coef > 0); ``needs_kl_coef``: reads R / kl_coef as a log
    importance weight (ppo.init_kl_coef > 0, ppo.kl_penalty kl); ``reward_units``: its advantages are the rewards'
    times one factor per batch (advantages.reward_scale), as ppo.kl_penalty exact needs; ``ignores``: the ppo.* keys
    it leaves unused besides the critic's."""

    name: str
    doc: str
    trains_critic: bool = False
    min_samples_per_prompt: int = 1
    kl_loss: bool = False
    needs_kl_coef: bool = False
    reward_units: bool = True
    ignores: tuple[str, ...] = ()

    @property
    def advantages(self) -> Advantages:
        """The estimator's function (imported here: it loads torch)."""
        from rlhf.rl.advantages import ADVANTAGES

        return ADVANTAGES[self.name]

    @property
    def unused_keys(self) -> tuple[str, ...]:
        return (() if self.trains_critic else CRITIC_KEYS) + self.ignores

    @property
    def summary(self) -> str:
        """One line for the params docs: the doc and the rules."""
        rules = [f"k >= {self.min_samples_per_prompt}"] if self.min_samples_per_prompt > 1 else []
        rules += ["kl_loss_coef allowed"] if self.kl_loss else []
        rules += ["init_kl_coef > 0, kl_penalty kl"] if self.needs_kl_coef else []
        return f"{self.doc}; {'value head' if self.trains_critic else 'no critic'}" + "".join(f", {r}" for r in rules)


ESTIMATORS = {e.name: e for e in (
    Estimator("gae", "PPO's value head and GAE (Schulman et al. 2016)", trains_critic=True),
    Estimator("rloo", "R_i minus the mean R of the prompt's other k - 1 samples (Ahmadian et al. 2024)",
              min_samples_per_prompt=2, ignores=GROUP_IGNORES),
    Estimator("grpo", "(R_i - mean of the prompt's k samples) / (their std + 1e-4) (Shao et al. 2024)",
              min_samples_per_prompt=2, kl_loss=True, reward_units=False, ignores=GROUP_IGNORES),
    Estimator("dr_grpo", "R_i - mean of the prompt's k samples: GRPO without the std (Dr. GRPO, Liu et al. 2025)",
              min_samples_per_prompt=2, kl_loss=True, ignores=GROUP_IGNORES),
    Estimator("dpg", "k softmax(R / kl_coef) over the prompt's k samples - 1: the forward-KL gradient toward pi_ref "
                     "exp(r / kl_coef) (conditional DPG, Korbak et al. 2022)", min_samples_per_prompt=2,
              needs_kl_coef=True, reward_units=False, ignores=GROUP_IGNORES),
    Estimator("reinforce_pp", "the discounted return-to-go of the per-token rewards, whitened over the batch "
                              "(REINFORCE++, Hu 2025)", ignores=("lam", "whiten_rewards")),
)}
