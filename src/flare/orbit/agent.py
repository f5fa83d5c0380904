"""`flare agent`: this host's rank agent. It answers encrypted control sessions from paired controllers.

    Agent(config, Address).serve()      until SIGINT/SIGTERM

Each connection is one session (`session.accept_session`); its controller may pair (`Pair`, with the
pairing code's proof or under --accept-first) and, once authorized, ask about this host (status,
packages, groups, logs, metrics, a package's signed envelope) or, with a signed grant each, change it:
start or stop a rank (`rank_processes`), remove a group's records, store a pushed package in this
host's cache, authorize or forget a controller. An agent of another build than its controller is
refused by the handshake, naming both, before anything is asked.
"""

from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import msgspec

from flare.errors import FlareError, UsageError
from flare.hosts.address import Address, listen
from flare.hosts.frames import Channel, ChannelError
from flare.hosts.build import this_build
from flare.orbit import grants, pairing
from flare.orbit.agent_state import AgentState, Pairing
from flare.orbit.messages import (GRANTED_REQUESTS, ORBIT, AddController, Describe, Described, Done, Granted, Groups,
                                  GroupsReply, Lacking, Logs, Metrics, MetricsReply, Packages, Pair, Paired, Problem,
                                  RemoveController, RemoveGroup, RunRank, Status, StatusReply, StopGroup, PushPackage)
from flare.orbit.rank_processes import RankProcesses
from flare.orbit.session import Session, accept_session
from flare.package.signing import PublicKey

DEFAULT_AGENT_PORT = 29700
IDLE_SESSION_S = 3600.0
PAIRING_ATTEMPTS = 5           # wrong codes before the agent forgets its code (so it cannot be guessed online)


class Agent:
    def __init__(self, config: Any, address: Address, out: Callable[[str], None] | None = None) -> None:
        from flare.config import package_cache

        self.config, self.address = config, address
        self.state = AgentState(config.config_dir)
        self.identity = self.state.identity()
        self.cache_root = package_cache(None, config)
        self.ranks = RankProcesses(self.state.groups_dir)
        self.out = out or (lambda text: print(text, file=sys.stderr, flush=True))
        self._seen_grants: set[bytes] = set()
        self._wrong_codes = 0
        self._lock = threading.Lock()

    def announce(self) -> None:
        """Say who this agent is and how a controller pairs with it (a fresh code when it has none)."""
        controllers = self.state.controllers()
        policy = self.state.pairing()
        if not controllers and policy.code is None and not policy.accept_first:
            policy = Pairing(code=pairing.new_code())
            self.state.set_pairing(policy)
        how = (f"pair with `flare orbit pair HOST --code {policy.code}`" if policy.code else
               "the first controller to pair is accepted" if policy.accept_first else "no pairing code offered")
        self.out(f"flare agent {self.identity.public.fingerprint} ({this_build()}) listening on {self.address}; "
                 f"{len(controllers)} controllers authorized; {how}")

    def serve(self) -> None:
        server = listen(self.address, "the agent")
        self.announce()
        try:
            while True:
                sock, where = server.accept()
                channel = Channel(sock, f"{where[0]}:{where[1]}", ORBIT)
                threading.Thread(target=self._connection, args=(channel,), daemon=True).start()
        finally:
            server.close()

    def _connection(self, channel: Channel) -> None:
        try:
            session = accept_session(channel, self.identity)
            while True:
                request = channel.receive(timeout=IDLE_SESSION_S)
                self._answer(session, request)
        except ChannelError:
            pass
        except FlareError as error:
            self.out(f"refused a session from {channel.peer}: {error}")
        finally:
            channel.close()

    def _answer(self, session: Session, request: Any) -> None:
        channel = session.channel
        try:
            if isinstance(request, Pair):
                channel.send(self._pair(session, request))
                return
            if session.peer_key.fingerprint not in self.state.authorized():
                raise UsageError(f"this agent ({socket.gethostname()}) has not paired with controller "
                                 f"{session.peer_key.fingerprint}; pair it with `flare orbit pair HOST --code CODE`")
            self._authorized(session, request)
        except ChannelError:
            raise
        except (FlareError, OSError) as error:
            reason = str(error) if isinstance(error, FlareError) else f"the agent on {socket.gethostname()} failed: {error}"
            channel.send(Problem(reason, getattr(error, "exit_code", 1)))
            if isinstance(request, Granted) and request.action == "push":
                raise ChannelError("a push failed part way; its session ends") from None

    def _authorized(self, session: Session, request: Any) -> None:
        from flare.orbit import agent_requests as handle

        channel = session.channel
        if isinstance(request, Status):
            channel.send(handle.status(self))
        elif isinstance(request, Packages):
            channel.send(handle.packages(self.cache_root))
        elif isinstance(request, Groups):
            channel.send(GroupsReply(tuple(self.ranks.states())))
        elif isinstance(request, Describe):
            channel.send(handle.describe(request.target, self.cache_root))
        elif isinstance(request, Lacking):
            channel.send(handle.lacking(request, self.cache_root))
        elif isinstance(request, Logs):
            handle.stream_logs(self.ranks, request, channel)
        elif isinstance(request, Metrics):
            channel.send(MetricsReply(handle.metrics(self.ranks, request.group)))
        elif isinstance(request, Granted):
            self._granted(session, request)
        else:
            raise UsageError(f"the agent does not answer {type(request).__name__}")

    def _granted(self, session: Session, granted: Granted) -> None:
        from flare.orbit import agent_requests as handle

        kind = GRANTED_REQUESTS.get(granted.action)
        if kind is None:
            raise UsageError(f"the agent grants no action {granted.action!r}")
        with self._lock:
            grants.check(granted.grant, granted.action, granted.request, self.identity.public.fingerprint,
                         self.state.authorized(), self._seen_grants)
        request = msgspec.msgpack.decode(granted.request, type=kind)
        channel = session.channel
        if isinstance(request, RunRank):
            state = self.ranks.start(request)
            channel.send(Done(f"rank {state.rank} of group {state.group} started (pid {state.pid})"))
        elif isinstance(request, StopGroup):
            ended = self.ranks.stop(request.group)
            channel.send(Done(f"{len(ended)} ranks of group {request.group} stopped"))
        elif isinstance(request, RemoveGroup):
            channel.send(Done(f"{self.ranks.remove(request.group)} rank records of {request.group} removed"))
        elif isinstance(request, PushPackage):
            channel.send(handle.receive_push(request, self.cache_root, channel))
        elif isinstance(request, AddController):
            self.state.add_controller(request.name, PublicKey.decode(request.key))
            channel.send(Done(f"controller {request.name} authorized"))
        elif isinstance(request, RemoveController):
            if self.state.remove_controller(request.key) == 0:
                raise UsageError(f"this agent has no controller {request.key}")
            channel.send(Done("controller removed"))

    def _wrong_code(self, peer: str) -> None:
        self._wrong_codes += 1
        self.out(f"refused pairing from {peer}: wrong pairing code ({self._wrong_codes} of {PAIRING_ATTEMPTS})")
        if self._wrong_codes >= PAIRING_ATTEMPTS:
            self.state.consume_pairing()
            self._wrong_codes = 0
            self.out("forgot the pairing code after repeated wrong codes; restart the agent for a new one")

    def _pair(self, session: Session, request: Pair) -> Paired | Problem:
        key = session.peer_key
        policy = self.state.pairing()
        with self._lock:
            already = key.fingerprint in self.state.authorized()
            if not already:
                if policy.code is not None:
                    if not pairing.matches(policy.code, b"controller", session.transcript, request.proof):
                        self._wrong_code(session.channel.peer)
                        return Problem(f"the agent on {socket.gethostname()} refused the pairing code; give the code "
                                       "the agent printed or was installed with (`--code CODE`)", 2)
                elif not (policy.accept_first and not self.state.controllers()):
                    return Problem(f"the agent on {socket.gethostname()} offers no pairing; run `flare agent install "
                                   "--join-code CODE` (or --accept-first) there, or restart it to print a code", 2)
                self.state.add_controller(request.name, key)
                self.state.consume_pairing()
                self.out(f"paired with controller {request.name} ({key.fingerprint})")
        answer = pairing.proof(policy.code, b"agent", session.transcript) if policy.code and not already else b""
        return Paired(socket.gethostname(), answer)
