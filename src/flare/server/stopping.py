"""How the server stops: uvicorn with a bounded drain, the engine core's death, and a last-resort exit.

* A signal (SIGINT or SIGTERM, to this process or its whole process group) starts the drain: /health
  answers 503 "shutting down", generation routes refuse new work, uvicorn takes no new connections and
  waits for the requests in flight. After DRAIN_TIMEOUT_S the engine is shut down, which ends whatever
  still runs with the drain's answer (503, or an error event in a stream). Exit status 0.
* The engine core dying stops the server too, without a drain (nothing can finish): the requests in
  flight fail with a clean error, /health says why until the process exits, exit status 1 so that a
  supervisor restarts the server.
* EXIT_TIMEOUT_S after either began, a watchdog ends the process whatever still runs.

Each step is printed, on a terminal or not. The signal handler only records the signal: the loop's
next tick (within 0.1 s) acts on it, so nothing prints from inside a signal handler.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from typing import Any, TextIO

import uvicorn

DRAIN_TIMEOUT_S = 30.0      # how long the requests in flight may take to finish once stopping began
ANSWER_TIMEOUT_S = 10.0     # then, after the engine stopped, for the drain's answers to reach the clients
EXIT_TIMEOUT_S = 60.0       # from the signal to the process's exit, however the stop goes
ENGINE_FAILED = 1           # the exit status when the engine core died while serving


def uvicorn_config(app: Any, quiet: bool) -> uvicorn.Config:
    """No access log ever; with `quiet` (under the dashboard) only errors, which would otherwise tear the
    display. uvicorn cancels what is left ANSWER_TIMEOUT_S after the engine stopped."""
    return uvicorn.Config(app, log_level="error" if quiet else "warning", access_log=False,
                          timeout_graceful_shutdown=DRAIN_TIMEOUT_S + ANSWER_TIMEOUT_S, limit_concurrency=None,
                          backlog=2048)


class StoppingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: Any, stream: TextIO, dashboard: Any = None) -> None:
        super().__init__(config)
        self.state = state                      # flare.server.app.ServingState
        self.stream = stream
        self.dashboard = dashboard
        self.exit_status = 0
        self._signal: int | None = None
        self._stopping = False
        self._engine_stopped_here = False
        self._disarmed = threading.Event()

    # ---- what starts the stop --------------------------------------------------------------------

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._signal = self._signal or sig
        super().handle_exit(sig, frame)
        # uvicorn re-raises a handled signal after shutdown; the drain is the intended exit
        self._captured_signals.clear()

    async def on_tick(self, counter: int) -> bool:
        if not self._stopping and self._signal is not None:
            self._begin(f"{signal.Signals(self._signal).name} received", drain=True)
        elif not self._stopping and self.state.engine.dead_reason is not None:
            self.exit_status = ENGINE_FAILED
            self._begin(f"the engine core stopped: {self.state.engine.dead_reason}", drain=False)
            return True
        return await super().on_tick(counter)

    def _begin(self, why: str, drain: bool) -> None:
        self._stopping = True
        if self.dashboard is not None:
            self.dashboard.stop()               # hand the terminal back before the stop is reported
        active = _requests(self._active_requests())
        if drain:
            self.state.draining = True
            self.state.ready = False
            self.say(f"Shutting down ({why}): finishing {active}, accepting no new ones "
                     f"(at most {DRAIN_TIMEOUT_S:.0f} s)")
        else:
            self.say(f"Shutting down ({why}): {active} failed; exiting with status {ENGINE_FAILED} so that "
                     "a supervisor restarts the server")
        threading.Thread(target=self._exit_when_overdue, name="flare-exit-watchdog", daemon=True).start()

    # ---- the stop itself --------------------------------------------------------------------------

    async def shutdown(self, sockets: Any = None) -> None:
        limit = asyncio.ensure_future(self._stop_engine_after(DRAIN_TIMEOUT_S))
        try:
            await super().shutdown(sockets)
        finally:
            limit.cancel()
        if self.exit_status == 0 and self.state.engine.dead_reason is not None and not self._engine_stopped_here:
            self.exit_status = ENGINE_FAILED    # the engine core died during the drain
        if self.exit_status == 0:
            self.say("Shutting down: the requests are done; stopping the engine")

    async def _stop_engine_after(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
        self.say(f"Shutting down: {_requests(self._active_requests())} still running after {seconds:.0f} s; "
                 "ending them")
        self._engine_stopped_here = True
        await asyncio.to_thread(self.state.engine.shutdown)

    def _exit_when_overdue(self) -> None:
        if self._disarmed.wait(EXIT_TIMEOUT_S):
            return
        self.say(f"Shutting down: still running {EXIT_TIMEOUT_S:.0f} s after the stop began; exiting now")
        os._exit(self.exit_status or ENGINE_FAILED)

    def disarm_watchdog(self) -> None:
        """For a server run inside a process that outlives it (tests): no exit after EXIT_TIMEOUT_S."""
        self._disarmed.set()

    # ---- helpers ----------------------------------------------------------------------------------

    def _active_requests(self) -> int:
        try:
            stats = self.state.engine.stats()
            return stats.num_running + stats.num_waiting
        except Exception:                       # the engine may be gone already; the message still holds
            return 0

    def say(self, line: str) -> None:
        print(line, file=self.stream, flush=True)


def _requests(count: int) -> str:
    return f"{count} active request{'s' if count != 1 else ''}"
