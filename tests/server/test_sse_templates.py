"""The per-token stream events come from templates; each must be byte for byte the event the general path
(`sse.data_event` / `sse.named_event` of the payload) writes, whatever the text holds."""

from __future__ import annotations

import json
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


LINE_BREAK_TEXTS = ["name\u2028x", "a\u2029b", "next\x85line", "\u2028\u2029\x85 and \u2028 again"]


def read_as_httpx_does(stream: str) -> list[dict]:
    """The events' JSON as a client built on httpx's `aiter_lines` gets it (its lines are str.splitlines')."""
    from httpx._decoders import LineDecoder
    lines = LineDecoder().decode(stream) + LineDecoder().flush()
    return [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]


@pytest.mark.parametrize("text", LINE_BREAK_TEXTS)
def test_text_with_unicode_line_breaks_stays_one_line_per_event(text):
    """A reply that holds U+2028, U+2029 or U+0085 (a random-weight model's JSON string did) must not
    split an event for readers that end lines where Unicode does: each event is still one line and
    decodes to the text as generated."""
    chunks = StreamChunks("cmpl-1", "text_completion", body(True))
    stream = (chunks.text(0, text) + chunks.content(1, text) + delta_event(0, "text_delta", "text", text)
              + sse.data_event({"choices": [{"text": text}]}) + sse.named_event({"type": "x", "text": text}))
    events = read_as_httpx_does(stream)
    assert events[0]["choices"][0]["text"] == text
    assert events[1]["choices"][0]["delta"]["content"] == text
    assert events[2]["delta"]["text"] == text
    assert events[3]["choices"][0]["text"] == text
    assert events[4]["text"] == text
    assert len(events) == 5
