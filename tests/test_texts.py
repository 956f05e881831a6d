"""The texts scorers read are what a reader sees (issue 54): a prompt whose last token cuts a multi-byte character
(an emoji) is stored by prepare without it, and the response's text, decoded with its prompt, starts with it whole;
"Great film 😀 loved it" cut inside the emoji is scored as "Great film " + "😀 loved it", not "Great film �" +
"� loved it". With a byte-level BPE built here, and with the real GPT-2 tokenizer where ../shared has it."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import SHARED
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from rlhf.data.prepare import Tokenized, build_pairs, build_prompts
from rlhf.models.rollout import Samples, decode_responses, left_pad

TEXT = "Great film 😀 loved it"
EMOJI = "😀"


def byte_level_bpe() -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE trained on words without the emoji, whose four bytes stay four tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(["Great film, loved it."] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def gpt2() -> PreTrainedTokenizerBase:
    if not (SHARED / "gpt2-tokenizer").is_dir():
        pytest.skip("../shared/gpt2-tokenizer is not present")
    tokenizer = AutoTokenizer.from_pretrained(SHARED / "gpt2-tokenizer")
    tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def texts_at_every_cut(tokenizer: PreTrainedTokenizerBase) -> list[tuple[str, str]]:
    """(prompt text, response text) for TEXT cut after each of its tokens: the prompt as prepare stores it, the
    response (the review's remaining tokens, then EOS) as PPO and evaluation decode it, in one left-padded batch."""
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    cuts = range(1, len(ids))
    reviews = Tokenized(pd.DataFrame({"review_id": [f"r{cut}" for cut in cuts], "label": 1}),
                        [ids] * len(cuts), tokenizer)
    prompts = [build_prompts(reviews, None, (cut, cut), np.random.default_rng(0)).to_pylist()[cut - 1]
               for cut in cuts]
    queries, query_ids = [p["query"] for p in prompts], [p["input_ids"] for p in prompts]
    assert query_ids == [ids[:cut] for cut in cuts]
    responses = [ids[cut:] + [tokenizer.eos_token_id] for cut in cuts]
    R = max(map(len, responses))
    padded = torch.tensor([r + [tokenizer.pad_token_id] * (R - len(r)) for r in responses])
    response_mask = torch.tensor([[i < len(r) for i in range(R)] for r in responses])
    prompt_tokens, prompt_mask = left_pad(query_ids, tokenizer.pad_token_id, torch.device("cpu"))
    samples = Samples(torch.cat([prompt_tokens, padded], 1), torch.cat([prompt_mask, response_mask.long()], 1),
                      prompt_tokens.shape[1], response_mask, torch.ones(len(cuts), dtype=torch.bool))
    return list(zip(queries, decode_responses(tokenizer, samples), strict=True))


@pytest.mark.parametrize("make", [byte_level_bpe, gpt2], ids=["tiny-byte-level-bpe", "gpt2"])
def test_a_prompt_cut_inside_a_character_is_read_whole(make) -> None:
    tokenizer = make()
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    inside = [cut for cut in range(1, len(ids)) if "\ufffd" in tokenizer.decode(ids[:cut])]
    assert inside, "no cut falls inside the emoji: the test would show nothing"
    for cut, (query, response) in enumerate(texts_at_every_cut(tokenizer), 1):
        assert query + response == TEXT, (cut, query, response)
        assert "\ufffd" not in query + response
        if cut in inside:
            assert (query, response) == ("Great film ", f"{EMOJI} loved it"), cut
    if make is gpt2:  # the example: three tokens, the third ending inside the emoji
        assert 3 in inside


def test_a_pair_cut_inside_a_character_leaves_it_out() -> None:
    tokenizer = byte_level_bpe()
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    cut = next(cut for cut in range(1, len(ids)) if "\ufffd" in tokenizer.decode(ids[:cut]))
    reviews = Tokenized(pd.DataFrame({"review_id": ["a", "b"], "label": [1, 0], "rating": [9, 2]}), [ids, ids],
                        tokenizer)
    pairs = build_pairs(reviews, 1, (cut, cut), False, np.random.default_rng(0), "test")
    assert pairs["chosen"].to_pylist() == pairs["rejected"].to_pylist() == ["Great film "]
