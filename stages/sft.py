"""sft: a causal LM trained (from scratch or from sft.base) on IMDb text, the offline recipe's policy.

Reads   data/tokens/ (the tokenize stage's ids of the sft.splits reviews and of the held-out ones), the tokenizer
Writes  models/sft/           HF model (safetensors) + tokenizer + generation config; only a DISABLED marker when
                              sft.enabled is false
        metrics/sft.json      held-out perplexity, final loss, tokens, tokens/s
        metrics/sft/loss.csv  the training loss curve (DVC plot)
        metrics/sft/system.csv  CPU, memory and GPU use while training (rlhf/train/system_use.py)
The outputs are replaced together when the stage completes, or not at all (rlhf/pipeline/io.py's StagedOutputs).
"""

from __future__ import annotations

import logging
from pathlib import Path

from rlhf.pipeline.cli import run_stage
from rlhf.pipeline.io import StagedOutputs, run_switchable, write_json, write_text
from rlhf.pipeline.params import Params, load_params
from rlhf.pipeline.paths import SFT_DIR
from rlhf.train.system_use import HEADER as SYSTEM_HEADER

EVAL_BATCH = 16

STAGE = "sft"
SFT_METRICS = Path("metrics/sft.json")
SFT_LOSS = Path("metrics/sft/loss.csv")
SFT_SYSTEM = Path("metrics/sft/system.csv")
# what to lower when the GPU runs out of memory
OUT_OF_MEMORY = "lower sft.batch_size (and raise sft.gradient_accumulation_steps to keep the same batch)"


def main() -> None:
    params = load_params(STAGE)
    run_switchable(STAGE, params.sft.enabled, lambda outputs: train_sft(params, outputs), SFT_DIR,
                   "sft.enabled is false: ppo and evaluate use model.policy",
                   {SFT_METRICS: '{"sft": {"trained": false}}\n', SFT_LOSS: "step,loss\n",
                    SFT_SYSTEM: SYSTEM_HEADER})


def train_sft(params: Params, outputs: StagedOutputs) -> None:
    # imported here: switched off, the stage loads none of it (stages/__init__.py)
    from rlhf.data.tokens import corpus_key, read_tokens
    from rlhf.models.devices import pick_device
    from rlhf.models.loading import check_vocab_match, load_tokenizer, save_pretrained
    from rlhf.train.checkpoint import weights_bytes
    from rlhf.train.compiled import step_metrics
    from rlhf.train.rng import seed_everything
    from rlhf.train.sft import build_model, compiled_step, label_blocks, pack, perplexity, tokens_per_step, train
    from rlhf.train.system_use import SystemUse

    s = params.sft
    # before anything loads: tokens of other params stop here
    train_ids, train_labels, test_ids = read_tokens(corpus_key(params))
    blocks = pack(train_ids, s.block_size, "the training text")
    labels = label_blocks(train_labels, s)
    held_out = pack(test_ids, s.block_size, "the held-out text")
    generator = seed_everything(params.seed)
    tokenizer = load_tokenizer(params.tokenizer_path, params.model, what="model.tokenizer")
    lm = build_model(params, tokenizer)
    check_vocab_match(tokenizer, lm, "model.tokenizer")
    device = pick_device()
    step = compiled_step(params, device)  # one that cannot run fails here, before training
    outputs.check_free_space(SFT_DIR, weights_bytes(lm))

    lm.to(device)
    with outputs.steps(), SystemUse(device) as system:
        result = train(lm, blocks, params, device, generator, step, labels)
    ppl = perplexity(lm, held_out, EVAL_BATCH, device)
    save_pretrained(lm, tokenizer, outputs[SFT_DIR])
    tail, tokens = result.losses[-20:], len(result.losses) * tokens_per_step(s)
    write_json({"sft": {"trained": True, "perplexity": round(ppl, 3), "train_loss": round(sum(tail) / len(tail), 4),
                        "tokens": tokens, "tokens_per_s": round(tokens / result.seconds, 1),
                        "seconds": round(result.seconds, 1), "parameters": lm.num_parameters(),
                        "system": system.summary(),
                        "compile": step_metrics(step)}}, outputs[SFT_METRICS])
    system.write(outputs[SFT_SYSTEM])
    write_text("step,loss\n" + "".join(f"{step},{loss:.5f}\n" for step, loss in enumerate(result.losses)),
               outputs[SFT_LOSS])
    logging.getLogger("sft").info("sft: held-out perplexity %.2f after %d tokens", ppl, tokens)


if __name__ == "__main__":
    run_stage(main, OUT_OF_MEMORY)
