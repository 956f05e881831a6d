"""The texts a scorer reads are the texts a reader sees: a prompt cut after N tokens may end inside a multi-byte
character (an emoji, CJK), whose bytes the response's first tokens complete.

Decoded apart, the prompt ends in U+FFFD and the response starts with more of them ("Great film ��..."). So a
prompt's text is its tokens decoded less the replacement characters a cut character leaves at its end, and a
response's text is the rest of the prompt and response decoded together: prompt text + response text is what the
reader sees ("Great film " + "😀 loved it").
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

CUT_CHARACTER = "\ufffd"  # what decoding leaves for the bytes of a character that a cut split


def opening_texts(tokenizer: PreTrainedTokenizerBase, ids: Sequence[Sequence[int]],
                  skip_special_tokens: bool = False) -> list[str]:
    """The text of each opening (a prompt, a side of a pair: a review's first tokens): its tokens decoded, less a
    character its last tokens cut (that character is the response's)."""
    texts = tokenizer.batch_decode(ids, skip_special_tokens=skip_special_tokens)
    return [text.rstrip(CUT_CHARACTER) for text in texts]


def response_texts(tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[Sequence[int]],
                   response_ids: Sequence[Sequence[int]]) -> list[str]:
    """Each response's text, special tokens (EOS) left out: prompt and response decoded together, less the prompt's
    text (``opening_texts``, special tokens left out too). Where the joint text does not start with the prompt's (a
    tokenizer whose decoding changes text across the cut otherwise), the response decoded alone."""
    prompts = opening_texts(tokenizer, prompt_ids, skip_special_tokens=True)
    whole = tokenizer.batch_decode([[*p, *r] for p, r in zip(prompt_ids, response_ids, strict=True)],
                                   skip_special_tokens=True)
    return [text[len(prompt):] if text.startswith(prompt) else tokenizer.decode(ids, skip_special_tokens=True)
            for prompt, text, ids in zip(prompts, whole, response_ids, strict=True)]
