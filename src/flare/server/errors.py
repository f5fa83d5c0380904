"""Errors an HTTP client can cause, and how each API family spells them.

Every route raises `APIError`; the app turns it into the body the caller's SDK expects:
OpenAI `{"error": {"message", "type", "param", "code"}}` or Anthropic
`{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ApiFamily = Literal["openai", "anthropic"]

# Anthropic names its error types by status; OpenAI uses a few broad types plus a code.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


@dataclass
class APIError(Exception):
    """A request the server refuses; `message` says what was wrong and what to change."""

    status: int
    message: str
    code: str | None = None
    param: str | None = None

    def __str__(self) -> str:
        return self.message


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, code=code, param=param)


def error_body(error: APIError, family: ApiFamily) -> dict:
    if family == "anthropic":
        return {"type": "error",
                "error": {"type": _ANTHROPIC_TYPES.get(error.status, "api_error"), "message": error.message}}
    return {"error": {"message": error.message,
                      "type": _OPENAI_TYPES.get(error.status, "invalid_request_error"),
                      "param": error.param,
                      "code": error.code}}


def family_for_path(path: str) -> ApiFamily:
    """Anthropic's routes live under /v1/messages; every other route speaks OpenAI's dialect."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def public_reason(reason: str) -> str:
    """A failure's reason as a client may read it: its first line. What follows (a traceback, with the
    server's own file paths) stays in the server's log."""
    first, _, rest = str(reason).strip().partition("\n")
    first = first.rstrip().rstrip(":")
    return f"{first} (the server's log has the details)" if rest.strip() else first
