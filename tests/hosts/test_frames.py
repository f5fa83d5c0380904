"""Frames between hosts: the build check, the preparation token's proof, and frames refused when altered."""

from __future__ import annotations

import os
import socket
import threading

import msgspec
import pytest

from flare.hosts import frames, handshake
from flare.hosts.build import BuildMismatch, this_build
from flare.hosts.token import TokenError, load_token


class Note(msgspec.Struct, tag="note", frozen=True):
    text: str


PROTOCOL = frames.Protocol(handshake.Hello | handshake.Welcome | handshake.Refused | handshake.Proof | Note)


def write_token(directory, secret: bytes):
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "agent.token"
    path.write_bytes(secret + b"\n")
    os.chmod(path, 0o600)
    return load_token(directory)


def channels():
    left, right = socket.socketpair()
    return frames.Channel(left, "the client", PROTOCOL), frames.Channel(right, "the server", PROTOCOL)


def shake(client_token, server_token):
    """Run both sides of the handshake; returns (client result or error, server result or error, channels)."""
    client, server = channels()
    outcome = {}

    def serve():
        try:
            outcome["server"] = handshake.server_handshake(server, "test", server_token)
        except Exception as error:          # noqa: BLE001 - the test inspects it
            outcome["server"] = error

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        outcome["client"] = handshake.client_handshake(client, "test", "rank", client_token, rank=1)
    except Exception as error:              # noqa: BLE001
        outcome["client"] = error
    thread.join(10)
    return outcome["client"], outcome["server"], client, server


def test_same_token_authenticates_frames_and_an_altered_byte_is_refused(tmp_path):
    token = write_token(tmp_path / "a", os.urandom(48))
    _, hello, client, server = shake(token, token)
    assert hello.rank == 1
    client.send(Note("first"))
    assert server.receive(5) == Note("first")
    body = PROTOCOL.encode(Note("second"))
    sealed = bytearray(client.sealer.seal(body))
    sealed[3] ^= 0x01                                         # one bit, as a faulty link would
    client.sock.sendall(frames.LENGTH.pack(len(sealed)) + bytes(sealed))
    with pytest.raises(frames.FrameRefused, match="altered in transit"):
        server.receive(5)


def test_a_replayed_frame_is_refused(tmp_path):
    token = write_token(tmp_path / "a", os.urandom(48))
    _, _, client, server = shake(token, token)
    sealed = client.sealer.seal(PROTOCOL.encode(Note("once")))
    client.sock.sendall(frames.LENGTH.pack(len(sealed)) + sealed)
    assert server.receive(5) == Note("once")
    client.sock.sendall(frames.LENGTH.pack(len(sealed)) + sealed)
    with pytest.raises(frames.FrameRefused):
        server.receive(5)


def test_a_different_token_is_named_on_both_sides(tmp_path):
    ours = write_token(tmp_path / "a", os.urandom(48))
    theirs = write_token(tmp_path / "b", os.urandom(48))
    client_error, server_error, *_ = shake(ours, theirs)
    assert isinstance(client_error, TokenError) and str(ours.path) in str(client_error)
    assert "different preparation token" in str(client_error)
    assert isinstance(server_error, TokenError) and str(theirs.path) in str(server_error)


def test_a_missing_token_names_the_file_and_how_to_make_it(tmp_path):
    with pytest.raises(TokenError) as missing:
        load_token(tmp_path)
    assert str(tmp_path / "agent.token") in str(missing.value)
    assert "head -c 48 /dev/urandom | base64" in str(missing.value) and "chmod 600" in str(missing.value)


def test_a_short_or_shared_token_is_refused(tmp_path):
    with pytest.raises(TokenError, match="fewer than 32"):
        write_token(tmp_path / "short", b"x" * 31)
    path = tmp_path / "open" / "agent.token"
    path.parent.mkdir()
    path.write_bytes(os.urandom(48))
    os.chmod(path, 0o644)
    with pytest.raises(TokenError, match="chmod 600"):
        load_token(path.parent)


def test_another_build_is_refused_naming_both():
    client, server = channels()
    other = handshake.Hello("test", this_build().version, "0123456789ab", "rank", 1, b"", os.urandom(32))
    thread = threading.Thread(target=lambda: client.send(other))
    thread.start()
    with pytest.raises(BuildMismatch) as refused:
        handshake.server_handshake(server, "test")
    thread.join()
    text = str(refused.value)
    assert "source 0123456789ab" in text and f"source {this_build().source}" in text
    welcome = client.receive(5)                  # the client is told this host's build, to word its own refusal
    assert welcome.source == this_build().source


def test_encrypted_frames_round_trip_and_refuse_alteration():
    client, server = channels()
    keys = os.urandom(32), os.urandom(32)
    client.secure(frames.Encrypted(*keys))
    server.secure(frames.Encrypted(keys[1], keys[0]))
    client.send(Note("secret"))
    assert server.receive(5) == Note("secret")
    sealed = bytearray(client.sealer.seal(PROTOCOL.encode(Note("again"))))
    sealed[0] ^= 0x80
    client.sock.sendall(frames.LENGTH.pack(len(sealed)) + bytes(sealed))
    with pytest.raises(frames.FrameRefused):
        server.receive(5)
