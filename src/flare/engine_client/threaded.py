"""ThreadedEngine: an `EngineClient` that steps an in-process `LLMEngine` on its own thread (debug-serve, tests).

The model steps on a worker thread, so the event loop keeps serving HTTP while it computes. The thread
takes the same commands the engine-core process does (`flare.engine.messages`, not encoded: nothing
crosses a process), keeps the latest stats, and checks the pages once it has gone idle and quiet, as
the core process does.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

from flare.engine.stats import EngineStats
from flare.engine.request import InvalidRequest
from flare.engine.messages import AbortRequests, AddRequest, Shutdown
from flare.engine.outputs import RequestOutput
from flare.engine.request import EngineRequest
from flare.engine.sampling_params import SamplingParams
from flare.engine_client.llm_engine import LLMEngine
from flare.engine_client.protocol import EngineDeadError

IDLE_POLL_S = 0.5
IDLE_CHECK_DELAY_S = 0.1      # quiet time after going idle before the page integrity check runs


class ThreadedEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats = engine.core.stats()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="flare-engine", daemon=True)
        self._thread.start()

    # ---- the EngineClient (event loop) -----------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if self.dead_reason is not None or self._stopping.is_set():
            raise EngineDeadError(self.dead_reason or "the engine was shut down")
        if request_id in self._streams:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        self._commands.put(AddRequest(EngineRequest(request_id, tuple(prompt_token_ids), params)))
        finished = False
        try:
            while not finished:
                output = await outputs.get()
                if isinstance(output, BaseException):
                    finished = True
                    raise output
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(AbortRequests((request_id,)))

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._commands.put(AbortRequests((request_id,)))

    def stats(self) -> EngineStats:
        return self._stats

    @property
    def dead_reason(self) -> str | None:
        """Why the engine thread stopped while it should be running; None while it runs."""
        if self._thread.is_alive() or self._stopping.is_set():
            return None
        return "the engine thread stopped"

    def shutdown(self) -> None:
        self._stopping.set()
        self._commands.put(Shutdown())
        self._thread.join(timeout=30)
        for request_id in list(self._streams):
            self._deliver(request_id, EngineDeadError("the engine was shut down"))

    # ---- the engine thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        check_due = False                                # went idle since the last page check
        while not self._stopping.is_set():
            busy = self.engine.has_unfinished()
            changed = self._apply_commands(0 if busy else IDLE_CHECK_DELAY_S if check_due else IDLE_POLL_S)
            if check_due and not changed and not self.engine.has_unfinished():
                self._stats = self.engine.core.stats(check_integrity=True)   # between steps: consistent
                check_due = False
                continue
            if self.engine.has_unfinished():
                self._step()
                check_due = check_due or not self.engine.has_unfinished()
                changed = True
            if changed:
                self._stats = self.engine.core.stats()

    def _apply_commands(self, timeout_s: float) -> bool:
        """Apply every waiting command, waiting up to `timeout_s` for the first; whether any came."""
        try:
            command = self._commands.get(timeout=timeout_s) if timeout_s else self._commands.get_nowait()
        except queue.Empty:
            return False
        while command is not None:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                command = None
        return True

    def _apply(self, command: Any) -> None:
        if isinstance(command, AddRequest):
            request = command.request
            try:     # a grammar compiles while the engine steps on; a refusal comes after a step
                self.engine.add_request(request.request_id, request.prompt_token_ids, request.params,
                                        wait_for_grammar=False)
            except Exception as error:
                self._deliver(request.request_id, error)
        elif isinstance(command, AbortRequests):
            for request_id in command.request_ids:
                self.engine.abort(request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:      # fail every waiting stream rather than hang it
            for request_id in list(self._streams):
                self._deliver(request_id, error)
                self.engine.abort(request_id)
            return
        for output in outputs:
            self._deliver(output.request_id, output)
        for refused in self.engine.take_refused():
            self._deliver(refused.request_id, InvalidRequest(refused.reason))

    def _deliver(self, request_id: str, item: Any) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, outputs = target
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, item)
            except RuntimeError:        # a closed loop has nobody left to tell
                pass
