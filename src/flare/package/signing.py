"""Ed25519 publisher keys: the development identity, production keys, profiles and fingerprints.

A key's fingerprint is the lowercase hex SHA-256 of its raw 32-byte public key. A publisher profile
(`publisher.json`) carries only verification keys, under the publisher's namespace.

`python -m flare.package.signing --development-fingerprint [--config PATH]` prints the development
key's fingerprint (creating the key if needed) for scripts that load development packages unattended.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from flare.config import PublishingConfig
from flare.errors import UsageError

DEVELOPMENT_NAMESPACE = "local-development"
DEVELOPMENT_SOURCE = "local-development"
DEVELOPMENT_KEY_FILE = "development-signing-key.pem"
DEVELOPMENT_PROFILE_FILE = "development-publisher.json"
PROFILE_FORMAT = "flare-publisher-1"
DEFAULT_CONFIG_DIR = Path("~/.config/flare")


@dataclass(frozen=True)
class PublicKey:
    raw: bytes                                   # 32 bytes

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.raw).hexdigest()

    @property
    def encoded(self) -> str:
        return base64.b64encode(self.raw).decode()

    @classmethod
    def decode(cls, text: str) -> "PublicKey":
        try:
            raw = base64.b64decode(text, validate=True)
        except ValueError:
            raise UsageError("a publisher key is not valid base64") from None
        if len(raw) != 32:
            raise UsageError(f"a publisher key has {len(raw)} bytes; Ed25519 keys have 32")
        return cls(raw)

    def verify(self, signature: bytes, message: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
        try:
            Ed25519PublicKey.from_public_bytes(self.raw).verify(signature, message)
            return True
        except InvalidSignature:
            return False


@dataclass(frozen=True)
class Profile:
    """A public publisher profile: who signs (namespace, official source) and with which keys."""

    namespace: str
    official_source: str
    keys: tuple[PublicKey, ...]

    def to_json(self) -> str:
        return json.dumps({"format": PROFILE_FORMAT, "namespace": self.namespace,
                           "official_source": self.official_source,
                           "keys": [{"algorithm": "ed25519", "public_key": key.encoded,
                                     "fingerprint": key.fingerprint} for key in self.keys]}, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> "Profile":
        try:
            fields = json.loads(text)
            keys = tuple(PublicKey.decode(entry["public_key"]) for entry in fields["keys"]
                         if entry.get("algorithm", "ed25519") == "ed25519")
            return cls(str(fields["namespace"]), str(fields.get("official_source", "")), keys)
        except (json.JSONDecodeError, KeyError, TypeError, UsageError) as error:
            raise UsageError(f"{where} is not a valid publisher profile ({error}); "
                             "it should be the publisher.json written by `ignition keygen`") from None

    @classmethod
    def load(cls, path: Path) -> "Profile":
        try:
            return cls.from_json(Path(path).read_text(), str(path))
        except OSError as error:
            raise UsageError(f"cannot read publisher profile {path}: {error.strerror}") from None


@dataclass(frozen=True)
class SigningIdentity:
    """A private key and the publisher it signs for."""

    private_key: object                          # cryptography Ed25519PrivateKey
    namespace: str
    official_source: str

    @property
    def public_key(self) -> PublicKey:
        from cryptography.hazmat.primitives import serialization
        raw = self.private_key.public_key().public_bytes(serialization.Encoding.Raw,
                                                         serialization.PublicFormat.Raw)
        return PublicKey(raw)

    @property
    def profile(self) -> Profile:
        return Profile(self.namespace, self.official_source, (self.public_key,))

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)


def config_dir_for(config_path: Path | None) -> Path:
    """Where the configuration file lives: the development key is written beside it."""
    if config_path is not None:
        return Path(config_path).expanduser().resolve().parent
    return DEFAULT_CONFIG_DIR.expanduser()


def generate_private_key():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    return Ed25519PrivateKey.generate()


def private_key_pem(private_key, passphrase: bytes | None) -> bytes:
    from cryptography.hazmat.primitives import serialization
    encryption = (serialization.BestAvailableEncryption(passphrase) if passphrase
                  else serialization.NoEncryption())
    return private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)


def write_owner_only(path: Path, data: bytes) -> None:
    """Create `path` readable by its owner only, refusing to replace an existing file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)


def load_private_key(path: Path, passphrase: bytes | None = None):
    """Load an owner-only Ed25519 PKCS#8 PEM key; an encrypted key asks for its passphrase on a terminal."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    path = Path(path).expanduser()
    try:
        mode = path.stat().st_mode & 0o777
        data = path.read_bytes()
    except OSError as error:
        raise UsageError(f"cannot read signing key {path}: {error.strerror}") from None
    if mode & 0o077:
        raise UsageError(f"signing key {path} is readable by others (mode {mode:o}); run `chmod 600 {path}`")
    if b"ENCRYPTED" in data and passphrase is None:
        passphrase = ask_passphrase(f"Passphrase for {path}: ")
    try:
        key = serialization.load_pem_private_key(data, password=passphrase if b"ENCRYPTED" in data else None)
    except (ValueError, TypeError) as error:
        raise UsageError(f"cannot load signing key {path}: {error}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise UsageError(f"signing key {path} is not an Ed25519 key")
    return key


def ask_passphrase(prompt: str) -> bytes:
    if not sys.stdin.isatty():
        raise UsageError("the signing key is encrypted and there is no terminal to ask for its passphrase")
    import getpass
    return getpass.getpass(prompt).encode()


def development_identity(config_dir: Path) -> SigningIdentity:
    """Create on first use, then reuse, the development key and its public profile beside the config file."""
    config_dir = Path(config_dir).expanduser()
    key_path = config_dir / DEVELOPMENT_KEY_FILE
    if not key_path.exists():
        _create_atomically(key_path, private_key_pem(generate_private_key(), None))
    identity = SigningIdentity(load_private_key(key_path), DEVELOPMENT_NAMESPACE, DEVELOPMENT_SOURCE)
    profile_path = config_dir / DEVELOPMENT_PROFILE_FILE
    profile_text = identity.profile.to_json()
    if not profile_path.exists() or profile_path.read_text() != profile_text:
        temporary = profile_path.with_name(f".{profile_path.name}.{os.getpid()}.{id(identity)}")
        temporary.write_text(profile_text)
        os.replace(temporary, profile_path)
    return identity


def _create_atomically(path: Path, data: bytes) -> None:
    """Create `path` complete or not at all; when another process created it first, keep theirs."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}")
    write_owner_only(temporary, data)
    try:
        os.link(temporary, path)
    except FileExistsError:
        pass
    finally:
        temporary.unlink()


def publishing_identity(publishing: PublishingConfig | None, config_dir: Path,
                        official_source: str | None = None) -> SigningIdentity:
    """The configured [publishing] identity (flare.config refuses one that is not complete), else the
    development identity."""
    if publishing is None:
        if official_source:
            raise UsageError("--official-source needs a publishing identity; set [publishing] signing_key, "
                             "namespace and official_source in the configuration file")
        return development_identity(config_dir)
    if publishing.namespace == DEVELOPMENT_NAMESPACE:
        raise UsageError(f"[publishing] namespace {DEVELOPMENT_NAMESPACE!r} is reserved for development keys")
    source = official_source or publishing.official_source
    check_official_source(source, publishing.namespace, "--official-source" if official_source else
                          "[publishing] official_source")
    key = load_private_key(Path(publishing.signing_key).expanduser())
    return SigningIdentity(key, publishing.namespace, source)


def check_official_source(url: str, namespace: str, setting: str) -> None:
    """An official source is a published repository URL under the publisher's namespace (spec: "Published
    repository URL under the configured publisher namespace"): http(s)://HOST/NAMESPACE/REPOSITORY, whose
    NAMESPACE is the signing namespace. `flare run` fetches publisher.json there to confirm identity, so a
    source under another namespace would let one publisher's package claim another's repository."""
    from urllib.parse import urlparse

    parts = urlparse(url)
    segments = [segment for segment in parts.path.split("/") if segment]
    if parts.scheme not in ("https", "http") or not parts.netloc or len(segments) != 2:
        raise UsageError(f"{setting} {url!r} is not a repository URL; give https://huggingface.co/{namespace}/NAME")
    if segments[0].casefold() != namespace.casefold():
        raise UsageError(f"{setting} {url} is under {segments[0]!r}, not the publisher namespace {namespace!r}; "
                         f"give a repository under it, such as https://huggingface.co/{namespace}/{segments[1]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flare.package.signing")
    parser.add_argument("--development-fingerprint", action="store_true", required=True,
                        help="print the development signing key's full SHA-256 fingerprint")
    parser.add_argument("--config", type=Path, default=None, help="configuration file beside which the key lives")
    args = parser.parse_args(argv)
    try:
        print(development_identity(config_dir_for(args.config)).public_key.fingerprint)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
