"""`flare run` for one rank of a multi-host launch (spec §2): rank zero with the package, peers without.

    run_rank_zero(RunOptions, RankOptions)   verify the package here, hand every peer its payloads
    run_peer(PeerLaunch)                     join rank zero, stage and verify this rank's payloads

`--stage-only` distributes and verifies the package on every rank, then ends them all. Serving a
multi-rank package joins the ranks into one tensor-parallel group; until a rank worker takes a TCP
rendezvous, that is refused by name before anything waits or moves.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from flare.errors import UsageError
from flare.hosts.address import Address
from flare.ui.banner import show_banner
from flare.ui.stages import StageReporter

DEFAULT_TRANSFER_STREAMS = 8
MAX_TRANSFER_STREAMS = 64
NOT_SERVABLE = ("serving a package across hosts joins its ranks into one tensor-parallel group, which this "
                "build of Flare cannot do yet; `--stage-only` distributes and verifies the package on every "
                "rank without serving it")


@dataclass(frozen=True)
class RankOptions:
    rendezvous: Address | None                 # None with --hosts: port 29800 toward the first peer
    transfer_streams: int = DEFAULT_TRANSFER_STREAMS
    stage_only: bool = False
    hosts: tuple[str, ...] = ()                # --hosts: peers started through their paired agents
    controller: Any = None                     # flare.orbit.controller.Controller, with --hosts
    peer_arguments: tuple[str, ...] = ()       # serving flags the peers are started with


def check_transfer_streams(value: int | None, flag: str = "--transfer-streams") -> int:
    if value is None:
        return DEFAULT_TRANSFER_STREAMS
    if not 1 <= value <= MAX_TRANSFER_STREAMS:
        raise UsageError(f"{flag} {value} is outside 1-{MAX_TRANSFER_STREAMS}")
    return value


def run_rank_zero(options: Any, ranks: RankOptions, stream: TextIO | None = None) -> int:
    """Rank zero: the package verified and accepted here, then offered to every peer at the rendezvous
    (with --hosts, peers the paired agents start once every one of them answered with this build)."""
    from flare.package.store import lease_entry
    from flare.server.launch import download_options, open_package_in_stages

    stream = stream or sys.stderr
    if not ranks.stage_only:
        raise UsageError(NOT_SERVABLE)
    peers = _peer_nodes(ranks, stream)                 # before anything opens: every agent reached
    show_banner(stream, f"rank 0 of {options.target}")
    stages = StageReporter(stream)
    with contextlib.ExitStack() as held:
        package = open_package_in_stages(options, download_options(options), stages, stream,
                                         lambda path: held.enter_context(lease_entry(path)))
        held.callback(package.close)
        _distribute(package, ranks, peers, stages, held)
    print(f"Staged {package.label} on all {package.manifest.deployments[0].tensor_parallel} ranks; --stage-only "
          "ends every rank", file=stream, flush=True)
    return 0


def _distribute(package: Any, ranks: RankOptions, peers: tuple, stages: StageReporter, held) -> None:
    from flare.hosts.rendezvous import RankZero
    from flare.package.rank_copy import multi_rank_deployment

    deployment = multi_rank_deployment(package.manifest)
    if peers and len(peers) != deployment.tensor_parallel - 1:
        raise UsageError(f"{package.label} has {deployment.tensor_parallel} ranks; --hosts names {len(peers)} "
                         f"peers: name {deployment.tensor_parallel - 1}, in rank order (rank zero is this host)")
    listen_on, address = ranks.rendezvous, ranks.rendezvous
    if peers and (address is None or not address.host):    # peers need a host to connect to: ours toward them
        address = _toward(peers[0]) if address is None else _toward(peers[0]).with_port(address.port)
        listen_on = listen_on or Address("", address.port)
    zero = RankZero(package.files, deployment, listen_on, ranks.transfer_streams, stages.line)
    zero.open()
    held.callback(zero.close)
    if peers:
        _start_peers(ranks, peers, package, address, stages.line)
    with stages.stage("Distribute package") as stage:
        staged = zero.gather()
        moved = sum(event.received_bytes for event in staged.values())
        stage.note(f"ranks 1-{deployment.tensor_parallel - 1} staged and verified; {moved:,} bytes sent")
    zero.finish(f"rank zero staged {package.label} on every rank (--stage-only)")


def _peer_nodes(ranks: RankOptions, stream: TextIO) -> tuple:
    """The --hosts peers as paired nodes, each reached (and its build checked) before any rank starts."""
    from flare.orbit.launch import reach_every_node

    if not ranks.hosts:
        return ()
    orbit = ranks.controller.orbit()
    by_address = {node.address: node for node in orbit.nodes.values()}
    nodes = tuple(by_address.get(host) or orbit.node(host) for host in ranks.hosts)
    reach_every_node(ranks.controller, nodes, lambda text: print(text, file=stream, flush=True))
    return nodes


def _toward(node: Any) -> Address:
    """This host's address on the route to `node`, at the default rendezvous port (a UDP socket's
    connect picks the route and sends nothing)."""
    import socket

    from flare.hosts.address import parse_address
    from flare.orbit.launch import DEFAULT_RENDEZVOUS_PORT

    peer = parse_address(node.address, f"node {node.name}'s address")
    family = socket.AF_INET6 if ":" in peer.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((peer.host, peer.port))
        return Address(probe.getsockname()[0], DEFAULT_RENDEZVOUS_PORT)


def _start_peers(ranks: RankOptions, peers: tuple, package: Any, address: Address, out) -> None:
    import os

    from flare.orbit.launch import start_ranks
    from flare.orbit.messages import RunRank

    approval = ("--dangerously-approve-key", package.trust.fingerprint, "--dangerously-accept-publisher",
                package.trust.namespace, "--offline")
    group = f"hosts-{os.getpid()}"
    total = len(peers) + 1
    commands = tuple((node, RunRank(group, rank, total, ("--rank", str(rank), "--rendezvous", str(address),
                                                         *ranks.peer_arguments, *approval)))
                     for rank, node in enumerate(peers, start=1))
    start_ranks(ranks.controller, commands, group, out)


@dataclass(frozen=True)
class PeerLaunch:
    rank: int
    rendezvous: Address
    cache_root: Path
    trust: Any                         # flare.package.TrustOptions
    package: Path | None = None


def run_peer(launch: PeerLaunch, stream: TextIO | None = None) -> int:
    """A peer: joins rank zero, stages this rank's payloads, then does what rank zero says."""
    from flare.hosts.messages import Finish
    from flare.hosts.rendezvous import PeerOptions, join_rank_zero

    stream = stream or sys.stderr
    show_banner(stream, f"rank {launch.rank} from {launch.rendezvous}")
    stages = StageReporter(stream)
    session = join_rank_zero(PeerOptions(launch.rendezvous, launch.rank, launch.cache_root, launch.trust,
                                         launch.package), stages)
    try:
        word = session.wait()
    finally:
        session.close()
    if isinstance(word, Finish):
        print(f"Rank {launch.rank}: {word.message}", file=stream, flush=True)
        return 0
    raise UsageError(NOT_SERVABLE)
