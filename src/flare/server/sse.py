"""Server-sent events, as the OpenAI and Anthropic SDKs parse them."""

from __future__ import annotations

import json
from json.encoder import encode_basestring
from typing import Any

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MEDIA_TYPE = "text/event-stream"


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def dumps(payload: Any) -> str:
    """Compact JSON with text as it is (no \\u escapes for non-ASCII): the events' one encoding."""
    return _ENCODER.encode(payload)


def json_string(text: str) -> str:
    """`text` as `dumps` writes a string (the encoder's own function): for events built from templates."""
    return encode_basestring(text)


def data_event(payload: Any) -> str:
    """An OpenAI Chat/Completions chunk: a bare `data:` line."""
    return f"data: {dumps(payload)}\n\n"


def named_event(payload: dict) -> str:
    """A Responses or Anthropic event: `event:` carries the payload's own `type`."""
    return f"event: {payload['type']}\ndata: {dumps(payload)}\n\n"


DONE = "data: [DONE]\n\n"
