"""The first exchange of every connection between ranks: protocol, build and (preparation) the token.

    client:  Hello(protocol, build, role, rank, nonce)  ->
    server:                                             <-  Welcome(build, nonce, proof) | Refused(reason)
    client:  Proof(proof)                               ->   (token-authenticated protocols only)

A build other than this host's is refused on both sides, naming both (`build.check_same_build`). With a
preparation token, each side proves it holds the same token (HMAC-SHA256 of both nonces under it, one
label per side) before anything else is sent, and the channel is then sealed with per-direction keys
derived from the token and the nonces (HKDF-SHA256), so a host with another token is told which file
differs, and frames altered in transit are refused. Without a token the channel stays plain.
"""

from __future__ import annotations

import hashlib
import hmac
import os

import msgspec

from flare.errors import FlareError, UsageError
from flare.hosts.build import Build, check_same_build, this_build
from flare.hosts.frames import Authenticated, Channel, ChannelError
from flare.hosts.token import PreparationToken, differs_error

NONCE_BYTES = 32
HANDSHAKE_TIMEOUT_S = 30.0


class Hello(msgspec.Struct, tag="hello", frozen=True):
    protocol: str
    version: str
    source: str
    role: str                        # "rank", "stream", ...: what the connection is for
    rank: int = -1
    session: bytes = b""             # a data stream names the session it belongs to
    nonce: bytes = b""


class Welcome(msgspec.Struct, tag="welcome", frozen=True):
    version: str
    source: str
    nonce: bytes
    proof: bytes = b""


class Refused(msgspec.Struct, tag="refused", frozen=True):
    """The other side will not go on: the reason, as a one-paragraph error, and its exit code."""

    reason: str
    exit_code: int = 1


class Proof(msgspec.Struct, tag="proof", frozen=True):
    proof: bytes


HANDSHAKE_MESSAGES = (Hello, Welcome, Refused, Proof)


class RemoteRefusal(FlareError):
    """The other host refused: its reason, with its exit code."""

    def __init__(self, reason: str, exit_code: int = 1) -> None:
        super().__init__(reason)
        self.exit_code = exit_code


def _build_of(message: Hello | Welcome) -> Build:
    return Build(message.version, message.source)


def _proof(token: PreparationToken, side: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.digest(token.secret, b"flare preparation " + side + client_nonce + server_nonce, hashlib.sha256)


def _session_keys(token: PreparationToken, client_nonce: bytes, server_nonce: bytes) -> tuple[bytes, bytes]:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    keys = HKDF(hashes.SHA256(), 64, client_nonce + server_nonce, b"flare preparation frames").derive(token.secret)
    return keys[:32], keys[32:]                     # client to server, server to client


def client_handshake(channel: Channel, protocol: str, role: str, token: PreparationToken | None = None,
                     rank: int = -1, session: bytes = b"") -> Welcome:
    """Introduce this host to a server; raises the server's refusal, or a BuildMismatch / TokenError."""
    build = this_build()
    nonce = os.urandom(NONCE_BYTES)
    channel.send(Hello(protocol, build.version, build.source, role, rank, session, nonce))
    answer = channel.receive(timeout=HANDSHAKE_TIMEOUT_S)
    if isinstance(answer, Refused):
        raise RemoteRefusal(answer.reason, answer.exit_code)
    if not isinstance(answer, Welcome):
        raise ChannelError(f"{channel.peer} answered {type(answer).__name__} to a hello; it does not speak {protocol}")
    check_same_build(_build_of(answer), channel.peer)
    if token is not None:
        if not hmac.compare_digest(answer.proof, _proof(token, b"server", nonce, answer.nonce)):
            channel.send(Refused(str(differs_error(token.path, "this host")), UsageError.exit_code))
            raise differs_error(token.path, channel.peer)
        channel.send(Proof(_proof(token, b"client", nonce, answer.nonce)))
        to_server, to_client = _session_keys(token, nonce, answer.nonce)
        channel.secure(Authenticated(to_server, to_client))
    return answer


def server_handshake(channel: Channel, protocol: str, token: PreparationToken | None = None) -> Hello:
    """Answer a client's hello: refuse another protocol or build (the client, given this build, words its
    own refusal), check its token proof; returns its Hello."""
    hello = channel.receive(timeout=HANDSHAKE_TIMEOUT_S)
    if not isinstance(hello, Hello) or hello.protocol != protocol:
        raise ChannelError(f"{channel.peer} does not speak {protocol}")
    build = this_build()
    nonce = os.urandom(NONCE_BYTES)
    if _build_of(hello) != build:
        channel.send(Welcome(build.version, build.source, nonce))     # the client words its own refusal
        check_same_build(_build_of(hello), channel.peer)
    proof = _proof(token, b"server", hello.nonce, nonce) if token is not None else b""
    channel.send(Welcome(build.version, build.source, nonce, proof))
    if token is not None:
        answer = channel.receive(timeout=HANDSHAKE_TIMEOUT_S)
        if isinstance(answer, Refused) or not isinstance(answer, Proof) or not hmac.compare_digest(
                answer.proof, _proof(token, b"client", hello.nonce, nonce)):
            raise differs_error(token.path, channel.peer)
        to_server, to_client = _session_keys(token, hello.nonce, nonce)
        channel.secure(Authenticated(to_client, to_server))
    return hello
