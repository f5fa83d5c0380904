"""Signed grants: a controller's authorization of one action on one agent, checked before the agent acts.

    grant = issue(identity, agent_fingerprint, "run", request_bytes)
    check(grant, agent_fingerprint, authorized_keys, seen_nonces)   -> the controller key that signed it

A grant names the agent (its key's fingerprint), the action, the SHA-256 of the exact request it
authorizes, when it was issued and when it expires, and a random nonce; the controller's Ed25519 key
signs its canonical bytes. The agent acts only on a grant signed by a controller it has authorized,
addressed to it, unexpired and not seen before, so a grant can neither be replayed nor moved to
another request or host. Every state-changing request (run, stop, remove, push, controller changes)
carries one.
"""

from __future__ import annotations

import hashlib
import os
import time

import msgspec

from flare.errors import UsageError
from flare.orbit.identity import Identity
from flare.package.signing import PublicKey

GRANT_LIFETIME_S = 300.0
CLOCK_SKEW_S = 120.0


class Grant(msgspec.Struct, frozen=True):
    controller: bytes                 # the signer's raw Ed25519 public key
    agent: str                        # the fingerprint of the agent it is addressed to
    action: str
    request_sha256: str
    issued: float
    expires: float
    nonce: bytes
    signature: bytes = b""

    def signed_bytes(self) -> bytes:
        return b"flare orbit grant\0" + msgspec.msgpack.encode(msgspec.structs.replace(self, signature=b""))


class GrantRefused(UsageError):
    pass


def issue(identity: Identity, agent_fingerprint: str, action: str, request: bytes) -> Grant:
    now = time.time()
    grant = Grant(identity.public.raw, agent_fingerprint, action, hashlib.sha256(request).hexdigest(), now,
                  now + GRANT_LIFETIME_S, os.urandom(16))
    return msgspec.structs.replace(grant, signature=identity.sign(grant.signed_bytes()))


def check(grant: Grant, action: str, request: bytes, agent_fingerprint: str, authorized: set[str],
          seen: set[bytes]) -> PublicKey:
    """The authorizing key, or GrantRefused saying what was wrong with the grant."""
    key = PublicKey(grant.controller)
    now = time.time()
    problems = [
        (key.fingerprint not in authorized, f"it is signed by {key.fingerprint}, which this agent has not authorized"),
        (grant.agent != agent_fingerprint, "it is addressed to another agent"),
        (grant.action != action, f"it grants {grant.action!r}, not {action!r}"),
        (grant.request_sha256 != hashlib.sha256(request).hexdigest(), "it was issued for another request"),
        (not grant.issued - CLOCK_SKEW_S <= now <= grant.expires + CLOCK_SKEW_S,
         "it has expired (or the two hosts' clocks differ by minutes)"),
        (grant.nonce in seen, "it was used already"),
        (not key.verify(grant.signature, grant.signed_bytes()), "its signature does not verify")]
    for failed, reason in problems:
        if failed:
            raise GrantRefused(f"the agent refused a {action} grant: {reason}")
    seen.add(grant.nonce)
    return key
