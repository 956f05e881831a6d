"""The files and folders the stages write and read, and the one rule for "is this a local path?". Paths are relative
to the project root, where DVC runs the stages; dvc.yaml wires them (a stage writes only what its entry there lists).
"""

from __future__ import annotations

from pathlib import Path

SPLITS = ("train", "test", "unsupervised")  # the IMDb splits a data source holds (a folder: <split>.parquet)
RAW = Path("data/raw")  # local inputs DVC watches (prepare and sft list it as a dependency)
RAW_IMDB, RAW_TOKENIZER = RAW / "imdb", RAW / "gpt2-tokenizer"  # where the presets read their local inputs
PROMPTS_DIR = Path("data/prompts")
TRAIN_PROMPTS = PROMPTS_DIR / "train.parquet"
EVAL_PROMPTS = PROMPTS_DIR / "eval.parquet"
PAIRS_DIR = Path("data/pairs")
TRAIN_PAIRS = PAIRS_DIR / "train.parquet"
TEST_PAIRS = PAIRS_DIR / "test.parquet"
SAMPLED_PAIRS_DIR = Path("data/sampled_pairs")
SAMPLED_TRAIN_PAIRS = SAMPLED_PAIRS_DIR / "train.parquet"
SAMPLED_TEST_PAIRS = SAMPLED_PAIRS_DIR / "test.parquet"
REF_LOGPROBS_DIR = Path("data/ref_logprobs")  # the reference's log-probs of the pairs dpo trains on
ROLLOUTS_DIR = Path("data/rollouts")
EVAL_DIR = Path("data/eval")
EVAL_SAMPLES = EVAL_DIR / "samples.parquet"
CHECKPOINTS_DIR = Path("data/checkpoints")  # not a DVC output: DVC deletes outputs before rerunning a stage
CHECKPOINT_PREFIX = "step-"  # CHECKPOINTS_DIR/<stage>/step-NNNNNN: one checkpoint (rlhf/train/checkpoint.py)

SFT_DIR = Path("models/sft")
REWARD_DIR = Path("models/reward")
POLICY_DIR = Path("models/policy")
DPO_DIR = Path("models/dpo")
POLICIES = {"ppo": POLICY_DIR, "dpo": DPO_DIR}  # the policy each training method writes (best_of_n trains none)

PREPARE_METRICS = Path("metrics/prepare.json")
SFT_METRICS = Path("metrics/sft.json")
SFT_LOSS = Path("metrics/sft/loss.csv")
REWARD_METRICS = Path("metrics/reward.json")
REWARD_SCORES = Path("metrics/reward/scores.csv")
PPO_METRICS = Path("metrics/ppo.json")
PPO_CURVES = Path("metrics/ppo")  # DVCLive's folder
DPO_METRICS = Path("metrics/dpo.json")
DPO_CURVES = Path("metrics/dpo")
EVAL_METRICS = Path("metrics/eval.json")
EVAL_REPORT_DIR = Path("metrics/evaluate")
EVAL_REPORT = EVAL_REPORT_DIR / "report.md"
EVAL_HISTOGRAM = EVAL_REPORT_DIR / "score_histogram.csv"
OPTIMUM_POOL = Path("data/optimum/pool.parquet")
OPTIMUM_METRICS = Path("metrics/optimum.json")
OPTIMUM_CURVE = Path("metrics/optimum/curve.csv")  # read by the frontier from each experiment's commit
OPTIMUM_BEST_OF_N = Path("metrics/optimum/best_of_n.csv")

STAGED = ".staged"


def staging_path(output: Path) -> Path:
    """Where a stage writes ``output`` until it completes: a hidden sibling (``models/.policy.staged``), on the same
    file system, so that moving it into place is a rename."""
    return output.parent / f".{output.name}{STAGED}"


def output_path(path: Path) -> Path:
    """The output a (possibly staged) path stands for, as the user knows it: every ``.<name>.staged`` component
    read as ``<name>`` (``data/.rollouts.staged/steps-0-9.parquet`` -> ``data/rollouts/steps-0-9.parquet``)."""
    return Path(*(part[1:-len(STAGED)] if part.startswith(".") and part.endswith(STAGED) else part
                  for part in path.parts))


def checkpoint_dir(stage: str) -> Path:
    """Where stage ``stage`` keeps its resumable checkpoints (outside DVC's outputs: DVC deletes those before a
    rerun)."""
    return CHECKPOINTS_DIR / stage


def checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints in ``folder``, oldest first (temporaries start with a dot and are never listed)."""
    return sorted(folder.glob(f"{CHECKPOINT_PREFIX}[0-9]*")) if folder.is_dir() else []


LOCAL_SUFFIXES = (".parquet", ".csv", ".jsonl")


def is_local(value: str) -> bool:
    """Whether a model or data value names a local path rather than a Hub id.

    An existing path is local; so is a value only a path can look like: starting with '.', '/' or '~', holding more
    than one '/', or ending in a table suffix (.parquet, .csv, .jsonl). Anything else ('gpt2', 'org/name') is a Hub
    id, which cannot be checked offline.
    """
    return (Path(value).expanduser().exists() or value.startswith((".", "/", "~")) or value.count("/") > 1
            or Path(value).suffix.lower() in LOCAL_SUFFIXES)
