"""The tokenizer of a checkpoint or package: a thin wrapper over transformers' fast tokenizer.

Loading imports transformers, so call `load_tokenizer` only where a model is really served.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Decode = Callable[[list[int]], str]


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int]) -> None:
        self.hf = hf_tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self._one_token_texts: dict[bool, dict[int, str]] = {True: {}, False: {}}

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def decoder(self, skip_special_tokens: bool = True) -> Decode:
        """`decode(ids, skip_special_tokens)` as a function of a list of ids, for the streaming detokenizer,
        which calls it twice per token: the `tokenizers` backend's own decode where transformers' wrapper
        adds nothing to it (the wrapper's argument conversions cost as much as the decoding), else the
        wrapper. The text is the same either way.

        One id alone, the detokenizer's usual window of text already shown, is decoded once per tokenizer
        and remembered (at most one text per vocabulary entry)."""
        backend = backend_decode(self.hf)
        if backend is None:
            def decode(token_ids: list[int]) -> str:
                return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)
        else:
            def decode(token_ids: list[int]) -> str:
                return backend(token_ids, skip_special_tokens)
        one_token_texts = self._one_token_texts[bool(skip_special_tokens)]

        def decode_remembering_one(token_ids: list[int]) -> str:
            if len(token_ids) != 1:
                return decode(token_ids)
            text = one_token_texts.get(token_ids[0])
            if text is None:
                text = one_token_texts[token_ids[0]] = decode(token_ids)
            return text
        return decode_remembering_one

    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> list[str]:
        return list(self.hf.convert_ids_to_tokens(list(token_ids)))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` to the prompt text (encode it with add_special_tokens=False: the template
        already writes the special tokens it wants). Extra keywords (tools, enable_thinking, ...) reach
        the template."""
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; send a plain completion prompt instead")
        return self.hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                           tokenize=False, **kwargs)


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer in `directory`, with EOS ids from the tokenizer and `generation_config.json`."""
    from transformers import AutoTokenizer

    directory = Path(directory)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(directory))
    return Tokenizer(hf_tokenizer, eos_token_ids_of(directory, hf_tokenizer.eos_token_id))


def eos_token_ids_of(directory: Path, tokenizer_eos: int | None) -> list[int]:
    """The tokenizer's EOS id, then generation_config.json's (an int or a list), without repeats."""
    from flare.engine.factory import generation_eos_token_ids, merge_token_ids

    return list(merge_token_ids([] if tokenizer_eos is None else [tokenizer_eos],
                                generation_eos_token_ids(directory)))


def backend_decode(hf_tokenizer: Any) -> Callable[[list[int], bool], str] | None:
    """The `tokenizers` decode that `hf_tokenizer.decode(ids, skip_special_tokens)` amounts to for a list of
    ids, or None where the wrapper does more or the versions differ.

    transformers' fast `decode` converts its argument, decodes with the Rust backend and then, if
    `clean_up_tokenization_spaces` is set, applies `clean_up_tokenization`; since 5.0 it skips that clean-up
    for BPE models, so a BPE tokenizer that asks for it keeps the wrapper. A class that overrides `decode`
    or `_decode` (or a tokenizer without a Rust backend) keeps it too."""
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    backend = getattr(hf_tokenizer, "_tokenizer", None)
    cls = type(hf_tokenizer)
    if (backend is None or not isinstance(hf_tokenizer, PreTrainedTokenizerFast)
            or cls.decode is not PreTrainedTokenizerBase.decode or cls._decode is not PreTrainedTokenizerFast._decode):
        return None
    if not hf_tokenizer.clean_up_tokenization_spaces:
        return lambda token_ids, skip: backend.decode(token_ids, skip_special_tokens=skip)
    if type(backend.model).__name__ == "BPE":
        return None
    clean_up = hf_tokenizer.clean_up_tokenization
    return lambda token_ids, skip: clean_up(backend.decode(token_ids, skip_special_tokens=skip))
