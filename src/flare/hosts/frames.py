"""Messages between hosts: length-prefixed frames over TCP, each one msgspec Struct of one protocol.

    channel = Channel(sock, "rank 1 (10.0.0.6:41234)", Protocol(Union))
    channel.send(Message(...)); channel.receive(timeout=10.0)

A frame is a 4-byte big-endian length and that many bytes, sealed by the channel's `Sealer`:
`PLAIN` (serving distribution: package bytes are checked against the signed manifest instead),
`Authenticated` (preparation: HMAC-SHA256 under a key derived from the preparation token), or
`Encrypted` (orbit control: ChaCha20-Poly1305 under a session key). Sealed frames carry a per-direction
sequence number inside their authentication, so a frame replayed, dropped or reordered in transit
fails like an altered one. Every failure is a `ChannelError` naming the peer: closed, timed out,
malformed, or failing authentication.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import threading
from typing import Any

import msgspec

from flare.errors import FlareError

LENGTH = struct.Struct(">I")
MAX_FRAME_BYTES = 64 * 1024 * 1024          # the largest frame taken once a handshake is done
HANDSHAKE_FRAME_BYTES = 256 * 1024          # and before: an unauthenticated peer cannot make us hold more
MAC_BYTES = 32


class ChannelError(FlareError):
    """A connection to another host failed: closed, timed out, malformed or not authentic."""


class ChannelClosed(ChannelError):
    pass


class ChannelTimeout(ChannelError):
    pass


class FrameRefused(ChannelError):
    """A frame that fails its authentication: altered, replayed or reordered in transit, or sealed with
    another key."""


class Sealer:
    """No sealing: frames are sent as they are."""

    def seal(self, body: bytes) -> bytes:
        return body

    def open(self, sealed: bytes) -> bytes:
        return sealed


PLAIN = Sealer()


class Authenticated(Sealer):
    """HMAC-SHA256 over (sequence number, body) per frame; one key each way."""

    def __init__(self, send_key: bytes, receive_key: bytes) -> None:
        self._send_key, self._receive_key = send_key, receive_key
        self._sent = self._received = 0

    def seal(self, body: bytes) -> bytes:
        mac = hmac.digest(self._send_key, self._sent.to_bytes(8, "big") + body, hashlib.sha256)
        self._sent += 1
        return body + mac

    def open(self, sealed: bytes) -> bytes:
        if len(sealed) < MAC_BYTES:
            raise FrameRefused("failed its authentication")
        body, mac = sealed[:-MAC_BYTES], sealed[-MAC_BYTES:]
        expected = hmac.digest(self._receive_key, self._received.to_bytes(8, "big") + body, hashlib.sha256)
        if not hmac.compare_digest(mac, expected):
            raise FrameRefused("failed its authentication")
        self._received += 1
        return body


class Encrypted(Sealer):
    """ChaCha20-Poly1305 per frame, the sequence number as its nonce; one key each way."""

    def __init__(self, send_key: bytes, receive_key: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

        self._send, self._receive = ChaCha20Poly1305(send_key), ChaCha20Poly1305(receive_key)
        self._sent = self._received = 0

    def seal(self, body: bytes) -> bytes:
        sealed = self._send.encrypt(self._sent.to_bytes(12, "big"), body, None)
        self._sent += 1
        return sealed

    def open(self, sealed: bytes) -> bytes:
        from cryptography.exceptions import InvalidTag

        try:
            body = self._receive.decrypt(self._received.to_bytes(12, "big"), sealed, None)
        except InvalidTag:
            raise FrameRefused("failed its authentication") from None
        self._received += 1
        return body


class Protocol:
    """One codec for the message types of one protocol (a Union of tagged Structs)."""

    def __init__(self, union: Any) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(union)

    def encode(self, message: Any) -> bytes:
        return self.encoder.encode(message)

    def decode(self, body: bytes) -> Any:
        return self.decoder.decode(body)


class Channel:
    """One TCP connection carrying one protocol's messages; `send` may be called from several threads."""

    def __init__(self, sock: socket.socket, peer: str, protocol: Protocol, sealer: Sealer = PLAIN) -> None:
        self.sock, self.peer, self.protocol, self.sealer = sock, peer, protocol, sealer
        self.max_frame = HANDSHAKE_FRAME_BYTES
        self._send_lock = threading.Lock()

    def secure(self, sealer: Sealer) -> None:
        """Seal every later frame (after a handshake) and take frames up to MAX_FRAME_BYTES."""
        self.sealer, self.max_frame = sealer, MAX_FRAME_BYTES

    def send(self, message: Any) -> None:
        body = self.protocol.encode(message)
        with self._send_lock:
            sealed = self.sealer.seal(body)
            try:
                self.sock.sendall(LENGTH.pack(len(sealed)) + sealed)
            except OSError as error:
                raise ChannelClosed(f"the connection to {self.peer} broke ({error.strerror or error})") from None

    def receive(self, timeout: float | None = None) -> Any:
        self.sock.settimeout(timeout)
        (length,) = LENGTH.unpack(self._read(LENGTH.size))
        if length > self.max_frame:
            raise ChannelError(f"{self.peer} sent a frame of {length} bytes, more than the {self.max_frame} "
                               "allowed; it does not speak this protocol")
        sealed = self._read(length)
        try:
            body = self.sealer.open(sealed)
        except FrameRefused as refused:
            raise FrameRefused(f"a frame from {self.peer} {refused}: it was altered in transit or sealed with "
                               "another key; the connection was dropped") from None
        try:
            return self.protocol.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            raise ChannelError(f"{self.peer} sent a malformed message ({error}); it does not speak this "
                               "protocol, or the frame was altered in transit") from None

    def _read(self, count: int) -> bytes:
        chunks, remaining = [], count
        while remaining:
            try:
                chunk = self.sock.recv(min(remaining, 1 << 20))
            except socket.timeout:
                raise ChannelTimeout(f"{self.peer} sent nothing for {self.sock.gettimeout():g} s") from None
            except OSError as error:
                raise ChannelClosed(f"the connection to {self.peer} broke ({error.strerror or error})") from None
            if not chunk:
                raise ChannelClosed(f"{self.peer} closed the connection")
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
