"""Which build of Flare this process runs, so that hosts refuse to work with another.

Every rank of a multi-host launch, and an agent and its controller, must run the same code: messages,
payload layouts and the step contract change between builds without notice. `Build` is the release
version and a digest of the installed `flare` sources (every .py file's path and bytes), so two
installations of one version from different checkouts are told apart. The check is the first
exchange of every connection between hosts, before any rank starts.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

from flare.errors import UsageError

SOURCE_DIGEST_CHARS = 12


@dataclass(frozen=True)
class Build:
    version: str
    source: str                    # the first SOURCE_DIGEST_CHARS hex digits of the sources' SHA-256

    def __str__(self) -> str:
        return f"Flare {self.version} (source {self.source})"


@functools.cache
def this_build() -> Build:
    import flare

    root = Path(flare.__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return Build(flare.__version__, digest.hexdigest()[:SOURCE_DIGEST_CHARS])


class BuildMismatch(UsageError):
    """Two hosts run different builds; nothing was started."""


def check_same_build(theirs: Build, who: str, ours: Build | None = None) -> None:
    """Refuse a peer, agent or controller built from other sources, naming both builds."""
    ours = ours or this_build()
    if theirs != ours:
        raise BuildMismatch(f"{who} runs {theirs}, this host runs {ours}; every host must run the same build, "
                            "so nothing was started. Install this build on every host (and restart their "
                            "agents), then try again")
