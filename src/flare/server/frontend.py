"""The serving frontend: tokenizer and chat template behind the few calls the routes need."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from flare.frontend.chat_template import ChatTemplate


@dataclass
class ServingFrontend:
    tokenizer: Any                   # encode(text, add_special_tokens), decode(ids), eos_token_ids
    chat_template: ChatTemplate
    _token_texts: dict[int, str] = field(default_factory=dict, repr=False)
    _anchor: list[int] | None = field(default=None, repr=False)
    _anchor_text: str = field(default="", repr=False)

    @classmethod
    def from_dir(cls, directory: Path, tokenizer: Any = None) -> "ServingFrontend":
        """Load the tokenizer (unless given) and chat template from a frontend directory."""
        from flare.frontend.tokenizer import load_tokenizer

        directory = Path(directory)
        return cls(tokenizer if tokenizer is not None else load_tokenizer(directory), ChatTemplate.from_dir(directory))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(getattr(self.tokenizer, "eos_token_ids", ()) or ())

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **template_kwargs: Any) -> list[int]:
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, **template_kwargs)
        # The template writes the special tokens (BOS) itself; adding them again would double them.
        return self.encode(text, add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """One token's text, as logprobs report it (cached: the vocabulary is fixed)."""
        text = self._token_texts.get(token_id)
        if text is None:
            # Decoded after an anchor token, so a SentencePiece word-start token keeps its leading space
            # (decoded alone it would lose it) and the tokens of a reply concatenate to the reply's text.
            if self._anchor is None:
                self._anchor = (self.encode("a", add_special_tokens=False) or [token_id])[:1]
                self._anchor_text = self.tokenizer.decode(self._anchor)    # the anchor is decoded once
            prefix = self._anchor_text
            both = self.tokenizer.decode(self._anchor + [token_id])
            text = both[len(prefix):] if both.startswith(prefix) else self.tokenizer.decode([token_id])
            self._token_texts[token_id] = text
        return text
