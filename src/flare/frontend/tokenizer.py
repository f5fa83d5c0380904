"""The tokenizer of a checkpoint or package: a thin wrapper over transformers' fast tokenizer.

Loading imports transformers, so call `load_tokenizer` only where a model is really served.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int]) -> None:
        self.hf = hf_tokenizer
        self.eos_token_ids = tuple(eos_token_ids)

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
