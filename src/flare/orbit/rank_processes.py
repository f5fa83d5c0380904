"""The `flare run` processes an agent starts for its controllers: one per rank of a group on this host.

Each runs the agent's own Flare (this interpreter, these sources: the build the controller checked) in
its own session, so a stop reaches the whole process group, with its output in
`<agent dir>/groups/<group>/rank-<k>.log` and a record beside it (`rank-<k>.json`: arguments, pid,
start, end). Stopping sends SIGTERM (the server drains its requests, up to 30 s) and SIGKILL after
STOP_GRACE_S. Records outlive the agent, so a restarted agent still lists what ran; processes it
did not start itself it can only see by pid.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from flare.errors import UsageError
from flare.orbit.messages import RankState, RunRank

STOP_GRACE_S = 40.0
_GROUP = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_group(name: str) -> str:
    if not _GROUP.fullmatch(name):
        raise UsageError(f"group name {name!r} is not a plain name (letters, digits, '.', '_', '-')")
    return name


def flare_command(*arguments: str) -> list[str]:
    """This installation's `flare`, as a command line."""
    return [sys.executable, "-m", "flare.cli.flare", *arguments]


class RankProcesses:
    def __init__(self, groups_dir: Path) -> None:
        self.groups_dir = Path(groups_dir)
        self._running: dict[tuple[str, int], subprocess.Popen] = {}
        self._lock = threading.Lock()

    def _record_path(self, group: str, rank: int) -> Path:
        return self.groups_dir / group / f"rank-{rank}.json"

    def log_path(self, group: str, rank: int) -> Path:
        return self.groups_dir / group / f"rank-{rank}.log"

    def start(self, request: RunRank) -> RankState:
        group = check_group(request.group)
        with self._lock:
            current = self._state(group, request.rank)
            if current is not None and current.state == "running":
                raise UsageError(f"group {group} already runs rank {request.rank} here (pid {current.pid}); "
                                 f"`flare orbit stop {group}` first")
            directory = self.groups_dir / group
            directory.mkdir(parents=True, exist_ok=True)
            with open(self.log_path(group, request.rank), "wb") as log:
                process = subprocess.Popen(flare_command("run", *request.arguments), stdout=log,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True)
            self._running[(group, request.rank)] = process
            record = {"group": group, "rank": request.rank, "ranks": request.ranks, "pid": process.pid,
                      "started": time.time(), "exit_code": None, "stopped": False, "listener": request.listener,
                      "arguments": list(request.arguments)}
            self._write(group, request.rank, record)
        threading.Thread(target=self._reap, args=(group, request.rank, process), daemon=True).start()
        return self._state(group, request.rank)

    def _reap(self, group: str, rank: int, process: subprocess.Popen) -> None:
        code = process.wait()
        with self._lock:
            record = self._read(group, rank)
            if record is not None and record["pid"] == process.pid:
                record["exit_code"] = code
                self._write(group, rank, record)
            self._running.pop((group, rank), None)

    def stop(self, group: str) -> list[RankState]:
        """SIGTERM to each running rank of `group` here, SIGKILL after the grace; returns their ends."""
        targets = [state for state in self.states() if state.group == group and state.state == "running"]
        for state in targets:
            record = self._read(group, state.rank)
            record["stopped"] = True
            self._write(group, state.rank, record)
            _signal(state.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for state in targets:
            while self._alive(group, state) and time.monotonic() < deadline:
                time.sleep(0.1)
            if self._alive(group, state):
                _signal(state.pid, signal.SIGKILL)
            while self._alive(group, state) and time.monotonic() < deadline + 5:
                time.sleep(0.05)
        return [self._state(group, state.rank) for state in targets]

    def _alive(self, group: str, state: RankState) -> bool:
        process = self._running.get((group, state.rank))
        return process.poll() is None if process is not None else _alive(state.pid)

    def remove(self, group: str) -> int:
        states = [state for state in self.states() if state.group == group]
        if any(state.state == "running" for state in states):
            raise UsageError(f"group {group} still runs here; `flare orbit stop {group}` first")
        for path in (self.groups_dir / group).glob("rank-*"):
            path.unlink()
        if (self.groups_dir / group).is_dir():
            (self.groups_dir / group).rmdir()
        return len(states)

    def states(self) -> list[RankState]:
        found = []
        for record_path in sorted(self.groups_dir.glob("*/rank-*.json")):
            state = self._state(record_path.parent.name, int(record_path.stem.split("-")[1]))
            if state is not None:
                found.append(state)
        return found

    def _state(self, group: str, rank: int) -> RankState | None:
        record = self._read(group, rank)
        if record is None:
            return None
        process = self._running.get((group, rank))
        running = process.poll() is None if process is not None else (
            record["exit_code"] is None and _alive(record["pid"]))
        state = "running" if running else "stopped" if record["stopped"] else "exited"
        return RankState(group, rank, record["ranks"], state, record["pid"], record["started"],
                         record["exit_code"], record["listener"], tuple(record["arguments"]))

    def _read(self, group: str, rank: int) -> dict | None:
        try:
            return json.loads(self._record_path(group, rank).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def _write(self, group: str, rank: int, record: dict) -> None:
        path = self._record_path(group, rank)
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(json.dumps(record))
        os.replace(temporary, path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal(pid: int, number: int) -> None:
    try:
        os.killpg(pid, number)
    except (ProcessLookupError, PermissionError):
        pass
