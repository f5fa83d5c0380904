"""The control protocol between a controller and an agent, inside an encrypted session (`ORBIT`).

The controller sends one request and reads its answer (or answers, for a log or a push), then may send
another. Read-only requests need an authorized controller; state-changing ones travel as `Granted`
(the request's exact bytes and a grant signed over them, `grants`). Errors come back as `Problem`, a
one-paragraph reason and its exit code.
"""

from __future__ import annotations

import msgspec

from flare.hosts.frames import Protocol
from flare.hosts.messages import Chunk, Envelope, Sent
from flare.orbit.grants import Grant
from flare.orbit.session import ClientAuth, ClientHello, ServerHello

# ---- requests -----------------------------------------------------------------------------------------


class Pair(msgspec.Struct, tag="pair", frozen=True):
    name: str                         # how the agent will list this controller
    proof: bytes                      # HMAC of the session transcript under the pairing code (b"": accept-first)


class Status(msgspec.Struct, tag="status", frozen=True):
    pass


class Packages(msgspec.Struct, tag="packages", frozen=True):
    pass


class Groups(msgspec.Struct, tag="groups", frozen=True):
    pass


class Describe(msgspec.Struct, tag="describe", frozen=True):
    """The signed envelope of a package on the agent's host (a path, or MODEL[@VERSION] in its cache)."""

    target: str


class Lacking(msgspec.Struct, tag="lacking", frozen=True):
    """Which of these payloads the agent's cache lacks (and whether they fit), before a push sends any."""

    envelope: Envelope
    payloads: tuple[str, ...]
    rank: int


class Logs(msgspec.Struct, tag="logs", frozen=True):
    group: str
    follow: bool


class Metrics(msgspec.Struct, tag="metrics", frozen=True):
    group: str


class Granted(msgspec.Struct, tag="granted", frozen=True):
    action: str
    request: bytes                    # the msgpack of one of the granted requests below
    grant: Grant


class RunRank(msgspec.Struct, frozen=True):
    group: str
    rank: int
    ranks: int
    arguments: tuple[str, ...]        # `flare run` arguments, the package's path on this host included
    listener: str = ""                # rank zero's HTTP address, for metrics ("" on peers)


class StopGroup(msgspec.Struct, frozen=True):
    group: str


class RemoveGroup(msgspec.Struct, frozen=True):
    group: str


class PushPackage(msgspec.Struct, frozen=True):
    envelope: Envelope
    deployment: str
    rank: int                         # -1: the whole package, published as a cache entry
    payloads: tuple[str, ...]         # the names the agent will receive (one rank's, or every payload)
    publish: bool = True              # False: store the payloads as blobs only (one of several parallel streams)


class AddController(msgspec.Struct, frozen=True):
    name: str
    key: str                          # base64 raw Ed25519 public key


class RemoveController(msgspec.Struct, frozen=True):
    key: str                          # base64 key or its fingerprint


GRANTED_REQUESTS = {"run": RunRank, "stop": StopGroup, "remove": RemoveGroup, "push": PushPackage,
                    "add-controller": AddController, "remove-controller": RemoveController}

# ---- answers ------------------------------------------------------------------------------------------


class Problem(msgspec.Struct, tag="problem", frozen=True):
    reason: str
    exit_code: int = 1


class Done(msgspec.Struct, tag="done", frozen=True):
    text: str = ""


class Paired(msgspec.Struct, tag="paired", frozen=True):
    hostname: str
    proof: bytes


class StatusReply(msgspec.Struct, tag="status-reply", frozen=True):
    hostname: str
    cache: str
    cache_free_bytes: int
    devices: tuple[str, ...]
    running: int
    controllers: int


class CachedPackage(msgspec.Struct, frozen=True):
    label: str
    model_id: str
    stored_bytes: int
    ranks: tuple[int, ...]            # () for a whole entry; the ranks of a rank copy


class PackagesReply(msgspec.Struct, tag="packages-reply", frozen=True):
    cache: str
    packages: tuple[CachedPackage, ...]


class RankState(msgspec.Struct, frozen=True):
    group: str
    rank: int
    ranks: int
    state: str                        # running, exited, stopped
    pid: int
    started: float
    exit_code: int | None
    listener: str
    arguments: tuple[str, ...]


class GroupsReply(msgspec.Struct, tag="groups-reply", frozen=True):
    ranks: tuple[RankState, ...]


class Described(msgspec.Struct, tag="described", frozen=True):
    path: str
    envelope: Envelope


class LogText(msgspec.Struct, tag="log-text", frozen=True):
    text: str


class LogEnd(msgspec.Struct, tag="log-end", frozen=True):
    state: str
    exit_code: int | None


class MetricsReply(msgspec.Struct, tag="metrics-reply", frozen=True):
    text: str                         # rank zero's /metrics, Prometheus text


class Needs(msgspec.Struct, tag="needs", frozen=True):
    names: tuple[str, ...]            # the payloads a push must send: those the agent's cache lacks


class Stored(msgspec.Struct, tag="stored", frozen=True):
    path: str
    received_bytes: int


ORBIT = Protocol(
    ClientHello | ServerHello | ClientAuth | Pair | Status | Packages | Groups | Describe | Lacking
    | Logs | Metrics | Granted | Problem | Done | Paired | StatusReply | PackagesReply | GroupsReply | Described
    | LogText | LogEnd | MetricsReply | Needs | Stored | Chunk | Sent)
