"""The streaming detokenizer decodes through the `tokenizers` backend where it can: the text must be exactly
what decoding through transformers' `decode` gives, for every kind of tokenizer we serve."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from flare.frontend.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer
from flare.frontend.tokenizer import Tokenizer, backend_decode, load_tokenizer

CORPUS = ["Once upon a time, there was a little girl named Lily. She didn't like the rain!",
          "Héllo wörld — ça va? 😀 日本語のテキスト. It's 3.14, isn't it? I'm here, you're there.",
          "def f(x):\n    return x * 2  # doubled\n\ttabs and  two  spaces"]


def wrapper_detokenized(tokenizer: Tokenizer, prompt: list[int], steps: list[list[int]], skip: bool) -> list[str]:
    """The detokenizer's algorithm decoding through transformers' `decode` (what it did before)."""
    tokens = list(prompt[-CONTEXT_TOKENS:])
    prefix, read = 0, len(tokens)
    pieces = []
    for step in steps:
        tokens.extend(step)
        shown = tokenizer.hf.decode(tokens[prefix:read], skip_special_tokens=skip)
        text = tokenizer.hf.decode(tokens[prefix:], skip_special_tokens=skip)
        if len(text) <= len(shown) or text.endswith("\ufffd"):
            pieces.append("")
            continue
        prefix, read = read, len(tokens)
        pieces.append(text[len(shown):])
    return pieces


def streams(tokenizer: Tokenizer, seed: int = 0):
    """Token streams: the corpus encoded (byte-fallback runs included), random ids over the whole
    vocabulary (special tokens too), and both mixed."""
    rng = random.Random(seed)
    size = tokenizer.vocab_size
    encoded = [tokenizer.encode(text, add_special_tokens=False) for text in CORPUS]
    for ids in encoded:
        yield ids[:3], ids[3:]
    for _ in range(6):
        yield [rng.randrange(size) for _ in range(4)], [rng.randrange(size) for _ in range(60)]
    mixed = [token for ids in encoded for token in ids + [rng.randrange(size), tokenizer.hf.eos_token_id or 0]]
    yield [1], mixed


def check_same_text(tokenizer: Tokenizer) -> None:
    for skip in (True, False):
        for prompt, ids in streams(tokenizer):
            # one token a step, and several (as speculative decoding delivers them)
            for steps in ([[token] for token in ids], [ids[start:start + 3] for start in range(0, len(ids), 3)]):
                detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
                pieces = [detokenizer.add(step) for step in steps]
                assert pieces == wrapper_detokenized(tokenizer, prompt, steps, skip)


def write_tokenizer(directory: Path, tokenizer, **config) -> Tokenizer:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                "unk_token": "<unk>", **config}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return load_tokenizer(directory)


def byte_level_bpe(directory: Path, **config) -> Tokenizer:
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers, trainers

    rust = RustTokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    rust.train_from_iterator(CORPUS * 4, trainer)
    return write_tokenizer(directory, rust, **config)


def word_piece(directory: Path, **config) -> Tokenizer:
    from tokenizers import Tokenizer as RustTokenizer, decoders, models, pre_tokenizers

    split = pre_tokenizers.Whitespace()
    words = sorted({word for text in CORPUS for word, _ in split.pre_tokenize_str(text)})
    vocab = {token: index for index, token in enumerate(["<unk>", "<s>", "</s>", *words, "##s", "##ly"])}
    rust = RustTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    rust.pre_tokenizer = split
    rust.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return write_tokenizer(directory, rust, **config)


def test_stories260k_sentencepiece_with_byte_fallback(stories260k):
    tokenizer = load_tokenizer(stories260k)
    assert backend_decode(tokenizer.hf) is not None         # the fast path is the one under test
    check_same_text(tokenizer)


def test_stories260k_with_added_special_tokens(stories260k):
    tokenizer = load_tokenizer(stories260k)
    tokenizer.hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.hf.add_tokens(["<tool_call>"])
    check_same_text(tokenizer)


def test_byte_level_bpe(tmp_path):
    tokenizer = byte_level_bpe(tmp_path)
    assert backend_decode(tokenizer.hf) is not None
    check_same_text(tokenizer)


@pytest.mark.parametrize("clean_up", [True, False])
def test_word_level_with_and_without_the_clean_up_pass(tmp_path, clean_up):
    tokenizer = word_piece(tmp_path, clean_up_tokenization_spaces=clean_up)
    assert backend_decode(tokenizer.hf) is not None
    check_same_text(tokenizer)
    if clean_up:        # the case that shows the pass ran: " ." and " n't" are joined
        ids = tokenizer.encode("It 's here .", add_special_tokens=False)
        assert IncrementalDetokenizer(tokenizer, [1]).add(ids) == tokenizer.hf.decode(ids) == "It's here."


def test_a_bpe_tokenizer_asking_for_clean_up_keeps_transformers_decode(tmp_path):
    # transformers versions disagree on whether BPE gets the clean-up pass: the wrapper decides
    tokenizer = byte_level_bpe(tmp_path, clean_up_tokenization_spaces=True)
    assert backend_decode(tokenizer.hf) is None
    check_same_text(tokenizer)


def test_a_tokenizer_class_with_its_own_decode_keeps_it(stories260k):
    from transformers import PreTrainedTokenizerFast

    class Shouting(type(load_tokenizer(stories260k).hf)):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    hf = Shouting.from_pretrained(str(stories260k))
    assert isinstance(hf, PreTrainedTokenizerFast) and backend_decode(hf) is None
    tokenizer = Tokenizer(hf, (2,))
    ids = tokenizer.encode("Once upon a time", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, [1])
    assert [detokenizer.add([token]) for token in ids] == ["ONCE", " UPON", " A", " TIME"]
