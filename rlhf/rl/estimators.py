"""The advantage estimators of ``ppo.advantage_estimator``, one record each: read by the params validation, by the
list of keys an estimator leaves unused, and by the dispatch (``rlhf.rl.advantages.estimate_advantages`` calls
the estimator's function, ``<name>_advantages`` in rlhf/rl/advantages.py).

Pure data with no torch: the params validation of every stage reads it, and a stage's code deps are what it imports,
so the math stays out of prepare's and sft's deps. Adding an estimator: its function in rlhf/rl/advantages.py, its
record here, its test.
"""

from __future__ import annotations

from dataclasses import dataclass

CRITIC_KEYS = ("value_model", "vf_coef", "cliprange_value")  # the ppo.* keys only a value head reads


@dataclass(frozen=True)
class Estimator:
    """``doc``: what the advantage is, and whose (``--help`` and the params docs list it); ``trains_critic``: learns a
    value head (GAE); ``min_samples_per_prompt``: the k its baseline needs (the prompt's other samples); ``kl_loss``:
    accepts GRPO's KL loss term (ppo.kl_loss_coef > 0); ``ignores``: the ppo.* keys it leaves unused besides the
    critic's."""

    doc: str
    trains_critic: bool
    min_samples_per_prompt: int = 1
    kl_loss: bool = False
    ignores: tuple[str, ...] = ()

    @property
    def unused_keys(self) -> tuple[str, ...]:
        return (() if self.trains_critic else CRITIC_KEYS) + self.ignores

    @property
    def summary(self) -> str:
        """One line for the params docs: the doc and the rules."""
        rules = [f"k >= {self.min_samples_per_prompt}"] if self.min_samples_per_prompt > 1 else []
        rules += ["kl_loss_coef allowed"] if self.kl_loss else []
        return f"{self.doc}; {'value head' if self.trains_critic else 'no critic'}" + "".join(f", {r}" for r in rules)


ESTIMATORS = {
    "gae": Estimator("PPO's value head and GAE (Schulman et al. 2016)", trains_critic=True),
    "rloo": Estimator("R_i minus the mean R of the prompt's other k - 1 samples (Ahmadian et al. 2024)",
                      trains_critic=False, min_samples_per_prompt=2, ignores=("gamma", "lam", "whiten_rewards")),
    "grpo": Estimator("(R_i - mean of the prompt's k samples) / (their std + 1e-4) (Shao et al. 2024)",
                      trains_critic=False, min_samples_per_prompt=2, kl_loss=True,
                      ignores=("gamma", "lam", "whiten_rewards")),
    "dr_grpo": Estimator("R_i - mean of the prompt's k samples: GRPO without the std (Dr. GRPO, Liu et al. 2025)",
                         trains_critic=False, min_samples_per_prompt=2, kl_loss=True,
                         ignores=("gamma", "lam", "whiten_rewards")),
    "reinforce_pp": Estimator("the discounted return-to-go of the per-token rewards, whitened over the batch "
                              "(REINFORCE++, Hu 2025)", trains_critic=False, ignores=("lam", "whiten_rewards")),
}
