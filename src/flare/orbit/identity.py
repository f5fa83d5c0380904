"""Ed25519 identities of controllers and agents, kept as owner-only PEM files and created on first use.

A controller's key (`~/.config/flare/orbit/controller.key`) signs its session handshakes and grants;
an agent's (`~/.config/flare/agent/agent.key`) signs its side of every session. Pairing records each
side's public key on the other, so later sessions are checked against a pinned key. The key format,
fingerprint (SHA-256 of the raw public key, lowercase hex) and file handling are the package signing
keys' (`flare.package.signing`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flare.package.signing import PublicKey, generate_private_key, load_private_key, private_key_pem, write_owner_only

CONTROLLER_KEY = Path("orbit") / "controller.key"
AGENT_DIR = Path("agent")
AGENT_KEY = AGENT_DIR / "agent.key"


@dataclass(frozen=True)
class Identity:
    private_key: object                       # cryptography Ed25519PrivateKey
    path: Path

    @property
    def public(self) -> PublicKey:
        from cryptography.hazmat.primitives import serialization

        return PublicKey(self.private_key.public_key().public_bytes(serialization.Encoding.Raw,
                                                                    serialization.PublicFormat.Raw))

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)


def load_identity(path: Path) -> Identity:
    """The identity at `path`, created (owner-only) when the file does not exist yet."""
    path = Path(path).expanduser()
    if not path.exists():
        try:
            write_owner_only(path, private_key_pem(generate_private_key(), None))
        except FileExistsError:
            pass                              # another process created it first: use theirs
    return Identity(load_private_key(path), path)


def verify(key: PublicKey, signature: bytes, message: bytes) -> bool:
    return key.verify(signature, message)
