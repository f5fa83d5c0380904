"""The serving bootstrap of a multi-host launch: rank zero hands each peer its payloads, then all join.

    zero = RankZero(files, deployment, Address, streams, out); zero.open()
    zero.gather()                        every peer joined, received and verified its rank's payloads
    zero.finish(text) | zero.start(...)  --stage-only ends every rank; otherwise they join the group

    peer = join_rank_zero(PeerOptions(...), stages)   staged and verified; holds the control connection
    peer.wait()                          -> Finish | Start, or the launch's failure raised

Rank zero listens on the rendezvous address; a peer connects only there. Each connection starts with
the handshake (`handshake`: same protocol and build, or refused naming both). A peer's control
connection gets an `Offer` (the signed envelope, its deployment and rank, a data session, the stream
count); the peer verifies the signature and its publisher trust itself, stores what its cache lacks
(`distribution`), verifies its copy with the package checks every load makes, and says `Staged`, or
`Failed` with its error. Both sides send a heartbeat every HEARTBEAT_S; a rank silent for
SILENT_LIMIT_S, or whose connection ends, ends the launch: rank zero tells every other rank why
(`Abort`, naming the rank) and raises it too, so every rank exits with that rank's name.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TextIO

from flare.errors import FlareError, UsageError
from flare.hosts.address import Address, connect, listen
from flare.hosts.build import BuildMismatch
from flare.hosts.frames import Channel, ChannelClosed, ChannelError, ChannelTimeout
from flare.hosts.handshake import RemoteRefusal, Refused, client_handshake, server_handshake
from flare.hosts.messages import (HEARTBEAT_S, PROTOCOL_NAME, RANKS, SILENT_LIMIT_S, Abort, Envelope, Failed,
                                  Finish, Heartbeat, Offer, Staged, Start)
from flare.package.format import PackageFiles, Primary
from flare.package.manifest import Deployment
from flare.package.rank_copy import rank_payloads

JOIN_TIMEOUT_S = 600.0         # how long rank zero waits for every peer, and a peer for rank zero to listen
CONNECT_RETRY_S = 1.0


class LaunchFailed(FlareError):
    """A rank failed or vanished; every rank ends with this reason."""

    def __init__(self, reason: str, exit_code: int = 1) -> None:
        super().__init__(reason)
        self.exit_code = exit_code


def gone(error: ChannelError) -> str:
    """How a rank's control connection ended, as the rest of a sentence naming the rank."""
    if isinstance(error, ChannelClosed):
        return "closed its connection (the process ended, or its host or the network went down)"
    if isinstance(error, ChannelTimeout):
        return f"sent nothing for {SILENT_LIMIT_S:.0f} s (it hangs, or the network between us went down)"
    return f"broke its connection ({error})"


def describe_failure(error: BaseException) -> tuple[str, int]:
    if isinstance(error, FlareError):
        return str(error), error.exit_code
    return f"{type(error).__name__}: {error}", 1


class _Heartbeats:
    """Send a heartbeat on each channel every HEARTBEAT_S until stopped."""

    def __init__(self) -> None:
        self.channels: list[Channel] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="flare-heartbeats", daemon=True)
        self._lock = threading.Lock()

    def add(self, channel: Channel) -> None:
        with self._lock:                          # peers are admitted on threads of their own
            self.channels.append(channel)
            if not self.thread.is_alive() and not self.stopped.is_set():
                self.thread.start()

    def _run(self) -> None:
        while not self.stopped.wait(HEARTBEAT_S):
            for channel in list(self.channels):
                try:
                    channel.send(Heartbeat())
                except ChannelError:
                    pass                         # its reader reports the broken connection


@dataclass
class _Peer:
    rank: int
    channel: Channel
    staged: Staged | None = None


class RankZero:
    """Rank zero's side: accept the peers at the rendezvous, offer each its payloads, watch them."""

    def __init__(self, files: PackageFiles, deployment: Deployment, address: Address, streams: int,
                 out: Callable[[str], None]) -> None:
        self.files, self.deployment, self.address, self.streams, self.out = files, deployment, address, streams, out
        self.ranks = deployment.tensor_parallel
        self.session = os.urandom(16)
        self.peers: dict[int, _Peer] = {}
        self.events: queue.Queue[tuple[int, Any]] = queue.Queue()
        self.heartbeats = _Heartbeats()
        self.on_failure: Callable[[LaunchFailed], None] | None = None   # set once serving: ends the server
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._socket = None
        self._allowed = {rank: {r.name: r for r in rank_payloads(files.manifest, deployment, rank)}
                         for rank in range(1, self.ranks)}

    def open(self) -> None:
        self._socket = listen(self.address, "the ranks of this launch")
        threading.Thread(target=self._accept, name="flare-rendezvous", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, where = self._socket.accept()
            except OSError:
                return
            channel = Channel(sock, f"{where[0]}:{where[1]}", RANKS)
            threading.Thread(target=self._introduce, args=(channel,), daemon=True).start()

    def _introduce(self, channel: Channel) -> None:
        try:
            self._introduce_checked(channel)
        except BaseException as error:            # noqa: BLE001 - a thread's failure ends the launch, named
            channel.close()
            reason, code = describe_failure(error)
            self._fail(LaunchFailed(f"rank zero failed while serving {channel.peer}: {reason}", code))

    def _introduce_checked(self, channel: Channel) -> None:
        try:
            hello = server_handshake(channel, PROTOCOL_NAME)
        except FlareError as error:
            channel.close()
            if isinstance(error, BuildMismatch):       # a rank of another build: the launch cannot go on
                self.events.put((-1, LaunchFailed(f"a rank at {channel.peer} was refused: {error}", error.exit_code)))
            return
        if hello.role == "stream" and hello.session == self.session and hello.rank in self._allowed:
            from flare.hosts.distribution import serve_stream
            try:
                serve_stream(channel, self.files, self._allowed[hello.rank])
            except ChannelError:
                channel.close()
            return
        if hello.role == "rank":
            self._admit(channel, hello.rank)
            return
        channel.close()

    def _admit(self, channel: Channel, rank: int) -> None:
        with self._lock:
            problem = (f"rank {rank} is outside this launch's ranks 1-{self.ranks - 1}" if rank not in self._allowed
                       else f"rank {rank} has joined already, from {self.peers[rank].channel.peer}"
                       if rank in self.peers else None)
            if problem is None:
                channel.peer = f"rank {rank} ({channel.peer})"
                self.peers[rank] = _Peer(rank, channel)
        if problem is not None:
            channel.send(Refused(f"rank zero at {self.address} refused: {problem}; start each peer once with its "
                                 f"own --rank between 1 and {self.ranks - 1}", UsageError.exit_code))
            channel.close()
            return
        envelope = Envelope(self.files.primary.manifest_body, self.files.primary.signature,
                            self.files.primary.profile_json)
        channel.send(Offer(envelope, self.deployment.name, self.ranks, rank, self.session, self.streams))
        self.heartbeats.add(channel)
        self.events.put((rank, "joined"))
        self._read(rank, channel)

    def _read(self, rank: int, channel: Channel) -> None:
        while not self._closed.is_set():
            try:
                message = channel.receive(timeout=SILENT_LIMIT_S)
            except ChannelError as error:
                if not self._closed.is_set():
                    self._fail(LaunchFailed(f"{channel.peer} {gone(error)}; every rank of the launch ends"))
                return
            if not isinstance(message, Heartbeat):
                self.events.put((rank, message))

    def _fail(self, failure: LaunchFailed) -> None:
        self.events.put((-1, failure))
        if self.on_failure is not None:
            self.abort(str(failure), failure.exit_code)
            self.on_failure(failure)

    def missing(self) -> list[int]:
        return [rank for rank in range(1, self.ranks) if rank not in self.peers]

    def gather(self, join_timeout_s: float = JOIN_TIMEOUT_S) -> dict[int, Staged]:
        """Wait until every peer is staged; a failure anywhere aborts every rank and is raised here."""
        deadline = time.monotonic() + join_timeout_s
        self.out(f"waiting for {_ranks_text(self.missing())} at {self.address}: start each with "
                 f"`flare run --rank K --rendezvous {self.address}`")
        staged: dict[int, Staged] = {}
        while len(staged) < self.ranks - 1:
            wait = deadline - time.monotonic() if self.missing() else SILENT_LIMIT_S * 3
            try:
                rank, event = self.events.get(timeout=max(0.1, wait))
            except queue.Empty:
                if not self.missing():
                    continue
                failure = LaunchFailed(f"{_ranks_text(self.missing())} did not join rank zero at "
                                       f"{self.address} within {join_timeout_s:.0f} s; start them with `flare run "
                                       f"--rank K --rendezvous {self.address}`, or check that this address reaches "
                                       "this host from theirs")
                self.abort(str(failure), failure.exit_code)
                raise failure
            staged.update(self._handle(rank, event))
        return staged

    def _handle(self, rank: int, event: Any) -> dict[int, Staged]:
        if event == "joined":
            self.out(f"{self.peers[rank].channel.peer} joined")
            return {}
        if isinstance(event, Staged):
            self.out(f"rank {rank} staged and verified its payloads: {_gib(event.received_bytes)} received, "
                     f"{_gib(event.reused_bytes)} already in its cache")
            return {rank: event}
        if isinstance(event, LaunchFailed):
            failure = event
        elif isinstance(event, Failed):
            failure = LaunchFailed(f"rank {rank} failed: {event.reason}", event.exit_code)
        else:
            failure = LaunchFailed(f"rank {rank} sent {type(event).__name__} before it was staged")
        self.abort(str(failure), failure.exit_code)
        raise failure

    def finish(self, message: str) -> None:
        self._broadcast(Finish(message))
        self.close()

    def start(self, store_port: int, timeout_s: float) -> None:
        self._broadcast(Start(store_port, timeout_s))

    def abort(self, reason: str, exit_code: int = 1) -> None:
        self._broadcast(Abort(reason, exit_code))
        self.close()

    def _broadcast(self, message: Any) -> None:
        for peer in list(self.peers.values()):
            try:
                peer.channel.send(message)
            except ChannelError:
                pass

    def close(self) -> None:
        self._closed.set()
        self.heartbeats.stopped.set()
        if self._socket is not None:
            self._socket.close()
        for peer in list(self.peers.values()):
            peer.channel.close()


def _ranks_text(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(rank) for rank in ranks)


def _gib(size: int) -> str:
    return f"{size / (1 << 30):.2f} GiB"


# ---- a peer ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PeerOptions:
    rendezvous: Address
    rank: int
    cache_root: Path
    trust: Any                                  # flare.package.TrustOptions, from the peer's own flags
    package: Path | None = None                 # a local copy of the package, which must be rank zero's
    join_timeout_s: float = JOIN_TIMEOUT_S


@dataclass
class PeerSession:
    """A staged peer: its verified package (a rank copy or a local package), and rank zero's connection."""

    rank: int
    ranks: int
    offer: Offer
    package: Any                                # flare.package.Package, verified over this rank's payloads
    channel: Channel
    heartbeats: _Heartbeats

    def wait(self) -> Finish | Start:
        """Rank zero's word after staging; an Abort or a silent rank zero is raised as LaunchFailed."""
        while True:
            try:
                message = self.channel.receive(timeout=SILENT_LIMIT_S)
            except ChannelError as error:
                raise LaunchFailed(f"{self.channel.peer} {gone(error)}; this rank ends with it") from None
            if isinstance(message, Abort):
                raise LaunchFailed(message.reason, message.exit_code)
            if isinstance(message, (Finish, Start)):
                return message

    def close(self) -> None:
        self.heartbeats.stopped.set()
        self.channel.close()


def connect_with_retry(address: Address, timeout_s: float, out: Callable[[str], None]) -> Channel:
    """rank zero's control connection; rank zero may start after its peers, so wait up to timeout_s."""
    deadline, told = time.monotonic() + timeout_s, False
    while True:
        try:
            return Channel(connect(address, 10.0), f"rank zero at {address}", RANKS)
        except OSError as error:
            if time.monotonic() > deadline:
                raise LaunchFailed(f"rank zero at {address} did not answer within {timeout_s:.0f} s "
                                   f"({error.strerror or error}); start it with `flare run PACKAGE --rank 0 "
                                   f"--rendezvous {address}`, or check that the address reaches it") from None
            if not told:
                out(f"rank zero at {address} is not listening yet ({error.strerror or error}); waiting")
                told = True
            time.sleep(CONNECT_RETRY_S)


def join_rank_zero(options: PeerOptions, stages: Any) -> PeerSession:
    """Connect, receive the offer, stage this rank's payloads and verify them; tell rank zero either way."""
    from flare.hosts import peer_staging

    with stages.stage("Join rank zero") as stage:
        channel = connect_with_retry(options.rendezvous, options.join_timeout_s, stages.line)
        try:
            client_handshake(channel, PROTOCOL_NAME, "rank", rank=options.rank)
        except RemoteRefusal:
            channel.close()
            raise
        offer = channel.receive(timeout=30.0)
        if isinstance(offer, Refused):
            raise RemoteRefusal(offer.reason, offer.exit_code)
        if not isinstance(offer, Offer):
            raise ChannelError(f"{channel.peer} sent {type(offer).__name__} instead of its offer")
        stage.note(f"rank {offer.rank} of {offer.ranks}, {Primary(offer.envelope.manifest_body, b'', '', 'directory').manifest.label}")
    heartbeats = _Heartbeats()
    heartbeats.add(channel)
    try:
        package, staged = peer_staging.stage_rank(options, offer, channel.peer, stages)
    except BaseException as error:
        reason, code = describe_failure(error)
        try:
            channel.send(Failed(reason, code))
        except ChannelError:
            pass
        heartbeats.stopped.set()
        channel.close()
        raise
    channel.send(staged)
    return PeerSession(offer.rank, offer.ranks, offer, package, channel, heartbeats)
