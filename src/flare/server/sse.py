"""Server-sent events, as the OpenAI and Anthropic SDKs parse them."""

from __future__ import annotations

import json
from json.encoder import encode_basestring
from typing import Any

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MEDIA_TYPE = "text/event-stream"


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))

# JSON leaves U+0085, U+2028 and U+2029 unescaped, but clients that read a stream with Python's
# str.splitlines (httpx's `aiter_lines`, and the SSE readers built on it) end a line there and then fail
# on half an event. Escaped, the event is one line for every reader and decodes to the same text.
_ESCAPED_LINE_BREAKS = str.maketrans({char: f"\\u{ord(char):04x}" for char in ("\x85", "\u2028", "\u2029")})


def _one_line(encoded: str) -> str:
    if "\u2028" in encoded or "\u2029" in encoded or "\x85" in encoded:     # per token: no generator
        return encoded.translate(_ESCAPED_LINE_BREAKS)
    return encoded


def dumps(payload: Any) -> str:
    """Compact JSON with text as it is (no \\u escapes for non-ASCII but the three characters Unicode
    counts as line breaks): the events' one encoding."""
    return _one_line(_ENCODER.encode(payload))


def json_string(text: str) -> str:
    """`text` as `dumps` writes a string (the encoder's own function): for events built from templates."""
    return _one_line(encode_basestring(text))


def data_event(payload: Any) -> str:
    """An OpenAI Chat/Completions chunk: a bare `data:` line."""
    return f"data: {dumps(payload)}\n\n"


def named_event(payload: dict) -> str:
    """A Responses or Anthropic event: `event:` carries the payload's own `type`."""
    return f"event: {payload['type']}\ndata: {dumps(payload)}\n\n"


DONE = "data: [DONE]\n\n"
