"""Production key custody: `ignition keygen`, `ignition key-password` and `ignition sign`."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

from flare.errors import UsageError
from flare.package.export import publisher_record, utc_now, write_signed_primary
from flare.package.manifest import PromotedFrom
from flare.package.signing import (DEVELOPMENT_NAMESPACE, SigningIdentity, ask_passphrase, check_official_source,
                                   generate_private_key, load_private_key, private_key_pem, publishing_identity,
                                   write_owner_only)
from flare.package.install import stage_payloads
from flare.package.store import ModelCache

PROFILE_NAME = "publisher.json"


def _passphrase(path: Path | None, prompt: str, confirm: bool) -> bytes:
    if path is not None:
        text = Path(path).read_text().rstrip("\n").encode()
    else:
        text = ask_passphrase(prompt)
        if confirm and ask_passphrase("Repeat the passphrase: ") != text:
            raise UsageError("the passphrases differ; nothing was written")
    if not text:
        raise UsageError("an empty passphrase would leave the key unencrypted; choose a passphrase")
    return text


def keygen(key_path: Path, namespace: str, official_source: str,
           passphrase_file: Path | None = None) -> tuple[Path, Path, str]:
    """Write an encrypted Ed25519 key (owner-only) and publisher.json beside it; return paths and fingerprint."""
    key_path = Path(key_path).expanduser()
    profile_path = key_path.parent / PROFILE_NAME
    if namespace == DEVELOPMENT_NAMESPACE:
        raise UsageError(f"namespace {DEVELOPMENT_NAMESPACE!r} is reserved for development keys")
    check_official_source(official_source, namespace, "--official-source")
    for path in (key_path, profile_path):
        if path.exists():
            raise UsageError(f"{path} already exists; keygen never replaces a key or profile")
    passphrase = _passphrase(passphrase_file, f"Passphrase for {key_path}: ", confirm=True)
    key = generate_private_key()
    write_owner_only(key_path, private_key_pem(key, passphrase))
    identity = SigningIdentity(key, namespace, official_source)
    profile_path.write_text(identity.profile.to_json())
    return key_path, profile_path, identity.public_key.fingerprint


def change_passphrase(key_path: Path, old_file: Path | None = None, new_file: Path | None = None) -> str:
    """Re-encrypt the key under a new passphrase; the key (and so its fingerprint) stays the same."""
    key_path = Path(key_path).expanduser()
    old = _passphrase(old_file, f"Current passphrase for {key_path}: ", confirm=False) \
        if b"ENCRYPTED" in key_path.read_bytes() else None
    key = load_private_key(key_path, old)
    new = _passphrase(new_file, "New passphrase: ", confirm=True)
    temporary = key_path.with_name(f".{key_path.name}.new")
    temporary.unlink(missing_ok=True)
    write_owner_only(temporary, private_key_pem(key, new))
    os.replace(temporary, key_path)
    return SigningIdentity(key, "", "").public_key.fingerprint


def sign_package(target: str, config_path: Path | None = None, official_source: str | None = None,
                 repo_id: str | None = None, publisher_keys: tuple[Path, ...] = ()) -> Path:
    """Verify a development package completely and publish it re-signed by the configured publisher."""
    from flare.config import load_config, package_cache
    from flare.package.reader import open_package
    from flare.package.trust import TrustOptions
    from flare.package.verify import verify_payloads

    config = load_config(config_path)
    if config.publishing is None:
        raise UsageError("ignition sign needs a publishing identity: set [publishing] signing_key, namespace "
                         "and official_source in the configuration file (or pass --config)")
    identity = publishing_identity(config.publishing, config.config_dir, official_source)
    cache = ModelCache(package_cache(None, config))
    package = open_package(target, TrustOptions(publisher_keys=publisher_keys, require_acceptance=False),
                           cache_root=cache.root)
    old = package.manifest
    if old.publisher.namespace != DEVELOPMENT_NAMESPACE:
        raise UsageError(f"{package.label} is already signed by {old.publisher.namespace!r}; "
                         "only development packages are promoted")
    verify_payloads(package.files, old.payloads)
    promoted_from = PromotedFrom(old.version, old.publisher.key_fingerprint)
    with cache.staging_tree() as staging:
        tree = staging / "entry"
        tree.mkdir()
        stage_payloads(cache, package.files, old.payloads, tree, "nothing was signed")

        def sign_as(version: str) -> None:
            manifest = msgspec.structs.replace(old, version=version, repository=repo_id or old.repository,
                                               created=utc_now(), promoted_from=promoted_from,
                                               publisher=publisher_record(identity))
            write_signed_primary(tree, manifest, identity)

        return cache.publish_new_version(tree, old.model_key, sign_as)
