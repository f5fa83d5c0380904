"""`flare orbit push` and the package half of `flare orbit run`: a controller-local package into nodes' caches.

    push_package(controller, files, nodes, streams, out) -> {node name: path on that node}

With one node per rank of a multi-rank package, node k receives rank k's payloads (a rank copy);
otherwise every node receives the whole package (a cache entry). Each node is told the signed envelope
first, answers which payloads its cache lacks (after checking they fit), and receives those over up
to `streams` encrypted sessions, hashing each against the signed manifest; the last session publishes.
"""

from __future__ import annotations

from typing import Callable

from flare.errors import UsageError
from flare.hosts.distribution import run_together, send_payload
from flare.hosts.frames import ChannelError
from flare.hosts.messages import Envelope
from flare.orbit.controller import AgentProblem, Controller
from flare.orbit.messages import Lacking, Needs, PushPackage, Stored
from flare.orbit.orbit_file import Node
from flare.package.format import PackageFiles
from flare.package.rank_copy import rank_payloads


def envelope_of(files: PackageFiles) -> Envelope:
    primary = files.primary
    return Envelope(primary.manifest_body, primary.signature, primary.profile_json)


def assignments(files: PackageFiles, nodes: tuple[Node, ...]) -> list[tuple[Node, int, tuple[str, ...]]]:
    """(node, rank or -1 for the whole package, the payload names it receives) for each node."""
    manifest = files.manifest
    deployment = manifest.deployments[0]
    if deployment.tensor_parallel > 1 and len(nodes) == deployment.tensor_parallel:
        return [(node, rank, tuple(r.name for r in rank_payloads(manifest, deployment, rank)))
                for rank, node in enumerate(nodes)]
    if deployment.tensor_parallel > 1 and len(nodes) > 1:
        raise UsageError(f"{manifest.label} has {deployment.tensor_parallel} ranks and --to names {len(nodes)} nodes: "
                         "name one node per rank, in rank order, or one node for the whole package")
    return [(node, -1, tuple(r.name for r in manifest.payloads)) for node in nodes]


def push_package(controller: Controller, files: PackageFiles, nodes: tuple[Node, ...], streams: int,
                 out: Callable[[str], None]) -> dict[str, str]:
    placed = {}
    for node, rank, names in assignments(files, nodes):
        stored = _push_one(controller, files, node, rank, names, streams)
        what = f"rank {rank}'s payloads" if rank >= 0 else "the package"
        out(f"node {node.name}: {what} at {stored.path} ({stored.received_bytes:,} bytes sent)")
        placed[node.name] = stored.path
    return placed


def _push_one(controller: Controller, files: PackageFiles, node: Node, rank: int, names: tuple[str, ...],
              streams: int) -> Stored:
    """Blobs first over parallel sessions (each its share of what the node lacks), then the publishing push."""
    deployment = files.manifest.deployments[0].name
    with controller.session(node) as agent:
        needed = _needed(agent, files, rank, names)
    shares = [needed[index::streams] for index in range(min(streams, len(needed)))]

    def send_share(share: list[str]) -> None:
        with controller.session(node) as agent:
            _send(agent, files, PushPackage(envelope_of(files), deployment, rank, tuple(share), publish=False))

    run_together([lambda share=share: send_share(share) for share in shares])
    with controller.session(node) as agent:
        stored = _send(agent, files, PushPackage(envelope_of(files), deployment, rank, names))
    sent = sum(files.manifest.payload(name).size for name in needed)
    return Stored(stored.path, sent)


def _needed(agent, files: PackageFiles, rank: int, names: tuple[str, ...]) -> list[str]:
    """The payloads the node lacks (it refuses here, before a byte moves, when they would not fit)."""
    needs = agent.ask(Lacking(envelope_of(files), names, rank))
    if not isinstance(needs, Needs):
        raise ChannelError(f"{agent.label} answered {type(needs).__name__} to a push")
    return list(needs.names)


def _send(agent, files: PackageFiles, request: PushPackage) -> Stored:
    agent.grant("push", request)
    needs = agent.receive()
    if not isinstance(needs, Needs):
        raise ChannelError(f"{agent.label} answered {type(needs).__name__} to a push")
    try:
        for name in needs.names:
            send_payload(agent.channel, files, files.manifest.payload(name))
    except ChannelError:
        agent.receive(timeout=10)          # the node's reason, when it stopped the push itself
        raise
    stored = agent.receive()
    if not isinstance(stored, Stored):
        raise AgentProblem(f"{agent.label} answered {type(stored).__name__} to a push")
    return stored
