"""Direct preference optimisation: the policy trained on (prompt, chosen, rejected) pairs by DPO or IPO
(rlhf/rl/preference.py) through the project's one training loop (rlhf/train/fit.py), against a frozen reference
whose log-probs of each pair set are computed once, by the ref_logprobs stage (``with_reference``), and kept as a
DVC output: they depend on the pairs, the reference and dpo.max_length only, so runs that differ in anything else
(beta, tau, the loss, the schedule, the seed) read the same file, checked by ``reference_key``.

What a pair's prompt is. Sampled pairs (rlhf/data/sampled_pairs.py) carry the prompt their two completions continue.
prepare's pairs are the openings of two different reviews, a positive and a negative one, which share no prompt: their
prompt is empty, the tokenizer's BOS token alone, so each side is a continuation of nothing and log pi(y) is the
policy's log-probability of the whole opening, the text the reward model scores for the same pair. Their shared
character prefix would be an accident of the two reviews (mostly empty, else a word like "This"), and a cut at a
character can split a token.

A batch holds each pair's chosen and rejected response as two rows of one forward pass, in rollout's layout
(rlhf/models/rollout.py): prompts left-padded, responses right-padded, the log-probs those of the response tokens.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.data.pairs import read_pairs
from rlhf.models.loading import context_size
from rlhf.models.policy import disable_dropout
from rlhf.models.precision import autocast
from rlhf.models.rollout import Samples, forward, left_pad
from rlhf.pipeline.errors import DataError, ModelError
from rlhf.pipeline.io import DISABLED_MARKER, write_parquet, write_text
from rlhf.pipeline.params import Params, initial_policy
from rlhf.pipeline.paths import (
    PAIRS_DIR,
    REF_LOGPROBS_DIR,
    SAMPLED_PAIRS_DIR,
    SAMPLED_TEST_PAIRS,
    SAMPLED_TRAIN_PAIRS,
    TEST_PAIRS,
    TRAIN_PAIRS,
)
from rlhf.pipeline.sections import DpoParams
from rlhf.rl import preference as pref
from rlhf.train import checkpoint
from rlhf.train.batches import ShuffledBatches
from rlhf.train.fit import FitPlan, FitResult, fit

SECTION = "dpo"  # the params section: messages name its keys, checkpoints live in data/checkpoints/dpo/
PAIR_FILES = {"prepare": (PAIRS_DIR, TRAIN_PAIRS, TEST_PAIRS),
              "sampled": (SAMPLED_PAIRS_DIR, SAMPLED_TRAIN_PAIRS, SAMPLED_TEST_PAIRS)}  # dpo.pairs -> its files
REF_FILES = (REF_LOGPROBS_DIR / "train.parquet", REF_LOGPROBS_DIR / "test.parquet")  # row for row the pairs'
REF_KEY = b"reference_key"  # the Parquet metadata entry holding ``reference_key``
EVAL_POINTS = 10  # held-out evaluations a run, evenly spaced (the last after the last step)


@dataclass
class PairSet:
    """Token ids of every pair; ``ref_logprobs`` (N, 2): the reference's sequence log-probs of (chosen, rejected),
    once ``with_reference`` has computed them."""

    prompts: list[list[int]]
    chosen: list[list[int]]
    rejected: list[list[int]]
    ref_logprobs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.prompts)


def read_pair_files(source: str, batch_size: int | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The (train, test) pairs of ``source`` (dpo.pairs), checked before any model loads: against the dpo stage's
    ``batch_size`` too, unless None."""
    folder, *files = PAIR_FILES[source]
    if (folder / DISABLED_MARKER).exists():
        raise DataError(f"{folder}: holds no pairs (run the sample_pairs stage with method dpo and dpo.pairs "
                        f"{source})")
    train, test = (read_pairs(path) for path in files)
    if batch_size is not None and len(train) < batch_size:
        raise DataError(f"{files[0]}: {len(train)} pairs, fewer than {SECTION}.batch_size={batch_size}")
    return train, test


def check_context(lm: PreTrainedModel, max_length: int, what: str) -> None:
    """dpo.max_length must fit the positions of the policy ``what``."""
    if max_length > context_size(lm):
        raise ModelError(f"{SECTION}.max_length: {max_length} exceeds {what}'s {context_size(lm)} positions")


def reference_key(params: Params) -> str:
    """What the reference's log-probs of dpo.pairs depend on: the ref_logprobs stage's params, the pair files, the
    reference and its tokenizer, and the code. The dpo stage reads them only under the key they were written with."""
    initial = initial_policy(params)
    return checkpoint.fingerprint("ref_logprobs", params, [PAIR_FILES[params.dpo.pairs][0], initial.path,
                                                           initial.tokenizer])


def write_reference(ref_logprobs: torch.Tensor, path: Path, key: str) -> None:
    """(N, 2) reference log-probs of (chosen, rejected) as a Parquet file of two columns, under ``key``."""
    table = pa.table({"chosen": ref_logprobs[:, 0].numpy(), "rejected": ref_logprobs[:, 1].numpy()})
    write_parquet(table.replace_schema_metadata({REF_KEY: key}), path)


def read_reference(key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The (train, test) (N, 2) reference log-probs the ref_logprobs stage wrote, if written under ``key``: cheap,
    so checked before any model loads."""
    if (REF_LOGPROBS_DIR / DISABLED_MARKER).exists() or not all(path.is_file() for path in REF_FILES):
        raise DataError(f"{REF_LOGPROBS_DIR}: holds no reference log-probs (run the ref_logprobs stage with method "
                        "dpo)")
    tensors = []
    for path in REF_FILES:
        table = pq.read_table(path)
        if (table.schema.metadata or {}).get(REF_KEY) != key.encode():
            raise DataError(f"{path}: the log-probs of other pairs, another reference or another "
                            f"{SECTION}.max_length (run the ref_logprobs stage again: dvc repro)")
        tensors.append(torch.stack([torch.tensor(table[side].to_numpy()) for side in ("chosen", "rejected")], 1))
    return tensors[0], tensors[1]


class History:
    """Every step's stats, and the held-out ones at EVAL_POINTS steps. While a run can resume they are also appended
    to ``file`` beside its checkpoints: a killed run's staged outputs are deleted, and a resumed run reads back the
    steps before its checkpoint."""

    def __init__(self, steps: int, evaluate: Callable[[], dict[str, float]], file: Path | None) -> None:
        self.steps, self.evaluate, self.file = steps, evaluate, file
        self.eval_every = max(1, steps // EVAL_POINTS)
        self.rows: list[dict[str, float]] | None = None

    def read(self, step: int | None = None) -> list[dict[str, float]]:
        """The rows so far; first called at ``step`` (None: after the last, a run resumed from its final checkpoint),
        those of the steps before it that the run being resumed wrote."""
        if self.rows is None:
            step = self.steps if step is None else step
            earlier = self.file.read_text().splitlines() if step and self.file and self.file.exists() else []
            self.rows = [row for row in map(json.loads, earlier) if row["step"] < step]
            if self.file:
                for other in set(self.file.parent.glob("history-*.jsonl")) - {self.file}:  # other runs'
                    other.unlink()
                write_text("".join(json.dumps(row) + "\n" for row in self.rows), self.file)
        return self.rows

    def __call__(self, step: int, stats: dict[str, float]) -> None:
        self.read(step)
        row = {"step": step} | {f"train/{key}": value for key, value in stats.items()}
        if (step + 1) % self.eval_every == 0 or step + 1 == self.steps:
            row |= {f"eval/{key}": value for key, value in self.evaluate().items()}
        self.rows.append(row)
        if self.file:
            with self.file.open("a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")

    def write_curves(self, folder: Path) -> None:
        from rlhf.train.curves import open_curves  # dvclive's import is slow: only where curves are written

        with open_curves(folder, resume=False) as live:
            for row in self.read():
                for key, value in row.items():
                    if key != "step":
                        live.log_metric(key, value, plot=True)
                live.next_step()


def _token_ids(texts: list[str], tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]


def encode_pairs(frame: pd.DataFrame, tokenizer: PreTrainedTokenizerBase, max_length: int, where: str) -> PairSet:
    """Token ids of a pairs frame (``chosen``, ``rejected``, and ``prompt`` when the pairs have one; none or an empty
    one: the BOS token). Prompt and responses are tokenized apart, as they were sampled; a response is cut to the
    ``max_length`` tokens left after its prompt, and an empty one is the EOS it stopped at."""
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    texts = frame["prompt"].tolist() if "prompt" in frame else [""] * len(frame)
    prompts = [ids or [bos] for ids in _token_ids(texts, tokenizer)]
    for row, prompt in enumerate(prompts):
        if len(prompt) >= max_length:
            raise DataError(f"{where}: row {row}: the prompt is {len(prompt)} tokens, leaving no room for a response "
                            f"in {SECTION}.max_length={max_length}")
    sides = {}
    for side in ("chosen", "rejected"):
        ids = _token_ids(frame[side].tolist(), tokenizer)
        sides[side] = [(row or [tokenizer.eos_token_id])[: max_length - len(prompt)]
                       for row, prompt in zip(ids, prompts, strict=True)]
    return PairSet(prompts, sides["chosen"], sides["rejected"])


def pair_samples(pairs: PairSet, idx: list[int], tokenizer: PreTrainedTokenizerBase, device: torch.device) -> Samples:
    """The pairs ``idx`` as 2b rows: the b chosen responses, then the b rejected ones, each after its prompt."""
    prompts = [pairs.prompts[i] for i in idx] * 2
    responses = [pairs.chosen[i] for i in idx] + [pairs.rejected[i] for i in idx]
    queries, query_mask = left_pad(prompts, tokenizer.pad_token_id, device)
    R = max(map(len, responses))
    ids = torch.full((len(responses), R), tokenizer.pad_token_id, dtype=torch.long)
    for row, response in enumerate(responses):
        ids[row, : len(response)] = torch.tensor(response)
    ids = ids.to(device)
    response_mask = torch.arange(R, device=device) < torch.tensor(list(map(len, responses)), device=device)[:, None]
    has_eos = ((ids == tokenizer.eos_token_id) & response_mask).any(-1)
    return Samples(torch.cat([queries, ids], 1), torch.cat([query_mask, response_mask.long()], 1), queries.shape[1],
                   response_mask, has_eos)


@dataclass(frozen=True)
class PairModel:
    """A causal LM computing pairs' log-probs: its tokenizer, device and ``model.precision`` go where it goes."""

    lm: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    device: torch.device
    precision: str = "fp32"

    def logprobs(self, pairs: PairSet, idx: list[int]) -> torch.Tensor:
        """(2b,) sequence log-probs of the chosen then the rejected responses of the pairs ``idx``."""
        return sequence_logprobs(self.lm, pair_samples(pairs, idx, self.tokenizer, self.device), self.precision)


def sequence_logprobs(lm: PreTrainedModel, samples: Samples, precision: str) -> torch.Tensor:
    """(rows,) log pi(response | prompt) of every row, under ``model.precision``'s autocast (fp32 log-probs)."""
    with autocast(samples.query_responses.device, precision):
        out = forward(lm, samples, temperature=1.0)
    return pref.sequence_logprobs(out.logprobs, samples.response_mask)


@torch.no_grad()
def with_reference(pairs: PairSet, reference: PairModel, batch_size: int) -> PairSet:
    """``pairs`` with the reference's (N, 2) sequence log-probs of (chosen, rejected): one pass (the ref_logprobs
    stage's), for every epoch and every run on these pairs (the reference is frozen, so they never change)."""
    reference.lm.eval()
    parts = []
    for start in tqdm(range(0, len(pairs), batch_size), desc="reference log-probs", unit="batch"):
        idx = list(range(start, min(start + batch_size, len(pairs))))
        parts.append(reference.logprobs(pairs, idx).view(2, -1).T.cpu())
    return dataclasses.replace(pairs, ref_logprobs=torch.cat(parts))


def pair_losses(policy: PairModel, pairs: PairSet, idx: list[int], config: DpoParams) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """((b,) per-pair losses, (b, 2) policy sequence log-probs of (chosen, rejected)) of the pairs ``idx``."""
    logprobs = policy.logprobs(pairs, idx).view(2, -1).T
    ref = pairs.ref_logprobs[idx].to(policy.device)
    if config.loss == "dpo":
        losses = pref.dpo_loss(logprobs[:, 0], logprobs[:, 1], ref[:, 0], ref[:, 1], config.beta,
                               config.label_smoothing)
    else:
        losses = pref.ipo_loss(logprobs[:, 0], logprobs[:, 1], ref[:, 0], ref[:, 1], config.tau)
    if config.rpo_alpha:
        lengths = torch.tensor([len(pairs.chosen[i]) for i in idx], device=policy.device)
        losses = losses + config.rpo_alpha * pref.chosen_nll(logprobs[:, 0], lengths)
    return losses, logprobs


def _require_reference(pairs: PairSet, caller: str) -> None:
    if pairs.ref_logprobs is None:
        raise ValueError(f"{caller}: the pairs have no reference log-probs (compute them once with with_reference)")


def pair_stats(losses: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
               config: DpoParams) -> dict[str, float]:
    """Means over pairs of (N,) losses and of (N, 2) policy and reference sequence log-probs of (chosen, rejected):
    the loss, and named as TRL's DPOTrainer logs them, the implicit rewards of chosen and rejected, their accuracy
    and margin and the policy's log-probs; plus the log-ratios log pi / pi_ref of chosen and rejected."""
    logratios = logprobs - ref_logprobs
    coef = config.beta if config.loss == "dpo" else config.tau  # IPO's regulariser is tau KL
    chosen = pref.implicit_rewards(logprobs[:, 0], ref_logprobs[:, 0], coef)
    rejected = pref.implicit_rewards(logprobs[:, 1], ref_logprobs[:, 1], coef)
    return {
        "loss": losses.mean().item(),
        "rewards/chosen": chosen.mean().item(),
        "rewards/rejected": rejected.mean().item(),
        "rewards/accuracies": pref.reward_accuracy(chosen, rejected).item(),
        "rewards/margins": pref.reward_margin(chosen, rejected).item(),
        "logps/chosen": logprobs[:, 0].mean().item(),
        "logps/rejected": logprobs[:, 1].mean().item(),
        "logratios/chosen": logratios[:, 0].mean().item(),
        "logratios/rejected": logratios[:, 1].mean().item(),
    }


def total_steps(n_pairs: int, config: DpoParams) -> int:
    """Optimizer steps of a run over ``n_pairs`` training pairs: full batches only."""
    return config.epochs * (n_pairs // config.batch_size)


def train(policy: PairModel, pairs: PairSet, config: DpoParams, generator: torch.Generator,
          fingerprint: str | None = None, after_step: Callable[[int, dict[str, float]], None] | None = None
          ) -> FitResult:
    """``config.epochs`` passes over ``pairs`` (reference log-probs included), each in a fresh order drawn from
    ``generator``, by full batches. Dropout is switched off in ``lm``: a policy equal to the reference must give
    log-ratios of 0, not noise. With ``config.checkpoint_every`` and a ``fingerprint`` of what determines the run
    (``checkpoint.fingerprint``), a rerun after a kill resumes to the same result. ``after_step(step, stats)`` gets
    the ``pair_stats`` of each step's batch (fit.py says when it runs)."""
    _require_reference(pairs, "dpo.train")
    if len(pairs) < config.batch_size:
        raise DataError(f"{len(pairs)} training pairs, fewer than {SECTION}.batch_size={config.batch_size}")
    lm = policy.lm
    disable_dropout(lm)
    batch_stats: dict[str, float] = {}

    def loss(order: torch.Tensor) -> torch.Tensor:
        idx = order.tolist()
        losses, logprobs = pair_losses(policy, pairs, idx, config)
        batch_stats.update(pair_stats(losses.detach(), logprobs.detach().cpu(), pairs.ref_logprobs[idx], config))
        return losses.mean()

    checkpoints = bool(config.checkpoint_every) and fingerprint is not None
    plan = FitPlan(SECTION, total_steps(len(pairs), config), config.learning_rate,
                   config.warmup_steps, config.max_grad_norm, checkpoint_every=config.checkpoint_every,
                   fingerprint=fingerprint if checkpoints else None)
    trained = [p for p in lm.parameters() if p.requires_grad]  # every one but a LoRA model's frozen base
    return fit(lm, trained, loss, ShuffledBatches(len(pairs), config.batch_size, generator), plan,
               None if after_step is None else lambda step: after_step(step, dict(batch_stats)))


@torch.no_grad()
def evaluate(policy: PairModel, pairs: PairSet, config: DpoParams, batch_size: int = 64) -> dict[str, float]:
    """The ``pair_stats`` of held-out pairs."""
    _require_reference(pairs, "dpo.evaluate")
    lm = policy.lm
    was_training = lm.training
    lm.eval()
    losses, logprobs = [], []
    for start in range(0, len(pairs), batch_size):
        idx = list(range(start, min(start + batch_size, len(pairs))))
        batch_losses, batch_logprobs = pair_losses(policy, pairs, idx, config)
        losses.append(batch_losses.cpu())
        logprobs.append(batch_logprobs.cpu())
    lm.train(was_training)
    return pair_stats(torch.cat(losses), torch.cat(logprobs), pairs.ref_logprobs, config)
