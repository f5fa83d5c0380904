"""Incremental detokenizer: turns a stream of token ids into a stream of text that is never broken.

It decodes a small window (a few tokens already shown plus the new ones) and emits what the new
tokens add. Two things make this tricky and are handled here:
* SentencePiece tokenizers drop the leading space of the first token decoded, so the window always
  starts with context tokens (from the prompt at first) whose text is subtracted again;
* a character split over several byte-fallback tokens decodes to U+FFFD until its last byte comes;
  such text is held back until the character is complete.
"""

from __future__ import annotations

from collections.abc import Sequence

from flare.frontend.tokenizer import Tokenizer

CONTEXT_TOKENS = 5      # prompt tokens kept as decoding context for the first output tokens


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode = tokenizer.decoder(skip_special_tokens)
        self.tokens = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0                  # window start: context already shown
        self.read_offset = len(self.tokens)     # tokens before this are shown as text

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the text they complete (possibly empty while a character is partial)."""
        self.tokens.extend(token_ids)
        shown = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        text = self._decode(self.tokens[self.prefix_offset:])
        if len(text) <= len(shown) or text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return text[len(shown):]
