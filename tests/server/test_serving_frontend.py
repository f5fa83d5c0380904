"""The serving frontend's per-token text, as logprobs report it."""

from __future__ import annotations

from flare.server.frontend import ServingFrontend


class CountingTokenizer:
    """The real tokenizer, counting its decode calls."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decodes = 0

    def encode(self, text, add_special_tokens=True):
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids):
        self.decodes += 1
        return self.tokenizer.decode(ids)


def test_token_texts_concatenate_to_the_text_and_each_token_is_decoded_once(stories260k):
    plain = ServingFrontend.from_dir(stories260k)
    counting = CountingTokenizer(plain.tokenizer)
    frontend = ServingFrontend(counting, plain.chat_template)
    ids = plain.encode("Once upon a time there was a little dog", add_special_tokens=False)
    # Each token keeps its word-start space, so the reply's tokens concatenate to " " + its text.
    assert "".join(frontend.token_text(t) for t in ids) == " " + plain.decode(ids)
    distinct = len(set(ids))
    assert counting.decodes <= distinct + 1          # one decode per new token, plus the anchor once
    frontend.token_text(ids[0])
    assert counting.decodes <= distinct + 1          # a token seen before is not decoded again

