"""The demo model's tokenizer: byte-level BPE trained on the corpus, with ChatML special tokens.

Byte-level BPE encodes any text, so every string round-trips exactly. The chat template lives beside
this module (`chat_template.jinja`) and is written into `tokenizer_config.json` as `chat_template`.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Iterable

END_OF_TEXT = "<|endoftext|>"  # separates documents; also padding
TURN_START = "<|im_start|>"
TURN_END = "<|im_end|>"  # ends a chat turn; the end-of-sequence token for chat
SPECIAL_TOKENS = (END_OF_TEXT, TURN_START, TURN_END)  # ids 0, 1, 2 in this order

_TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE tokenizer (special tokens first) on `texts`; returns a `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


@cache
def chat_template() -> str:
    """The Jinja chat template (ChatML: system, user and assistant turns; `add_generation_prompt`)."""
    return _TEMPLATE_PATH.read_text(encoding="utf-8")


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """Render a conversation with the chat template, as a serving frontend would."""
    import jinja2

    environment = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    template = environment.from_string(chat_template())
    return template.render(messages=messages, add_generation_prompt=add_generation_prompt)


def write_tokenizer_files(tokenizer, directory: Path, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json (with the chat template) and special_tokens_map.json."""
    tokenizer.save(str(directory / "tokenizer.json"))
    added_tokens = {
        str(tokenizer.token_to_id(token)): {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_tokens,
        "bos_token": None,
        "eos_token": TURN_END,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "additional_special_tokens": [TURN_START, TURN_END],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": chat_template(),
    }
    special_tokens_map = {
        "eos_token": TURN_END,
        "pad_token": END_OF_TEXT,
        "additional_special_tokens": [TURN_START, TURN_END],
    }
    _write_json(directory / "tokenizer_config.json", config)
    _write_json(directory / "special_tokens_map.json", special_tokens_map)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
