"""The controller's side of Orbit: its key, its registry, and sessions with the agents it paired.

    controller = Controller(orbit_path, key_path)
    node = controller.pair("10.0.0.5", code, cluster="sparks")       # records the node in the orbit file
    with controller.session(node) as agent:
        agent.ask(Status()); agent.grant("run", RunRank(...))

A session opens only to a node's recorded address and checks the agent's key against the one pinned
at pairing; the agent must run this controller's build (refused naming both otherwise).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from flare.errors import FlareError, UsageError
from flare.hosts.address import Address, connect, parse_address
from flare.hosts.frames import Channel, ChannelError
from flare.orbit import grants, pairing
from flare.orbit.agent import DEFAULT_AGENT_PORT
from flare.orbit.identity import CONTROLLER_KEY, load_identity
from flare.orbit.messages import ORBIT, Granted, Pair, Paired, Problem
from flare.orbit.orbit_file import DEFAULT_ORBIT_FILE, Node, check_name, load_orbit_file, now_text, save_orbit_file
from flare.orbit.session import open_session
from flare.package.signing import PublicKey

CONNECT_TIMEOUT_S = 10.0
ANSWER_TIMEOUT_S = 120.0


class AgentProblem(FlareError):
    """An agent's refusal or failure, with its exit code, naming the node."""

    def __init__(self, reason: str, exit_code: int = 1) -> None:
        super().__init__(reason)
        self.exit_code = exit_code


class Unreachable(FlareError):
    exit_code = 3


def default_paths(config_dir: Path) -> tuple[Path, Path]:
    return Path(config_dir) / DEFAULT_ORBIT_FILE, Path(config_dir) / CONTROLLER_KEY


class AgentSession:
    """One encrypted session with one node's agent."""

    def __init__(self, node_label: str, channel: Channel, identity, agent_key: PublicKey) -> None:
        self.label, self.channel, self.identity, self.agent_key = node_label, channel, identity, agent_key

    def send(self, message: Any) -> None:
        self.channel.send(message)

    def receive(self, timeout: float | None = ANSWER_TIMEOUT_S) -> Any:
        answer = self.channel.receive(timeout=timeout)
        if isinstance(answer, Problem):
            raise AgentProblem(f"{self.label}: {answer.reason}", answer.exit_code)
        return answer

    def ask(self, request: Any, timeout: float | None = ANSWER_TIMEOUT_S) -> Any:
        self.send(request)
        return self.receive(timeout)

    def grant(self, action: str, request: Any) -> None:
        """Send a state-changing request with its signed grant (the answer is read by the caller)."""
        body = msgspec.msgpack.encode(request)
        self.send(Granted(action, body, grants.issue(self.identity, self.agent_key.fingerprint, action, body)))

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "AgentSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Controller:
    def __init__(self, orbit_path: Path, key_path: Path) -> None:
        self.orbit_path, self.key_path = Path(orbit_path).expanduser(), Path(key_path).expanduser()

    @property
    def identity(self):
        return load_identity(self.key_path)

    def orbit(self):
        return load_orbit_file(self.orbit_path)

    def session(self, node: Node) -> AgentSession:
        address = parse_address(node.address, f"node {node.name}'s address")
        channel = _connect(address, f"node {node.name} ({address})")
        try:
            open_session(channel, self.identity, node.agent_key, f"node {node.name} ({address})")
        except BaseException:
            channel.close()
            raise
        return AgentSession(f"node {node.name}", channel, self.identity, node.agent_key)

    def pair(self, host: str, code: str | None, cluster: str | None = None) -> Node:
        """Pair with the agent at HOST[:PORT] and record it; the code proves both sides (or accept-first)."""
        address = parse_address(host, "HOST", default_port=DEFAULT_AGENT_PORT)
        name = check_name(address.host if address.port == DEFAULT_AGENT_PORT else str(address), "node name")
        channel = _connect(address, f"the agent at {address}")
        try:
            session = open_session(channel, self.identity, None, f"the agent at {address}")
            proof = pairing.proof(code, b"controller", session.transcript) if code else b""
            channel.send(Pair(socket.gethostname(), proof))
            answer = channel.receive(timeout=ANSWER_TIMEOUT_S)
        finally:
            channel.close()
        if isinstance(answer, Problem):
            raise AgentProblem(f"the agent at {address}: {answer.reason}", answer.exit_code)
        if not isinstance(answer, Paired):
            raise ChannelError(f"the agent at {address} answered {type(answer).__name__} to pairing")
        if code and not pairing.matches(code, b"agent", session.transcript, answer.proof):
            raise UsageError(f"the agent at {address} accepted the pairing but could not prove it holds the code; "
                             "something between us answered for it. Nothing was recorded")
        node = Node(name, str(address), session.peer_key, answer.hostname, now_text())
        save_orbit_file(self.orbit().with_node(node, cluster))
        return node


def _connect(address: Address, what: str) -> Channel:
    try:
        return Channel(connect(address, CONNECT_TIMEOUT_S), what, ORBIT)
    except OSError as error:
        raise Unreachable(f"{what} is unreachable ({error.strerror or error}); start its agent there (`flare agent "
                          "--listen IP:PORT`, or `systemctl --user start flare-agent` after `flare agent install`)") \
            from None
