"""`flare orbit run`, `attach` and `stop`: a group of ranks on a cluster's nodes, one rank per node.

    plan = plan_launch(controller, LaunchRequest(...), trust)   every node reached, builds equal, package
                                                                verified here and placed on rank zero's node
    start_launch(controller, plan)                              each node's agent starts its rank
    attach(controller, node, group)                             rank zero's output until the group ends

Rank k runs on the k-th node. Every node is reached, and must run this controller's build, before any
rank starts. The package is verified and its publisher accepted here, on the controller (at this
terminal, or by the dangerous flags); the ranks are then started with that acceptance spelled out, so
no node asks again. A controller-local package is pushed to rank zero's node first; NODE:/path names
one already there. Serving flags go to every rank, the listener's and scheduler's to rank zero only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from flare.errors import UsageError
from flare.hosts.address import Address, parse_address
from flare.hosts.messages import Envelope
from flare.orbit.controller import Controller
from flare.orbit.messages import Describe, Described, Done, LogEnd, Logs, LogText, RunRank, StopGroup
from flare.orbit.orbit_file import Node
from flare.package import format as fmt

DEFAULT_RENDEZVOUS_PORT = 29800
RANK_ZERO_FLAGS = ("--host", "--port", "--served-model-name", "--scheduler-policy", "--scheduler-terminal-value",
                   "--scheduler-terminal-age-price", "--api-key-file")


@dataclass(frozen=True)
class LaunchRequest:
    group: str
    package: str                       # a controller-local path or MODEL[@VERSION], or NODE:/absolute/path
    nodes: tuple[Node, ...]
    arguments: tuple[str, ...] = ()    # serving flags, as `flare run` takes them
    transfer_streams: int = 8
    rendezvous: str | None = None      # HOST:PORT peers reach rank zero at (default: its node's host, port 29800)
    package_cache: Path | None = None  # the controller's cache, where MODEL[@VERSION] resolves


@dataclass(frozen=True)
class LaunchPlan:
    request: LaunchRequest
    ranks: tuple[tuple[Node, RunRank], ...]


def split_node_path(package: str, names: set[str]) -> tuple[str, str] | None:
    """("dgx5", "/data/pkg") for "dgx5:/data/pkg" when dgx5 is a paired node; None for a local package."""
    for name in sorted(names, key=len, reverse=True):
        if package.startswith(name + ":/"):
            return name, package[len(name) + 1:]
    return None


def plan_launch(controller: Controller, request: LaunchRequest, trust: Any, out: Callable[[str], None],
                dry_run: bool = False) -> LaunchPlan:
    from flare.package.rank_copy import multi_rank_deployment

    reach_every_node(controller, request.nodes, out)
    envelope, path = _package_on_rank_zero(controller, request, out, dry_run)
    primary = fmt.Primary(envelope.manifest_body, envelope.signature, envelope.profile_json, "directory")
    approval = _accept(primary, trust)
    deployment = primary.manifest.deployments[0]
    ranks = deployment.tensor_parallel
    if ranks > 1:
        multi_rank_deployment(primary.manifest)
    if ranks != len(request.nodes):
        raise UsageError(f"{primary.manifest.label} has {ranks} ranks and the launch names {len(request.nodes)} "
                         f"nodes; one node serves each rank: name {ranks} with --nodes or --cluster")
    return LaunchPlan(request, tuple(_rank_commands(request, path, approval, ranks)))


def reach_every_node(controller: Controller, nodes: tuple[Node, ...], out: Callable[[str], None]) -> None:
    """A session with each node (its build checked) before anything starts anywhere."""
    from flare.orbit.messages import Status

    for node in nodes:
        with controller.session(node) as agent:
            status = agent.ask(Status())
        out(f"node {node.name} ({status.hostname}): agent ready (ranks running: {status.running})")


def _package_on_rank_zero(controller: Controller, request: LaunchRequest, out, dry_run: bool) -> tuple[Envelope, str]:
    from flare.orbit.push import envelope_of, push_package

    zero = request.nodes[0]
    located = split_node_path(request.package, set(controller.orbit().nodes))
    if located is not None:
        name, path = located
        if name != zero.name:
            raise UsageError(f"{request.package} is on node {name}, but rank zero runs on node {zero.name}, the first "
                             "of the launch: put that node first, or give a package on the controller")
        with controller.session(zero) as agent:
            described = agent.ask(Describe(path))
        if not isinstance(described, Described):
            raise UsageError(f"node {zero.name} answered {type(described).__name__} for {path}")
        return described.envelope, described.path
    files = _local_package(request.package, request.package_cache)
    if dry_run:
        return envelope_of(files), f"<{files.manifest.label} pushed to node {zero.name}>"
    placed = push_package(controller, files, (zero,), request.transfer_streams, out)
    return envelope_of(files), placed[zero.name]


def _local_package(target: str, cache_root: Path | None) -> fmt.PackageFiles:
    from flare.package.reader import resolve_target

    return fmt.read_package_files(resolve_target(target, cache_root))


def _accept(primary: fmt.Primary, trust: Any) -> tuple[str, ...]:
    """Verify the signature and accept the publisher here; the ranks get the acceptance as flags."""
    from flare.package.trust import authorize, verify_signature

    key, source = verify_signature(primary.manifest_body, primary.signature, primary.manifest,
                                   primary.profile_json, trust, f"the package {primary.manifest.label}")
    result = authorize(primary.manifest, key, source, trust)
    return ("--dangerously-approve-key", result.fingerprint, "--dangerously-accept-publisher", result.namespace)


def _rank_commands(request: LaunchRequest, path: str, approval: tuple[str, ...], ranks: int):
    listener = _listener_url(request.arguments)
    offline = ("--offline",)                     # identity was checked (or not) on the controller
    if ranks == 1:
        yield request.nodes[0], RunRank(request.group, 0, 1, (path, *request.arguments, *approval, *offline), listener)
        return
    zero_host = parse_address(request.nodes[0].address, "node address").host
    chosen = parse_address(request.rendezvous, "--rendezvous", listening=True) if request.rendezvous else None
    port = chosen.port if chosen else DEFAULT_RENDEZVOUS_PORT
    rendezvous = str(Address(chosen.host if chosen and chosen.host else zero_host, port))
    yield request.nodes[0], RunRank(request.group, 0, ranks, (
        path, "--rank", "0", "--rendezvous", f":{port}", "--transfer-streams",
        str(request.transfer_streams), *request.arguments, *approval, *offline), listener)
    peers = peer_arguments(request.arguments)
    for rank, node in enumerate(request.nodes[1:], start=1):
        yield node, RunRank(request.group, rank, ranks, ("--rank", str(rank), "--rendezvous", rendezvous, *peers,
                                                         *approval, *offline))


def peer_arguments(arguments: tuple[str, ...]) -> tuple[str, ...]:
    """The serving flags without those only rank zero takes (and --stage-only, rank zero's word)."""
    kept, skip = [], False
    for argument in arguments:
        if skip:
            skip = False
            continue
        flag = argument.split("=", 1)[0]
        if flag in RANK_ZERO_FLAGS or flag in ("--stage-only", "--transfer-streams"):
            skip = "=" not in argument and flag != "--stage-only"
            continue
        kept.append(argument)
    return tuple(kept)


def _flag_value(arguments: tuple[str, ...], flag: str) -> str | None:
    for index, argument in enumerate(arguments):
        if argument == flag and index + 1 < len(arguments):
            return arguments[index + 1]
        if argument.startswith(flag + "="):
            return argument.split("=", 1)[1]
    return None


def _listener_url(arguments: tuple[str, ...]) -> str:
    """Where rank zero's HTTP API answers on its own host (for metrics), from the forwarded flags."""
    host = _flag_value(arguments, "--host") or "127.0.0.1"
    port = _flag_value(arguments, "--port") or "8000"
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def describe_plan(plan: LaunchPlan) -> list[str]:
    return [f"node {node.name}: flare run {' '.join(rank.arguments)}" for node, rank in plan.ranks]


def start_launch(controller: Controller, plan: LaunchPlan, out: Callable[[str], None]) -> None:
    """Peers first, rank zero last; a rank that fails to start stops those already started."""
    start_ranks(controller, tuple(reversed(plan.ranks)), plan.request.group, out)


def start_ranks(controller: Controller, ranks: tuple[tuple[Node, RunRank], ...], group: str,
                out: Callable[[str], None]) -> None:
    started: list[Node] = []
    try:
        for node, rank in ranks:
            with controller.session(node) as agent:
                agent.grant("run", rank)
                done = agent.receive()
            out(f"node {node.name}: {done.text if isinstance(done, Done) else done}")
            started.append(node)
    except BaseException:
        stop_group(controller, tuple(started), group, out)
        raise


def stop_group(controller: Controller, nodes: tuple[Node, ...], group: str, out: Callable[[str], None]) -> None:
    for node in nodes:
        with controller.session(node) as agent:
            agent.grant("stop", StopGroup(group))
            done = agent.receive(timeout=120)
        out(f"node {node.name}: {done.text}")


def attach(controller: Controller, node: Node, group: str, write: Callable[[str], None]) -> LogEnd:
    """Rank zero's output from its start until the group ends there (or the caller stops reading)."""
    with controller.session(node) as agent:
        agent.send(Logs(group, follow=True))
        while True:
            message = agent.receive(timeout=None)
            if isinstance(message, LogText):
                write(message.text)
            elif isinstance(message, LogEnd):
                return message


def saved_path(package: str) -> str:
    """A controller-local package path as the saved group records it (absolute), other inputs as given."""
    path = Path(package).expanduser()
    return str(path.resolve()) if path.exists() else package
