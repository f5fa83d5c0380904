"""Pairing codes: how a controller and an agent that have never met come to trust each other's keys.

An agent offers a one-time code (`flare agent install --join-code CODE`, or one it makes and prints).
The controller, given the code (`flare orbit pair HOST --code CODE`), opens a session without a pinned
agent key and proves it holds the code: an HMAC-SHA256 of the session's signed transcript under a key
derived from the code. The agent checks that proof, records the controller's key as authorized, and
answers with its own proof, which the controller checks before it records the agent's key. The
transcript binds both keys and ephemerals, so a party in between would need the code itself; the
agent forgets the code once it is used. `--accept-first` trusts the first controller without a code.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"       # no 0/O, 1/I: read aloud and typed
CODE_GROUPS = 3
GROUP_LENGTH = 4


def new_code() -> str:
    return "-".join("".join(secrets.choice(ALPHABET) for _ in range(GROUP_LENGTH)) for _ in range(CODE_GROUPS))


def normalized(code: str) -> str:
    return "".join(character for character in code.upper() if character.isalnum())


def proof(code: str, side: bytes, transcript: bytes) -> bytes:
    key = hashlib.sha256(b"flare orbit pairing code\0" + normalized(code).encode()).digest()
    return hmac.digest(key, side + transcript, hashlib.sha256)


def matches(code: str, side: bytes, transcript: bytes, given: bytes) -> bool:
    return hmac.compare_digest(proof(code, side, transcript), given)
