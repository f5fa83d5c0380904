"""The per-token stream events come from templates; each must be byte for byte the event the general path
(`sse.data_event` / `sse.named_event` of the payload) writes, whatever the text holds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flare.server import sse
from flare.server.anthropic_messages import delta_event
from flare.server.openai_common import StreamChunks

TEXTS = ["", "plain words", ' "quoted" \\ back\\slash /', "\n\t\r\b\f", "\x00\x01\x1f\x7f", "\u2028\u2029",
         "😀 日本語 é ß", "\ufffd", "{}[],:", "".join(chr(c) for c in range(0x3000))]


def body(include_usage: bool) -> SimpleNamespace:
    return SimpleNamespace(model="served-name", stream_options=SimpleNamespace(include_usage=include_usage))


def general(chunks: StreamChunks, choice: dict) -> str:
    payload = {**chunks.base, "choices": [choice], "system_fingerprint": None}
    if chunks.include_usage:
        payload["usage"] = None
    return sse.data_event(payload)


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_completions_text_chunk(text, include_usage):
    chunks = StreamChunks("cmpl-1", "text_completion", body(include_usage))
    for index in (0, 7):
        expected = general(chunks, {"index": index, "text": text, "logprobs": None, "finish_reason": None,
                                    "stop_reason": None})
        assert chunks.text(index, text) == expected
        assert chunks([{"index": index, "text": text, "logprobs": None, "finish_reason": None,
                        "stop_reason": None}]) == expected


@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_chat_content_chunk(text, include_usage):
    chunks = StreamChunks("chatcmpl-1", "chat.completion.chunk", body(include_usage))
    for index in (0, 12):
        expected = general(chunks, {"index": index, "delta": {"content": text}, "logprobs": None,
                                    "finish_reason": None})
        assert chunks.content(index, text) == expected


def test_the_usage_chunk_is_unchanged():
    chunks = StreamChunks("cmpl-1", "text_completion", body(True))
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert chunks([], usage) == sse.data_event({**chunks.base, "choices": [], "system_fingerprint": None,
                                                "usage": usage})


@pytest.mark.parametrize("text", TEXTS)
def test_anthropic_text_and_thinking_deltas(text):
    for kind, field in (("text_delta", "text"), ("thinking_delta", "thinking")):
        for index in (0, 3):
            expected = sse.named_event({"type": "content_block_delta", "index": index,
                                        "delta": {"type": kind, field: text}})
            assert delta_event(index, kind, field, text) == expected
