"""The messages between the ranks of a multi-host launch: one protocol, one codec (`RANKS`).

Control connection (a peer to rank zero's rendezvous, role "rank"):
    rank zero -> peer   Offer: the signed envelope, the deployment and rank, the data session, streams
    peer -> rank zero   Staged (its payloads are in its cache and verified) | Failed (why not)
    rank zero -> peer   Finish (--stage-only: done) | Start (join the process group) | Abort (why)
    both ways           Heartbeat, every HEARTBEAT_S while nothing else is said

Data stream (role "stream", naming the session; up to --transfer-streams per peer):
    peer -> rank zero   Fetch(name)
    rank zero -> peer   Chunk(data)..., then Sent(name)

Serving distribution is plain TCP (spec §3.2): what a peer stores is checked against the signed
manifest whose signature and publisher it verified itself, so an altered byte is refused there.
"""

from __future__ import annotations

import msgspec

from flare.hosts.frames import Protocol
from flare.hosts.handshake import Hello, Proof, Refused, Welcome

PROTOCOL_NAME = "flare-ranks/1"
HEARTBEAT_S = 2.0
SILENT_LIMIT_S = 10.0          # a rank that says nothing for this long is taken for dead
CHUNK_BYTES = 1 << 20


class Envelope(msgspec.Struct, frozen=True):
    """A package's signed primary: the manifest's exact text, its signature, the signer's profile."""

    manifest_body: str
    signature: bytes
    profile_json: str


class Offer(msgspec.Struct, tag="offer", frozen=True):
    envelope: Envelope
    deployment: str
    ranks: int
    rank: int
    session: bytes
    streams: int


class Fetch(msgspec.Struct, tag="fetch", frozen=True):
    name: str


class Chunk(msgspec.Struct, tag="chunk", frozen=True):
    data: bytes


class Sent(msgspec.Struct, tag="sent", frozen=True):
    name: str


class Staged(msgspec.Struct, tag="staged", frozen=True):
    received_bytes: int
    reused_bytes: int


class Failed(msgspec.Struct, tag="failed", frozen=True):
    reason: str
    exit_code: int = 1


class Finish(msgspec.Struct, tag="finish", frozen=True):
    message: str


class Start(msgspec.Struct, tag="start", frozen=True):
    store_port: int                # rank zero's process-group store, on the rendezvous host
    timeout_s: float               # the start-up collective's bound


class Abort(msgspec.Struct, tag="abort", frozen=True):
    reason: str
    exit_code: int = 1


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    pass


RANKS = Protocol(Hello | Welcome | Refused | Proof | Offer | Fetch | Chunk | Sent | Staged | Failed | Finish
                 | Start | Abort | Heartbeat)
