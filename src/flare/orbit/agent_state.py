"""An agent's state beside its host's configuration: `<config dir>/agent/`.

    agent.key          the agent's Ed25519 identity
    controllers.toml   the controllers it obeys: [[controllers]] name, key, fingerprint, added
    pairing.toml       how a new controller may pair: code = "...", or accept_first = true (owner-only)
    groups/            the ranks it started, their records and logs (`rank_processes`)

`flare agent reset` removes controllers.toml and pairing.toml: every controller must pair again.
"""

from __future__ import annotations

import datetime
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

from flare.errors import UsageError
from flare.orbit.identity import AGENT_DIR, Identity, load_identity
from flare.package.signing import PublicKey

CONTROLLERS_FILE = "controllers.toml"
PAIRING_FILE = "pairing.toml"


@dataclass(frozen=True)
class Controller:
    name: str
    key: PublicKey
    added: str


@dataclass(frozen=True)
class Pairing:
    code: str | None = None
    accept_first: bool = False


class AgentState:
    def __init__(self, config_dir: Path) -> None:
        self.directory = Path(config_dir).expanduser() / AGENT_DIR

    @property
    def groups_dir(self) -> Path:
        return self.directory / "groups"

    def identity(self) -> Identity:
        return load_identity(self.directory / "agent.key")

    # ---- controllers ---------------------------------------------------------------------------------
    def controllers(self) -> list[Controller]:
        records = _read_toml(self.directory / CONTROLLERS_FILE).get("controllers", [])
        try:
            return [Controller(str(r["name"]), PublicKey.decode(r["key"]), str(r.get("added", ""))) for r in records]
        except (KeyError, TypeError, UsageError) as error:
            raise UsageError(f"{self.directory / CONTROLLERS_FILE} is damaged ({error}); `flare agent reset` "
                             "clears it, then pair the controllers again") from None

    def authorized(self) -> set[str]:
        return {controller.key.fingerprint for controller in self.controllers()}

    def add_controller(self, name: str, key: PublicKey) -> None:
        kept = [c for c in self.controllers() if c.key.fingerprint != key.fingerprint]
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self._write_controllers(kept + [Controller(name, key, now)])

    def remove_controller(self, key_or_fingerprint: str) -> int:
        kept = [c for c in self.controllers() if key_or_fingerprint not in (c.key.encoded, c.key.fingerprint)]
        removed = len(self.controllers()) - len(kept)
        if removed:
            self._write_controllers(kept)
        return removed

    def _write_controllers(self, controllers: list[Controller]) -> None:
        import tomlkit

        document = tomlkit.document()
        document.add(tomlkit.comment("Controllers this agent obeys; `flare agent reset` forgets them all."))
        array = tomlkit.aot()
        for controller in controllers:
            table = tomlkit.table()
            table.update({"name": controller.name, "key": controller.key.encoded,
                          "fingerprint": controller.key.fingerprint, "added": controller.added})
            array.append(table)
        document["controllers"] = array
        _write_private(self.directory / CONTROLLERS_FILE, tomlkit.dumps(document))

    # ---- pairing -------------------------------------------------------------------------------------
    def pairing(self) -> Pairing:
        table = _read_toml(self.directory / PAIRING_FILE)
        return Pairing(table.get("code") or None, bool(table.get("accept_first", False)))

    def set_pairing(self, pairing: Pairing) -> None:
        lines = [f'code = "{pairing.code}"'] if pairing.code else []
        lines += ["accept_first = true"] if pairing.accept_first else []
        _write_private(self.directory / PAIRING_FILE, "# How a new controller may pair with this agent.\n"
                       + "\n".join(lines) + "\n")

    def consume_pairing(self) -> None:
        (self.directory / PAIRING_FILE).unlink(missing_ok=True)

    def reset(self) -> int:
        """Forget every controller and pairing code; returns how many controllers were authorized."""
        count = len(self.controllers())
        for name in (CONTROLLERS_FILE, PAIRING_FILE):
            (self.directory / name).unlink(missing_ok=True)
        return count


def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"{path} is not valid TOML ({error}); `flare agent reset` clears the agent's "
                         "controllers and pairing") from None


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(text)
    os.replace(temporary, path)
