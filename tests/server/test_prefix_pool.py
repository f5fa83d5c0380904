"""The shared pool of retained prefix states: a `flare prefix-pool` manager on a Unix socket and loopback
TCP (plain or TLS), its bounded store, and servers of one package sharing pages through it."""

from __future__ import annotations

import datetime
import ipaddress
import threading

import pytest

from flare.engine.retention.pool_client import PoolClient
from flare.engine.retention.settings import PoolRetention, RetentionSettings
from flare.errors import UsageError
from flare.server.prefix_pool import PageStore, PoolOptions, check_options, parse_listen, serve_pool
from tests.server.conftest import free_port

IDENTITY, LAYOUT = "5a" * 32, "float32[2,4,4,8]"


class Manager:
    """A pool manager on a thread of the test."""

    def __init__(self, *listen: str, memory: int = 1 << 20, certificate=None, key=None) -> None:
        self.options = PoolOptions("test-pool", memory, parse_listen(listen), certificate, key)
        self.ready, self.stop = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=serve_pool, args=(self.options, self.ready, self.stop), daemon=True)

    def __enter__(self) -> "Manager":
        self.thread.start()
        assert self.ready.wait(30), "the pool manager did not start"
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(30)


def client(address: str, notes: list, ca=None, identity: str = IDENTITY, page_bytes: int = 8) -> PoolClient:
    return PoolClient(PoolRetention(address, str(ca) if ca else None), identity, LAYOUT, page_bytes, notes.append)


def page(fill: int, size: int = 8) -> list[memoryview]:
    return [memoryview(bytearray([fill] * (size // 2))), memoryview(bytearray([fill + 1] * (size // 2)))]


def test_the_store_keeps_its_memory_bound_least_recently_used_first():
    store = PageStore(memory_bytes=30)
    store.put("s", [(b"a", b"x" * 10), (b"b", b"y" * 10), (b"c", b"z" * 10)], "i")
    store.get("s", [b"a"])                                     # "a" used: "b" is now the oldest
    store.put("s", [(b"d", b"w" * 10)], "i")
    assert [key for key, payload in store.get("s", [b"a", b"b", b"c", b"d"]) if payload] == [b"a", b"c", b"d"]
    assert store.used_bytes == 30 and store.get("other scope", [b"a"]) == ((b"a", None),)


def test_servers_of_one_package_share_pages_and_no_other_package_sees_them(tmp_path):
    with Manager(f"unix:{tmp_path / 'pool.sock'}"):
        notes = []
        writer, reader = client(f"unix:{tmp_path / 'pool.sock'}", notes), client(f"unix:{tmp_path / 'pool.sock'}", notes)
        writer.put([(b"k1", page(1)), (b"k2", page(3))])
        wanted = [(b"k1", page(0)), (b"k2", page(0)), (b"k3", page(0))]
        assert reader.get(wanted) == {b"k1", b"k2"}
        assert bytes(wanted[0][1][0]) + bytes(wanted[0][1][1]) == bytes([1] * 4 + [2] * 4)
        stranger = client(f"unix:{tmp_path / 'pool.sock'}", notes, identity="77" * 32)
        assert stranger.get([(b"k1", page(0))]) == set()
        assert (tmp_path / "pool.sock").stat().st_mode & 0o777 == 0o600
        assert all("sharing retained states" in note for note in notes)


def test_an_answer_carries_at_most_its_bound_of_pages():
    store = PageStore(memory_bytes=100)
    store.put("s", [(b"a", b"x" * 10), (b"b", b"y" * 10), (b"c", b"z" * 10)], "i")
    assert [payload is not None for _, payload in store.get("s", [b"a", b"b", b"c"], limit_bytes=25)] == [True, True, False]


def test_the_manager_reads_no_body_past_its_bound_and_refuses_what_is_not_a_pool_message(tmp_path, monkeypatch):
    import httpx

    from flare.server import prefix_pool

    monkeypatch.setattr(prefix_pool, "MAX_BODY_BYTES", 1024)
    with Manager(f"unix:{tmp_path / 'pool.sock'}"):
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(tmp_path / "pool.sock")), base_url="http://pool") as http:
            assert http.post("/v1/pool/put", content=bytes(2048)).status_code == 413
            assert http.post("/v1/pool/get", content=b"not msgpack").status_code == 400


def test_a_manager_that_is_not_there_yet_or_any_more_is_asked_again(tmp_path, monkeypatch):
    from flare.engine.retention import pool_client

    monkeypatch.setattr(pool_client, "RETRY_S", 0.0)         # asked again at once
    socket = f"unix:{tmp_path / 'pool.sock'}"
    notes = []
    early = client(socket, notes)
    assert early.get([(b"k", page(0))]) == set()             # the servers started before their pool
    assert early.disabled is None and "paused for this server" in notes[-1]
    with Manager(socket):
        early.put([(b"k", page(9))])
        assert early.get([(b"k", page(0))]) == {b"k"}
    assert early.get([(b"k", page(0))]) == set()             # the manager stopped
    with Manager(socket):                                     # and came back, empty
        assert early.get([(b"k", page(0))]) == set() and early.disabled is None
        early.put([(b"k", page(9))])
        assert early.get([(b"k", page(0))]) == {b"k"}
    paused = [note for note in notes if "paused" in note]
    shared = [note for note in notes if note.startswith("sharing retained states through the pool 'test-pool'")]
    assert len(paused) == 2 and len(shared) == 2
    assert not shared[0].endswith(" again") and shared[1].endswith(" again")


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    """A CA and a certificate for 127.0.0.1 it signed (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    folder = tmp_path_factory.mktemp("pool-tls")
    now = datetime.datetime.now(datetime.timezone.utc)

    def certificate(subject, issuer, public_key, signing_key, ca: bool):
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
                   .not_valid_after(now + datetime.timedelta(days=2))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                            critical=False)
        return builder.sign(signing_key, hashes.SHA256())

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pool test CA")])
    server_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    ca_cert = certificate(ca_name, ca_name, ca_key.public_key(), ca_key, True)
    server_cert = certificate(server_name, ca_name, server_key.public_key(), ca_key, False)
    pem = serialization.Encoding.PEM
    (folder / "ca.pem").write_bytes(ca_cert.public_bytes(pem))
    (folder / "server.pem").write_bytes(server_cert.public_bytes(pem))
    (folder / "server.key").write_bytes(server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                                 serialization.NoEncryption()))
    return folder


def test_a_tls_manager_serves_tls_clients_with_its_ca_and_unix_clients_alike(tmp_path, certificates):
    port = free_port()
    with Manager(f"unix:{tmp_path / 'pool.sock'}", f"tls:127.0.0.1:{port}",
                 certificate=certificates / "server.pem", key=certificates / "server.key"):
        notes = []
        secure = client(f"tls:127.0.0.1:{port}", notes, ca=certificates / "ca.pem")
        secure.put([(b"k", page(5))])
        assert secure.disabled is None
        assert client(f"unix:{tmp_path / 'pool.sock'}", notes).get([(b"k", page(0))]) == {b"k"}

        plain = client(f"127.0.0.1:{port}", notes)             # a plain TCP client at a TLS listener
        assert plain.get([(b"k", page(0))]) == set() and plain.disabled is not None
        unverified = client(f"tls:127.0.0.1:{port}", notes)    # the host's trust store does not know our CA
        assert unverified.get([(b"k", page(0))]) == set() and "CERTIFICATE_VERIFY_FAILED" in unverified.disabled
        off = [note for note in notes if "is off for this server" in note]
        assert len(off) == 2 and "needs a tls: address" in off[0]


def test_a_tls_client_of_a_plain_manager_turns_the_pool_off(tmp_path, certificates):
    port = free_port()
    with Manager(f"127.0.0.1:{port}"):
        notes = []
        assert client(f"tls:127.0.0.1:{port}", notes, ca=certificates / "ca.pem").get([(b"k", page(0))]) == set()
        assert "is off for this server" in notes[0]
        working = client(f"127.0.0.1:{port}", notes)
        working.put([(b"k", page(7))])
        assert working.get([(b"k", page(0))]) == {b"k"}


@pytest.mark.parametrize("listen,extra,reason", [
    (("unix:/tmp/a", "unix:/tmp/b"), {}, "one Unix socket"),
    (("127.0.0.1:7000", "tls:127.0.0.1:7001"), {}, "one TCP address"),
    (("tls:127.0.0.1:7000",), {}, "needs --certificate"),
    (("127.0.0.1:7000",), {"certificate": "c.pem", "key": "k.pem"}, "serve a tls:HOST:PORT listener"),
    ((), {}, "at least one --listen"),
])
def test_manager_options_are_checked(listen, extra, reason):
    with pytest.raises(UsageError, match=reason):
        check_options(PoolOptions("p", 1 << 20, parse_listen(listen), **extra))


def test_two_engines_share_a_prefix_through_the_pool(tmp_path, stories260k):
    from flare.engine.config import EngineConfig
    from flare.engine.sampling_params import SamplingParams
    from flare.engine_client.llm_engine import LLMEngine

    retention = RetentionSettings(host_bytes=1 << 20, identity=IDENTITY,
                                  pool=PoolRetention(f"unix:{tmp_path / 'pool.sock'}"))
    config = EngineConfig(page_size=4, num_pages=40, max_model_len=128, prefix_retention=retention)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    with Manager(f"unix:{tmp_path / 'pool.sock'}", memory=64 << 20):
        first = LLMEngine.from_checkpoint(stories260k, config)
        ids = first.tokenizer.encode("Once upon a time there was a little girl named Lily. She liked to play outside")
        [answer] = first.generate([ids], greedy)
        while first.core.has_unfinished():                    # as the engine process steps on: its pages
            first.core.step()                                  # are saved to the host and offered to the pool
        first.core.close()
        second = LLMEngine.from_checkpoint(stories260k, config)
        [again] = second.generate([ids], greedy)
        stats = second.core.stats()
        second.core.close()
    assert again.new_token_ids == answer.new_token_ids
    assert again.num_cached_tokens == stats.prefix_cache_pool_hit_tokens == (len(ids) - 1) // 4 * 4
