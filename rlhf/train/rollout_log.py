"""The rollout log: one Parquet row per sample per PPO step, one file per chunk of steps under data/rollouts/.

Files are written atomically and never appended to, so a killed run leaves only complete files behind and
``pd.read_parquet("data/rollouts")`` reads the whole log.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from rlhf.pipeline.io import write_parquet
from rlhf.rl import ppo
from rlhf.train.ppo_trainer import Rollout

ROLLOUT_SCHEMA = pa.schema([
    ("step", pa.int32()),
    ("query", pa.string()),
    ("response", pa.string()),
    ("response_length", pa.int32()),
    ("score", pa.float32()),
    ("kl", pa.float32()),  # sum over the response tokens of the per-token KL estimate
    ("non_score_reward", pa.float32()),  # sum over the response tokens of -kl_coef * KL
    ("value_mean", pa.float32()),  # NaN without a critic (ppo.advantage_estimator other than gae)
    ("advantage_mean", pa.float32()),
    ("kl_coef", pa.float32()),
])


def rollout_rows(step: int, rollout: Rollout, kl_coef: float) -> dict[str, list]:
    exp, mask, n = rollout.experience, rollout.masks, len(rollout.queries)
    values = ppo.masked_mean(exp.values, mask, dim=1).tolist() if exp.values is not None else [float("nan")] * n
    return {
        "step": [step] * n,
        "query": rollout.queries,
        "response": rollout.responses,
        "response_length": mask.sum(1).tolist(),
        "score": rollout.scores.tolist(),
        "kl": rollout.kl.sum(1).tolist(),
        "non_score_reward": rollout.non_score_reward.sum(1).tolist(),
        "value_mean": values,
        "advantage_mean": ppo.masked_mean(exp.advantages, mask, dim=1).tolist(),
        "kl_coef": [kl_coef] * n,
    }


class RolloutWriter:
    """Buffers rows and writes ``steps-<first>-<last>.parquet`` on ``flush``."""

    def __init__(self, folder: Path | str) -> None:
        self.folder = Path(folder)
        self.rows: dict[str, list] = {name: [] for name in ROLLOUT_SCHEMA.names}

    def add(self, rows: dict[str, list]) -> None:
        for name, values in rows.items():
            self.rows[name].extend(values)

    def flush(self) -> None:
        if not self.rows["step"]:
            return
        first, last = self.rows["step"][0], self.rows["step"][-1]
        table = pa.table(self.rows, schema=ROLLOUT_SCHEMA)
        write_parquet(table, self.folder / f"steps-{first:06d}-{last:06d}.parquet")
        self.rows = {name: [] for name in ROLLOUT_SCHEMA.names}
