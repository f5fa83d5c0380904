"""Trust accepts exactly the signing key's fingerprint with its namespace, remembers it, and can revoke it."""

from __future__ import annotations

import http.server
import io
import json
import threading

import pytest

from flare.errors import UsageError
from flare.package.keys import keygen
from flare.package.reader import open_package
from flare.package.signing import (Profile, SigningIdentity, generate_private_key, private_key_pem,
                                   write_owner_only)
from flare.package.trust import SignatureError, TrustError, TrustOptions, TrustStore


def _options(**fields):
    fields.setdefault("offline", True)
    fields.setdefault("interactive", False)
    return TrustOptions(**fields)


def test_unattended_load_needs_both_exact_values(export, dev_fingerprint):
    entry = export()
    with pytest.raises(TrustError, match="not accepted yet"):
        open_package(entry, _options())
    near_keys = [dev_fingerprint.upper(), dev_fingerprint[:-1], dev_fingerprint[:-1] + "0"
                 if dev_fingerprint[-1] != "0" else dev_fingerprint[:-1] + "1", " " + dev_fingerprint]
    for key in near_keys:
        with pytest.raises(TrustError, match="does not match the package's signing key"):
            open_package(entry, _options(approve_key=key, accept_publisher="local-development"))
    for namespace in ("Local-development", "local-development ", "local", "local-developments"):
        with pytest.raises(TrustError, match="does not match the package's publisher namespace"):
            open_package(entry, _options(approve_key=dev_fingerprint, accept_publisher=namespace))
    assert TrustStore(TrustOptions().store_path).records() == []
    package = open_package(entry, _options(approve_key=dev_fingerprint, accept_publisher="local-development"))
    assert package.trust.accepted and package.trust.fingerprint == dev_fingerprint
    assert open_package(entry, _options()).trust.accepted            # remembered


def test_each_dangerous_flag_requires_the_other(dev_fingerprint):
    with pytest.raises(UsageError, match="--dangerously-approve-key requires --dangerously-accept-publisher"):
        TrustOptions(approve_key=dev_fingerprint)
    with pytest.raises(UsageError, match="--dangerously-accept-publisher requires --dangerously-approve-key"):
        TrustOptions(accept_publisher="local-development")


def test_terminal_acceptance_shows_the_disclosure_and_needs_the_typed_namespace(export, dev_fingerprint,
                                                                              monkeypatch):
    entry = export()
    stream = io.StringIO()
    monkeypatch.setattr("sys.stdin", io.StringIO("local-developmen\n"))
    with pytest.raises(TrustError, match="nothing was accepted"):
        open_package(entry, _options(interactive=True), stream=stream)
    text = stream.getvalue()
    assert "publisher:   local-development" in text and dev_fingerprint in text
    assert "license:" in text and "identity:    unverified" in text
    monkeypatch.setattr("sys.stdin", io.StringIO("local-development\n"))
    assert open_package(entry, _options(interactive=True), stream=io.StringIO()).trust.accepted
    assert open_package(entry, _options()).trust.accepted


def test_revoke_forgets_acceptance(export, dev_fingerprint, tmp_path):
    from flare.cli.flare import main
    entry = export()
    store = tmp_path / "trust.toml"
    open_package(entry, _options(approve_key=dev_fingerprint, accept_publisher="local-development", trust_store=store))
    assert main(["trust", "revoke", dev_fingerprint, "--trust-store", str(store)]) == 0
    with pytest.raises(TrustError, match="not accepted yet"):
        open_package(entry, _options(trust_store=store))
    assert main(["trust", "revoke", dev_fingerprint, "--trust-store", str(store)]) == 2


def test_a_package_needs_a_key_that_matches_its_signer(export, approved, tmp_path, isolated_home):
    entry = export()
    (isolated_home / ".config/flare/development-publisher.json").unlink()
    # strip the embedded profile, so only the explicit (foreign) profile offers a key
    other = tmp_path / "keys"
    other.mkdir()
    (tmp_path / "pass").write_text("secret")
    keygen(other / "key.pem", "someone", "https://huggingface.co/someone/model", tmp_path / "pass")
    from flare.package import format as fmt
    files = fmt.read_package_files(entry)
    stripped = fmt.Primary(files.primary.manifest_body, files.primary.signature, "", "directory")
    primary = entry / "model.safetensors"
    primary.chmod(0o644)
    primary.unlink()
    fmt.write_primary(primary, stripped)
    with pytest.raises(SignatureError, match="no profile supplies it; pass its publisher.json"):
        open_package(entry, _options(publisher_keys=(other / "publisher.json",)))


class _ProfileServer:
    """A loopback stand-in for the publisher's official source."""

    def __init__(self):
        self.body: bytes | None = None
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if outer.body is None or not self.path.endswith("/resolve/main/publisher.json"):
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.end_headers()
                self.wfile.write(outer.body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/example/model"

    def close(self):
        self.server.shutdown()


@pytest.fixture
def published(export, tmp_path):
    """An export signed by a production identity whose official source is a loopback server."""
    server = _ProfileServer()
    key = generate_private_key()
    write_owner_only(tmp_path / "key.pem", private_key_pem(key, None))      # unencrypted keys are accepted
    profile_path = tmp_path / "publisher.json"
    profile_path.write_text(SigningIdentity(key, "example", server.url).profile.to_json())
    config = tmp_path / "config.toml"
    config.write_text(f'[publishing]\nsigning_key = "{tmp_path / "key.pem"}"\nnamespace = "example"\n'
                      f'official_source = "{server.url}"\n')
    yield export(config_path=config), server, profile_path
    server.close()


def test_online_check_confirms_identity(published):
    entry, server, profile_path = published
    server.body = profile_path.read_bytes()
    fingerprint = Profile.load(profile_path).keys[0].fingerprint
    package = open_package(entry, _options(offline=False, approve_key=fingerprint, accept_publisher="example"))
    assert package.trust.identity == "verified"


def test_a_profile_that_omits_the_key_rejects_even_remembered_trust(published, tmp_path):
    entry, server, profile_path = published
    fingerprint = Profile.load(profile_path).keys[0].fingerprint
    open_package(entry, _options(approve_key=fingerprint, accept_publisher="example"))      # remembered offline
    fields = json.loads(profile_path.read_text())
    fields["keys"] = []
    server.body = json.dumps(fields).encode()
    with pytest.raises(TrustError, match="does not list key .* It cannot be loaded"):
        open_package(entry, _options(offline=False))
    assert open_package(entry, _options(offline=True)).trust.accepted


def test_an_absent_profile_leaves_identity_unverified(published):
    entry, server, profile_path = published
    fingerprint = Profile.load(profile_path).keys[0].fingerprint
    package = open_package(entry, _options(offline=False, approve_key=fingerprint, accept_publisher="example"))
    assert package.trust.identity.startswith("unverified:") and "does not exist" in package.trust.identity
