"""An engine client that runs an in-process `LLMEngine` on its own thread (for debug-serve and tests).

It offers what the routes need from an engine client (`generate`, `abort`, `stats`, `shutdown`); the
model steps on a worker thread, so the event loop keeps serving HTTP while it computes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from typing import Any, AsyncIterator, Callable

from flare.engine.outputs import RequestOutput
from flare.engine.sampling_params import SamplingParams


class ThreadedEngine:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="flare-engine", daemon=True)
        self._thread.start()

    # ---- the client side (event loop) ------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        self._commands.put(("add", request_id, prompt_token_ids, params))
        try:
            while True:
                output = await outputs.get()
                if isinstance(output, BaseException):
                    raise output
                yield output
                if output.finished:
                    return
        finally:
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._commands.put(("abort", request_id))

    async def stats(self) -> dict:
        return await self.call(self._stats)

    @property
    def dead_reason(self) -> str | None:
        """Why the engine thread stopped while it should be running; None while it runs."""
        if self._thread.is_alive() or self._stopping.is_set():
            return None
        return "the engine thread stopped"

    async def call(self, function: Callable[[], Any]) -> Any:
        """Run `function` on the engine thread between steps (where the engine's state is consistent)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", function, future))
        return await asyncio.wrap_future(future)

    def shutdown(self) -> None:
        self._stopping.set()
        self._commands.put(("stop",))
        self._thread.join(timeout=30)

    # ---- the engine thread -----------------------------------------------------------------------

    def _stats(self) -> dict:
        stats = self.engine.core.stats(check_integrity=True)      # between steps: the pages are consistent
        return {name: getattr(stats, name) for name in stats.__dataclass_fields__}

    def _loop(self) -> None:
        while not self._stopping.is_set():
            idle = not self.engine.has_unfinished()
            try:
                command = self._commands.get(timeout=0.5) if idle else self._commands.get_nowait()
            except queue.Empty:
                command = None
            while command is not None:
                self._apply(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self.engine.has_unfinished():
                try:
                    outputs = self.engine.step()
                except Exception as error:      # fail every waiting stream rather than hang it
                    for request_id in list(self._streams):
                        self._deliver(request_id, error)
                        self.engine.abort(request_id)
                    continue
                for output in outputs:
                    self._deliver(output.request_id, output)

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt_ids, params = command
            try:
                self.engine.add_request(request_id, prompt_ids, params)
            except Exception as error:
                self._deliver(request_id, error)
        elif kind == "abort":
            self.engine.abort(command[1])
        elif kind == "call":
            _, function, future = command
            try:
                future.set_result(function())
            except Exception as error:
                future.set_exception(error)

    def _deliver(self, request_id: str, item: Any) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, outputs = target
            loop.call_soon_threadsafe(outputs.put_nowait, item)
