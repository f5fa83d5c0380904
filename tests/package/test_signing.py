"""Development keys are created once and reused; production keys are encrypted; sign promotes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flare.errors import UsageError
from flare.package.keys import change_passphrase, keygen, sign_package
from flare.package.reader import open_package
from flare.package.signing import Profile, development_identity, load_private_key, publishing_identity
from flare.package.trust import TrustOptions

REPO = Path(__file__).resolve().parents[2]


def test_development_key_is_owner_only_and_reused(tmp_path):
    first = development_identity(tmp_path)
    assert (tmp_path / "development-signing-key.pem").stat().st_mode & 0o777 == 0o600
    assert development_identity(tmp_path).public_key == first.public_key
    profile = Profile.load(tmp_path / "development-publisher.json")
    assert profile.namespace == "local-development" and profile.keys == (first.public_key,)


def test_an_official_source_needs_a_publishing_identity(tmp_path):
    with pytest.raises(UsageError, match="--official-source needs a publishing identity"):
        publishing_identity(None, tmp_path, official_source="https://huggingface.co/x/y")


def test_a_key_readable_by_others_is_refused(tmp_path):
    development_identity(tmp_path)
    key = tmp_path / "development-signing-key.pem"
    key.chmod(0o644)
    with pytest.raises(UsageError, match="readable by others"):
        load_private_key(key)


def test_development_fingerprint_helper(tmp_path):
    config = tmp_path / "config.toml"
    result = subprocess.run([sys.executable, "-m", "flare.package.signing", "--development-fingerprint",
                             "--config", str(config)], capture_output=True, text=True,
                            env={"PYTHONPATH": str(REPO / "src"), "HOME": str(tmp_path)}, check=True)
    assert result.stdout.strip() == development_identity(tmp_path).public_key.fingerprint
    assert len(result.stdout.strip()) == 64


def test_keygen_encrypts_and_key_password_keeps_the_identity(tmp_path):
    (tmp_path / "old").write_text("first secret")
    (tmp_path / "new").write_text("second secret")
    key, profile, fingerprint = keygen(tmp_path / "key.pem", "example", "https://huggingface.co/example/m",
                                       tmp_path / "old")
    assert b"ENCRYPTED PRIVATE KEY" in key.read_bytes() and key.stat().st_mode & 0o777 == 0o600
    assert Profile.load(profile).keys[0].fingerprint == fingerprint
    assert change_passphrase(key, tmp_path / "old", tmp_path / "new") == fingerprint
    with pytest.raises(UsageError, match="cannot load signing key"):
        load_private_key(key, b"first secret")
    load_private_key(key, b"second secret")
    with pytest.raises(UsageError, match="already exists"):
        keygen(tmp_path / "key.pem", "example", "https://huggingface.co/example/m", tmp_path / "old")


def test_sign_promotes_a_development_package(export, cache_root, tmp_path, monkeypatch):
    entry = export()
    from flare.package import signing
    key = signing.generate_private_key()
    signing.write_owner_only(tmp_path / "key.pem", signing.private_key_pem(key, None))
    identity = signing.SigningIdentity(key, "example", "https://huggingface.co/example/stories")
    (tmp_path / "publisher.json").write_text(identity.profile.to_json())
    config = tmp_path / "config.toml"
    config.write_text(f'[publishing]\nsigning_key = "{tmp_path / "key.pem"}"\nnamespace = "example"\n'
                      f'official_source = "https://huggingface.co/example/stories"\n'
                      f'[paths]\npackage_cache = "{cache_root}"\n')
    promoted = sign_package(str(entry), config)
    assert promoted != entry
    options = TrustOptions(approve_key=identity.public_key.fingerprint, accept_publisher="example", offline=True,
                           publisher_keys=(tmp_path / "publisher.json",), verify_weights=True)
    package = open_package(promoted, options)
    assert package.manifest.publisher.namespace == "example"
    assert package.manifest.promoted_from.version == entry.name
    for payload in (entry / "weights").iterdir():
        assert payload.stat().st_ino == (promoted / "weights" / payload.name).stat().st_ino
    with pytest.raises(UsageError, match="only development packages are promoted"):
        sign_package(str(promoted), config, publisher_keys=(tmp_path / "publisher.json",))
