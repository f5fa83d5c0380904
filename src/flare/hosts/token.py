"""The preparation token: the shared secret that authenticates preparation frames between ranks.

`ignition export --ranks N --rendezvous` and `ignition join` read it from `agent.token` beside the
configuration file (`~/.config/flare/agent.token`): at least 32 random bytes, the same file on every
host, readable by its owner only. It is Flare's own secret, not an Orbit identity: manual preparation
needs no agent, pairing or controller key. Frames are authenticated, not encrypted (spec §3.1).
"""

from __future__ import annotations

import stat
from dataclasses import dataclass
from pathlib import Path

from flare.errors import UsageError

TOKEN_FILE = "agent.token"
MIN_TOKEN_BYTES = 32


def token_path(config_dir: Path) -> Path:
    return Path(config_dir).expanduser() / TOKEN_FILE


def how_to_make(path: Path) -> str:
    return (f"make one on one host with `head -c 48 /dev/urandom | base64 > {path} && chmod 600 {path}` "
            "and copy that same file to every host of the preparation")


class TokenError(UsageError):
    """The preparation token is missing, too short, readable by others, or differs between hosts."""


@dataclass(frozen=True)
class PreparationToken:
    path: Path
    secret: bytes

    def __repr__(self) -> str:                 # never print the secret
        return f"PreparationToken({self.path})"


def load_token(config_dir: Path) -> PreparationToken:
    """The token file's bytes (a trailing newline dropped), checked: present, owner-only, long enough."""
    path = token_path(config_dir)
    try:
        info = path.stat()
        secret = path.read_bytes().rstrip(b"\r\n")
    except FileNotFoundError:
        raise TokenError(f"the preparation token {path} does not exist; every rank of a multi-host preparation "
                         f"authenticates its frames with it: {how_to_make(path)}") from None
    except OSError as error:
        raise TokenError(f"cannot read the preparation token {path}: {error.strerror}") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise TokenError(f"the preparation token {path} is readable by others (mode "
                         f"{stat.S_IMODE(info.st_mode):o}); run `chmod 600 {path}` on every host")
    if len(secret) < MIN_TOKEN_BYTES:
        raise TokenError(f"the preparation token {path} holds {len(secret)} bytes, fewer than "
                         f"{MIN_TOKEN_BYTES}; {how_to_make(path)}")
    return PreparationToken(path, secret)


def differs_error(path: Path, who: str) -> TokenError:
    return TokenError(f"{who} holds a different preparation token than {path} here; every host needs the same "
                      f"file: copy {path} from rank zero's host to the others (mode 600)")
