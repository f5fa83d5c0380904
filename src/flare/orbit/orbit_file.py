"""The controller's registry (`~/.config/flare/orbit.toml`, or --orbit-file / --agents-file PATH).

    [nodes."dgx5"]                      a paired agent: where it listens and its pinned key
    address = "10.0.0.5:29700"
    agent_key = "<base64 Ed25519 public key>"
    hostname = "dgx5"
    paired = "2026-10-22T09:00:00+00:00"

    [clusters."sparks"]                 an ordered set of nodes: rank k runs on nodes[k]
    nodes = ["dgx5", "dgx6"]

    [groups."sparks"]                   a launch saved by `flare orbit run --persistent --name GROUP`
    package = "dgx5:/data/model.safetensors"
    nodes = ["dgx5", "dgx6"]
    arguments = ["--port", "30000"]
    transfer_streams = 8

Every node was paired on purpose; nothing is discovered, and no command sends to a host not named here
or on its command line.
"""

from __future__ import annotations

import datetime
import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from flare.errors import UsageError
from flare.package.signing import PublicKey

DEFAULT_ORBIT_FILE = Path("orbit.toml")
DEFAULT_CLUSTER = "default"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\[\]-]*")


@dataclass(frozen=True)
class Node:
    name: str
    address: str
    agent_key: PublicKey
    hostname: str
    paired: str


@dataclass(frozen=True)
class SavedGroup:
    name: str
    package: str
    nodes: tuple[str, ...]
    arguments: tuple[str, ...]
    transfer_streams: int


@dataclass(frozen=True)
class OrbitFile:
    path: Path
    nodes: dict[str, Node] = field(default_factory=dict)
    clusters: dict[str, tuple[str, ...]] = field(default_factory=dict)
    groups: dict[str, SavedGroup] = field(default_factory=dict)

    def node(self, name: str) -> Node:
        if name not in self.nodes:
            known = ", ".join(self.nodes) or "none: pair one with `flare orbit pair HOST --code CODE`"
            raise UsageError(f"no node {name!r} in {self.path}; paired nodes: {known}")
        return self.nodes[name]

    def cluster(self, name: str | None) -> tuple[Node, ...]:
        """A cluster's nodes in rank order; with no name, the only cluster, else every node as paired."""
        if name is None:
            if len(self.clusters) == 1:
                name = next(iter(self.clusters))
            else:
                if not self.nodes:
                    raise UsageError(f"{self.path} has no paired nodes; pair one with `flare orbit pair HOST "
                                     "--code CODE`")
                return tuple(self.nodes.values())
        if name not in self.clusters:
            raise UsageError(f"no cluster {name!r} in {self.path}; clusters: {', '.join(self.clusters) or 'none'} "
                             "(`flare orbit pair HOST... --cluster NAME` makes one)")
        return tuple(self.node(node) for node in self.clusters[name])

    def with_node(self, node: Node, cluster: str | None) -> "OrbitFile":
        clusters = dict(self.clusters)
        if cluster is not None:
            members = [name for name in clusters.get(cluster, ()) if name != node.name]
            clusters[cluster] = (*members, node.name)
        return replace(self, nodes={**self.nodes, node.name: node}, clusters=clusters)

    def without_node(self, name: str) -> "OrbitFile":
        self.node(name)
        nodes = {key: value for key, value in self.nodes.items() if key != name}
        clusters = {key: tuple(n for n in members if n != name) for key, members in self.clusters.items()}
        return replace(self, nodes=nodes, clusters={key: value for key, value in clusters.items() if value})

    def with_group(self, group: SavedGroup) -> "OrbitFile":
        return replace(self, groups={**self.groups, group.name: group})

    def without_group(self, name: str) -> "OrbitFile":
        return replace(self, groups={key: value for key, value in self.groups.items() if key != name})


def check_name(name: str, what: str) -> str:
    if not _NAME.fullmatch(name):
        raise UsageError(f"{what} {name!r} is not a plain name (letters, digits, '.', '_', '-')")
    return name


def load_orbit_file(path: Path) -> OrbitFile:
    path = Path(path).expanduser()
    try:
        document = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return OrbitFile(path)
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"{path} is not valid TOML ({error}); fix it, or remove it and pair again") from None
    try:
        nodes = {name: Node(name, str(t["address"]), PublicKey.decode(t["agent_key"]), str(t.get("hostname", "")),
                            str(t.get("paired", ""))) for name, t in document.get("nodes", {}).items()}
        clusters = {name: tuple(str(n) for n in t["nodes"]) for name, t in document.get("clusters", {}).items()}
        groups = {name: SavedGroup(name, str(t["package"]), tuple(str(n) for n in t["nodes"]),
                                   tuple(str(a) for a in t.get("arguments", ())), int(t.get("transfer_streams", 8)))
                  for name, t in document.get("groups", {}).items()}
    except (KeyError, TypeError, ValueError, UsageError) as error:
        raise UsageError(f"{path} is damaged ({type(error).__name__}: {error}); fix it, or remove it and pair "
                         "again") from None
    return OrbitFile(path, nodes, clusters, groups)


def save_orbit_file(orbit: OrbitFile) -> None:
    import tomlkit

    document = tomlkit.document()
    document.add(tomlkit.comment("Paired Flare agents, clusters and saved groups; written by `flare orbit`."))
    for section, entries in (("nodes", {n.name: {"address": n.address, "agent_key": n.agent_key.encoded,
                                                 "fingerprint": n.agent_key.fingerprint, "hostname": n.hostname,
                                                 "paired": n.paired} for n in orbit.nodes.values()}),
                             ("clusters", {name: {"nodes": list(m)} for name, m in orbit.clusters.items()}),
                             ("groups", {g.name: {"package": g.package, "nodes": list(g.nodes),
                                                  "arguments": list(g.arguments),
                                                  "transfer_streams": g.transfer_streams}
                                         for g in orbit.groups.values()})):
        table = tomlkit.table(is_super_table=True)
        for name, values in entries.items():
            table[name] = values
        document[section] = table
    orbit.path.parent.mkdir(parents=True, exist_ok=True)
    temporary = orbit.path.with_name(orbit.path.name + ".tmp")
    temporary.write_text(tomlkit.dumps(document))
    temporary.replace(orbit.path)


def now_text() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
