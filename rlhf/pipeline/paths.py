"""The files and folders that more than one stage or library module reads or writes (a stage's own outputs, read by
nothing else, are named in its script), the staging and checkpoint layout, and the one rule for "is this a local
path?". Paths are relative to the project root, where DVC runs the stages; dvc.yaml wires them."""

from __future__ import annotations

from pathlib import Path

SPLITS = ("train", "test", "unsupervised")  # the IMDb splits a data source holds (a folder: <split>.parquet)
RAW = Path("data/raw")  # local inputs DVC watches (prepare and sft list it as a dependency)
RAW_IMDB, RAW_TOKENIZER = RAW / "imdb", RAW / "gpt2-tokenizer"  # where the presets put their local inputs
TOKENS_DIR = Path("data/tokens")  # the SFT corpus's ids (rlhf/data/tokens.py), made by tokenize, read by sft
PROMPTS_DIR = Path("data/prompts")
TRAIN_PROMPTS, EVAL_PROMPTS = PROMPTS_DIR / "train.parquet", PROMPTS_DIR / "eval.parquet"
PAIRS_DIR = Path("data/pairs")
TRAIN_PAIRS, TEST_PAIRS = PAIRS_DIR / "train.parquet", PAIRS_DIR / "test.parquet"
SAMPLED_PAIRS_DIR = Path("data/sampled_pairs")
SAMPLED_TRAIN_PAIRS, SAMPLED_TEST_PAIRS = SAMPLED_PAIRS_DIR / "train.parquet", SAMPLED_PAIRS_DIR / "test.parquet"
REF_LOGPROBS_DIR = Path("data/ref_logprobs")  # the reference's log-probs of the pairs dpo trains on
ROLLOUTS_DIR = Path("data/rollouts")
PPO_CURVES = Path("metrics/ppo")  # DVCLive's folder
SFT_DIR, REWARD_DIR = Path("models/sft"), Path("models/reward")
POLICIES = {"ppo": Path("models/policy"), "dpo": Path("models/dpo")}  # each training method's (best_of_n: none)
POLICY_DIR, DPO_DIR = POLICIES["ppo"], POLICIES["dpo"]
OPTIMUM_POOL, OPTIMUM_METRICS = Path("data/optimum/pool.parquet"), Path("metrics/optimum.json")
OPTIMUM_CURVE = Path("metrics/optimum/curve.csv")  # read by the frontier from each experiment's commit
OPTIMUM_BEST_OF_N = Path("metrics/optimum/best_of_n.csv")

CHECKPOINTS_DIR = Path("data/checkpoints")  # not a DVC output: DVC deletes outputs before rerunning a stage
CHECKPOINT_PREFIX = "step-"  # CHECKPOINTS_DIR/<stage>/step-NNNNNN: one checkpoint (rlhf/train/checkpoint.py)
STAGED = ".staged"


def staging_path(output: Path) -> Path:
    """Where a stage writes ``output`` until it completes: a hidden sibling (``models/.policy.staged``), on the same
    file system, so that moving it into place is a rename."""
    return output.parent / f".{output.name}{STAGED}"


def output_path(path: Path) -> Path:
    """The output a (possibly staged) path stands for: each ``.<name>.staged`` component read as ``<name>``."""
    return Path(*(part[1:-len(STAGED)] if part.startswith(".") and part.endswith(STAGED) else part
                  for part in path.parts))


def checkpoint_dir(stage: str) -> Path:
    return CHECKPOINTS_DIR / stage


def checkpoints(folder: Path) -> list[Path]:
    """Complete checkpoints in ``folder``, oldest first (temporaries start with a dot and are never listed)."""
    return sorted(folder.glob(f"{CHECKPOINT_PREFIX}[0-9]*")) if folder.is_dir() else []


def is_local(value: str) -> bool:
    """Whether a model or data value names a local path rather than a Hub id ('gpt2', 'org/name', not checkable
    offline): one that exists, starts with '.', '/' or '~', holds more than one '/' or ends in a table suffix."""
    return (Path(value).expanduser().exists() or value.startswith((".", "/", "~")) or value.count("/") > 1
            or Path(value).suffix.lower() in (".parquet", ".csv", ".jsonl"))
