"""Encrypted control sessions between a controller and an agent, both identified by Ed25519 keys.

    controller: ClientHello(build, x25519 ephemeral, nonce)                         ->
    agent:                        <-  ServerHello(build, x25519 ephemeral, agent key, signature)
    both:       keys = HKDF-SHA256(X25519(ephemerals), salt = transcript), one per direction
    controller: ClientAuth(controller key, signature)            ->   (the first encrypted frame)

The agent signs the transcript of the hellos, the controller the transcript extended by the agent's
signature and its own key, so neither ephemeral key can be swapped by a party in between; the
controller checks the agent's key against the one pinned at pairing (while pairing it has none, and
the pairing code's proofs stand in, `pairing`). Every later frame is ChaCha20-Poly1305 with a
per-direction counter nonce (`flare.hosts.frames.Encrypted`). Builds are compared first: an agent of
another build is refused naming both, before anything else is said.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import msgspec

from flare.hosts.build import Build, check_same_build, this_build
from flare.hosts.frames import Channel, ChannelError, Encrypted, FrameRefused
from flare.orbit.identity import Identity
from flare.package.signing import PublicKey

PROTOCOL = "flare-orbit/1"
HANDSHAKE_TIMEOUT_S = 30.0


class ClientHello(msgspec.Struct, tag="client-hello", frozen=True):
    protocol: str
    version: str
    source: str
    ephemeral: bytes
    nonce: bytes


class ServerHello(msgspec.Struct, tag="server-hello", frozen=True):
    version: str
    source: str
    ephemeral: bytes
    identity: bytes
    signature: bytes


class ClientAuth(msgspec.Struct, tag="client-auth", frozen=True):
    identity: bytes
    signature: bytes



@dataclass(frozen=True)
class Session:
    """An established session: the channel (encrypted from now on), the other side's key, the transcript
    hash both signed (pairing proofs bind to it)."""

    channel: Channel
    peer_key: PublicKey
    transcript: bytes


def _ephemeral():
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    private = X25519PrivateKey.generate()
    return private, private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _keys(private, peer_ephemeral: bytes, transcript: bytes) -> tuple[bytes, bytes]:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    shared = private.exchange(X25519PublicKey.from_public_bytes(peer_ephemeral))
    keys = HKDF(hashes.SHA256(), 64, transcript, b"flare orbit session keys").derive(shared)
    return keys[:32], keys[32:]                  # controller to agent, agent to controller


def _hello_transcript(encoder, hello: ClientHello, server: ServerHello) -> bytes:
    unsigned = (server.version, server.source, server.ephemeral, server.identity)
    return hashlib.sha256(PROTOCOL.encode() + encoder.encode(hello) + encoder.encode(unsigned)).digest()


def _auth_transcript(first: bytes, server: ServerHello, identity: bytes) -> bytes:
    return hashlib.sha256(first + server.signature + identity).digest()


def open_session(channel: Channel, identity: Identity, pinned: PublicKey | None, who: str) -> Session:
    """The controller's side. `pinned`: the agent key recorded at pairing (None while pairing)."""
    build = this_build()
    private, ephemeral = _ephemeral()
    hello = ClientHello(PROTOCOL, build.version, build.source, ephemeral, os.urandom(32))
    channel.send(hello)
    server = channel.receive(timeout=HANDSHAKE_TIMEOUT_S)
    if not isinstance(server, ServerHello):
        raise ChannelError(f"{who} answered {type(server).__name__}; it is not a Flare agent")
    check_same_build(Build(server.version, server.source), f"the agent on {who}")
    agent_key = PublicKey(server.identity)
    first = _hello_transcript(channel.protocol.encoder, hello, server)
    if not agent_key.verify(server.signature, b"flare orbit agent" + first):
        raise FrameRefused(f"{who}'s handshake signature does not verify: someone between us altered it")
    if pinned is not None and agent_key.fingerprint != pinned.fingerprint:
        raise FrameRefused(f"{who} answered with key {agent_key.fingerprint}, not the key {pinned.fingerprint} it "
                           "was paired with: another machine answers at that address, or the agent was reset. "
                           f"If it was reset, `flare orbit forget` the node and pair it again")
    to_agent, to_controller = _keys(private, server.ephemeral, first)
    channel.secure(Encrypted(to_agent, to_controller))
    mine = identity.public.raw
    transcript = _auth_transcript(first, server, mine)
    channel.send(ClientAuth(mine, identity.sign(b"flare orbit controller" + transcript)))
    return Session(channel, agent_key, transcript)


def accept_session(channel: Channel, identity: Identity) -> Session:
    """The agent's side: answers any controller; whether it may ask for anything is the agent's decision."""
    hello = channel.receive(timeout=HANDSHAKE_TIMEOUT_S)
    if not isinstance(hello, ClientHello) or hello.protocol != PROTOCOL:
        raise ChannelError(f"{channel.peer} does not speak {PROTOCOL}")
    build = this_build()
    private, ephemeral = _ephemeral()
    unsigned = ServerHello(build.version, build.source, ephemeral, identity.public.raw, b"")
    first = _hello_transcript(channel.protocol.encoder, hello, unsigned)
    server = msgspec.structs.replace(unsigned, signature=identity.sign(b"flare orbit agent" + first))
    channel.send(server)
    check_same_build(Build(hello.version, hello.source), f"the controller at {channel.peer}")
    to_agent, to_controller = _keys(private, hello.ephemeral, first)
    channel.secure(Encrypted(to_controller, to_agent))
    auth = channel.receive(timeout=HANDSHAKE_TIMEOUT_S)
    if not isinstance(auth, ClientAuth):
        raise ChannelError(f"{channel.peer} sent {type(auth).__name__} instead of its key")
    transcript = _auth_transcript(first, server, auth.identity)
    controller_key = PublicKey(auth.identity)
    if not controller_key.verify(auth.signature, b"flare orbit controller" + transcript):
        raise FrameRefused(f"the controller at {channel.peer} signed its handshake wrongly")
    return Session(channel, controller_key, transcript)
