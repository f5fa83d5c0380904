"""The engine-core process and the two sockets to it, as the frontend side holds them.

    connection = CoreConnection.spawn(factory, seed)   # the process starts loading the model
    for progress in connection.startup(timeout_s):      # start-up messages, until the core is ready
        ...
    connection.ready                                    # the core's Ready message
    connection.send(AddRequest(...)); connection.receive(timeout_ms)
    connection.stop(); connection.close()                # Shutdown (SIGKILL if it does not exit), sockets

The core ignores SIGTERM, so stopping it is always this side's decision.
"""

from __future__ import annotations

import multiprocessing
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from flare.engine import messages
from flare.engine.core_process import run_engine_core
from flare.engine.messages import CoreFailed, Event, Ready, Shutdown, StartupProgress
from flare.engine_client.protocol import EngineDeadError

POLL_MS = 500
LAST_WORDS_MS = 200     # how long a core that exited may take to deliver its last message


class EngineStartError(EngineDeadError):
    """The engine core failed while it loaded the model; `failure` says how, classified by the error's type."""

    def __init__(self, failure: CoreFailed) -> None:
        super().__init__(f"the engine core failed to start: {failure.summary}")
        self.failure = failure


class CoreConnection:
    def __init__(self, process, context, commands, events, socket_dir: Path) -> None:
        import zmq

        self.process = process
        self._context = context
        self._commands = commands
        self._events = events
        self._socket_dir = socket_dir
        self._poller = zmq.Poller()                      # events, and the process's exit
        self._poller.register(events, zmq.POLLIN)
        self._poller.register(process.sentinel, zmq.POLLIN)
        self._send_lock = threading.Lock()              # ZMQ sockets are not thread-safe
        self._closed = False
        self.ready: Ready | None = None

    @classmethod
    def spawn(cls, factory, seed: int | None = None, diagnostics=None,
              core_builder=None) -> CoreConnection:
        """Start the engine-core process; it builds its model from `factory` (a picklable ModelFactory),
        recording what `diagnostics` asks (flare.engine.step_profile.Diagnostics: `flare run
        --profile-startup`, `--profile-steps`; None: nothing), and its core
        with `core_builder` (picklable, `(LoadedModel, seed) -> EngineCore`; default
        `flare.engine.factory.build_core`: benchmarks put a stand-in runner there)."""
        import zmq

        socket_dir = Path(tempfile.mkdtemp(prefix="flare-engine-"))
        context = zmq.Context()
        commands = context.socket(zmq.PUSH)
        commands.bind(f"ipc://{socket_dir}/commands")
        events = context.socket(zmq.PULL)
        events.bind(f"ipc://{socket_dir}/events")
        process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name="flare-engine-core", daemon=True,
            args=(factory, seed, f"ipc://{socket_dir}/commands", f"ipc://{socket_dir}/events", diagnostics,
                  core_builder))
        process.start()
        return cls(process, context, commands, events, socket_dir)

    def startup(self, timeout_s: float = 600) -> Iterator[StartupProgress]:
        """The core's start-up messages as they come; ends when it is ready (`self.ready`). Raises
        EngineStartError when it fails, EngineDeadError when it exits or takes longer than `timeout_s`."""
        waited_ms = 0
        while self.ready is None:
            event = self.receive(POLL_MS)
            if event is None:
                waited_ms += POLL_MS
                if not self.process.is_alive():
                    raise EngineDeadError(f"the engine core exited during startup (exit code {self.process.exitcode})")
                if waited_ms >= timeout_s * 1000:
                    raise EngineDeadError(f"the engine core did not start within {timeout_s:.0f} s")
            elif isinstance(event, Ready):
                self.ready = event
            elif isinstance(event, CoreFailed):
                raise EngineStartError(event)
            else:
                yield event

    def send(self, command: messages.Command) -> None:
        """Send a command (an encoded one: a value msgpack cannot carry fails here, in the caller)."""
        data = messages.encode(command)
        with self._send_lock:
            if not self._closed:
                self._commands.send(data)

    def receive(self, timeout_ms: int) -> Event | None:
        """The next event, or None if none came within `timeout_ms` or the core exited (it wakes at once:
        the process's sentinel is polled beside the socket, so a dead core is noticed without delay)."""
        ready = dict(self._poller.poll(timeout_ms))
        # After the core exited, what it sent last may still be on its way through the socket.
        if self._events in ready or self._events.poll(0 if not ready else LAST_WORDS_MS):
            return messages.decode_event(self._events.recv())
        return None

    def is_alive(self) -> bool:
        return self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def stop(self, timeout_s: float = 10) -> None:
        """Ask the core to exit and wait for it; kill it if it does not (it ignores SIGTERM)."""
        if self.process.is_alive():
            self.send(Shutdown())
            self.process.join(timeout_s)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout_s)

    def kill(self) -> None:
        """End the core now (a start-up abandoned half way: it reads no commands while it loads)."""
        self.process.kill()
        self.process.join()

    def close(self) -> None:
        """Release the sockets (once nobody receives any more). Calling it again does nothing."""
        with self._send_lock:
            if self._closed:
                return
            self._closed = True
            self._commands.close(linger=0)
        self._events.close(linger=0)
        self._context.term()
        shutil.rmtree(self._socket_dir, ignore_errors=True)
