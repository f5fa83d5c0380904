"""API-key authentication: `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY` (Anthropic)."""

from __future__ import annotations

import hmac
from pathlib import Path

from flare.errors import UsageError

# Probes and scrapers need no key (as vLLM): only the model APIs are guarded.
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/ping", "/version"})


def read_api_key_file(path: Path) -> str:
    """The key in `path`, stripped; an empty file means no authentication."""
    try:
        return Path(path).read_text().strip()
    except OSError as error:
        raise UsageError(f"cannot read --api-key-file {path}: {error.strerror or error}") from error


def presented_keys(headers) -> list[str]:
    keys = []
    authorization = headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        keys.append(token.strip())
    if headers.get("x-api-key"):
        keys.append(headers["x-api-key"].strip())
    return keys


def is_authorized(expected: str | None, headers) -> bool:
    if not expected:
        return True
    wanted = expected.encode()
    # compare_digest on every presented key so timing reveals nothing about the key
    return any([hmac.compare_digest(key.encode(), wanted) for key in presented_keys(headers)])
