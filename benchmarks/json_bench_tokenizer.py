"""A byte-level BPE tokenizer that covers a model's whole vocabulary (ids 0..V-1) and spells JSON.

The random-weight benchmark checkpoints carry a word-level tokenizer ("w123" words): it has no braces,
quotes or digits, so a JSON-schema grammar could allow no token at all. This one has the 256 byte
symbols, then merged tokens built deterministically (printable pairs, then longer letter runs), as many
as the vocabulary needs, so grammar masks are computed over a full-size vocabulary of short strings.
It overwrites the tokenizer files of CHECKPOINT_DIR.

    python benchmarks/json_bench_tokenizer.py CHECKPOINT_DIR VOCAB_SIZE
"""

from __future__ import annotations

import itertools
import json
import string
import sys
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_of = {chr(c): chr(c) for c in range(33, 127)}            # printable ASCII maps to itself
    vocab = {token: index for index, token in enumerate(SPECIAL)}
    for symbol in sorted(alphabet):
        vocab.setdefault(symbol, len(vocab))
    merges: list[tuple[str, str]] = []
    printable = [byte_of[c] for c in string.ascii_letters + string.digits + string.punctuation]
    letters = [byte_of[c] for c in string.ascii_lowercase]
    words = itertools.chain(itertools.product(printable, printable),
                            ((a + b, c) for a, b in itertools.product(letters, letters) for c in letters),
                            ((a + b + c, d) for a, b, c in itertools.product(letters, letters, letters)
                             for d in letters))
    for left, right in words:
        if len(vocab) >= vocab_size:
            break
        if left in vocab and right in vocab and left + right not in vocab:
            vocab[left + right] = len(vocab)
            merges.append((left, right))
    if len(vocab) < vocab_size:
        raise ValueError(f"could build only {len(vocab)} tokens, fewer than {vocab_size}")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def main(directory: str, vocab_size: int) -> None:
    out = Path(directory)
    build(vocab_size).save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": 131072,
              "added_tokens_decoder": {str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                                "normalized": False, "single_word": False}
                                       for i, t in enumerate(SPECIAL)},
              "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant:{% endif %}"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    print(f"byte-level tokenizer with {vocab_size} ids written to {out}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
