"""Server-sent events, as the OpenAI and Anthropic SDKs parse them."""

from __future__ import annotations

import json
from typing import Any

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MEDIA_TYPE = "text/event-stream"


def _dumps(payload: Any) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))


def data_event(payload: Any) -> str:
    """An OpenAI Chat/Completions chunk: a bare `data:` line."""
    return f"data: {_dumps(payload)}\n\n"


def named_event(payload: dict) -> str:
    """A Responses or Anthropic event: `event:` carries the payload's own `type`."""
    return f"event: {payload['type']}\ndata: {_dumps(payload)}\n\n"


DONE = "data: [DONE]\n\n"
