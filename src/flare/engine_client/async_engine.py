"""AsyncEngine: the serving frontend's client of an engine core running in its own process.

The core process (`flare.engine.core_process`) builds the model from a picklable factory and streams
CoreOutputs back (`flare.engine.messages`); this side turns them into RequestOutputs (detokenizing,
stop strings) and hands each request's outputs to the asyncio task awaiting them. A reader thread
receives from the core, so any event loop (or several, one after another) can use the engine.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from flare.engine.stats import EngineStats
from flare.engine.request import InvalidRequest, validate_prompt
from flare.engine.messages import AbortRequests, AddRequest, CoreFailed, Outputs, RequestRefused
from flare.engine.outputs import RequestOutput
from flare.engine.request import EngineRequest
from flare.engine.sampling_params import SamplingParams
from flare.engine_client.connection import POLL_MS, CoreConnection
from flare.engine_client.protocol import EngineDeadError
from flare.frontend.output_processor import OutputProcessor
from flare.frontend.tokenizer import Tokenizer


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    """An `EngineClient` over a `CoreConnection` whose core is ready."""

    def __init__(self, connection: CoreConnection, tokenizer: Tokenizer) -> None:
        if connection.ready is None:
            raise ValueError("AsyncEngine needs a connection whose core is ready (CoreConnection.startup)")
        self._connection = connection
        self._ready = connection.ready
        self.tokenizer = tokenizer
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()                  # streams and output processor: loop and reader thread
        self._dead: str | None = None
        self._stopping = False
        self._closed = False
        self._output_processor = OutputProcessor(tokenizer)
        self._stats = self._ready.stats
        self._reader = threading.Thread(target=self._read_events, name="flare-engine-outputs", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, factory, tokenizer: Tokenizer | Future, seed: int | None = None,
              startup_timeout_s: float = 600, on_progress: Callable | None = None) -> AsyncEngine:
        """Start the engine-core process and wait until its model is loaded (EngineDeadError if it fails;
        `on_progress` gets its start-up messages meanwhile).

        `tokenizer` may still be loading (a Future): it is needed only once the core is ready, so the two
        load side by side."""
        connection = CoreConnection.spawn(factory, seed)
        try:
            for progress in connection.startup(startup_timeout_s):
                if on_progress is not None:
                    on_progress(progress)
            tokenizer = tokenizer.result() if isinstance(tokenizer, Future) else tokenizer
        except BaseException:
            connection.kill()
            connection.close()
            raise
        return cls(connection, tokenizer)

    @classmethod
    def from_checkpoint(cls, directory: str | Path, engine_config=None, device: str = "cpu",
                        dtype: str = "float32", seed: int | None = None) -> AsyncEngine:
        """Serve a Hugging Face checkpoint directory (the core process loads the weights)."""
        from flare.engine.factory import ModelFactory, load_checkpoint_model
        from flare.frontend.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(directory)
        factory = ModelFactory(load_checkpoint_model, (str(directory),),
                               {"engine_config": engine_config, "device": device, "dtype": dtype,
                                "extra_eos_token_ids": tokenizer.eos_token_ids})
        return cls.start(factory, tokenizer, seed)

    # ---- the EngineClient ------------------------------------------------------------------------

    @property
    def engine_config(self):
        return self._ready.engine_config

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._ready.eos_token_ids

    def stats(self) -> EngineStats:
        """The core's numbers as of its latest report: running and waiting requests, KV pages in use, and
        the prefix cache's counters (hit and miss prompt tokens, evicted pages) and resident pages, and the
        page integrity check's result from the last time the core went idle. What bound the KV pool at
        startup is `engine_config.kv_pool_limited_by`."""
        return self._stats

    @property
    def dead_reason(self) -> str | None:
        """Why the engine-core process stopped (it exited, failed or was shut down); None while it runs."""
        return self._dead

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs until it finishes. Leaving the loop early aborts the request."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        # The served engine's one prompt check: the core process takes what is sent as validated.
        validate_prompt(prompt_token_ids, self._ready.engine_config.max_model_len, self._ready.vocab_size)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequest(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._output_processor.add_request(request_id, prompt_token_ids, params)
        try:
            self._connection.send(AddRequest(EngineRequest(request_id, tuple(prompt_token_ids), params)))
        except BaseException:
            self._forget(request_id)
            raise
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request now; its stream, if someone reads it, ends with finish_reason "abort"."""
        stream = self._forget(request_id)
        if stream is None:
            return
        self._send_abort((request_id,))
        _put(stream, RequestOutput(request_id, (), "", finished=True, finish_reason="abort"))

    def shutdown(self, timeout_s: float = 10) -> None:
        """Stop the core process (waiting for it to exit, then killing it) and release the sockets.
        Requests still streaming end with EngineDeadError. Calling it again does nothing. The core may
        take its drain_on_shutdown longer (writing the host tier of the prefix cache to disk)."""
        if self._closed:
            return
        self._closed = True
        self._stopping = True                         # the core's exit from here on is expected
        disk = self._ready.engine_config.prefix_retention.disk
        self._connection.stop(timeout_s + (disk.drain_s if disk is not None else 0.0))
        self._dead = self._dead or "the engine was shut down"
        self._reader.join(timeout_s)
        self._fail_all(EngineDeadError(self._dead))
        self._connection.close()

    # ---- the reader thread -----------------------------------------------------------------------

    def _read_events(self) -> None:
        failed: CoreFailed | None = None
        while self._dead is None:
            event = self._connection.receive(POLL_MS)
            if event is None:
                if not self._connection.is_alive():
                    self._dead = f"the engine core exited (exit code {self._connection.exitcode})"
            elif isinstance(event, Outputs):
                self._stats = event.stats
                self._deliver(event.outputs)
            elif isinstance(event, RequestRefused):
                self._fail(event.request_id, InvalidRequest(event.message))
            elif isinstance(event, CoreFailed):
                failed, self._dead = event, f"the engine core failed: {event.summary}"
        if not self._stopping:
            # Every request fails from here on; the operator needs the reason in the server's log, not
            # only in the error bodies clients receive.
            print(f"flare: {self._dead}" + (f"\n{failed.traceback}" if failed else ""), file=sys.stderr, flush=True)
        self._fail_all(EngineDeadError(self._dead))

    def _deliver(self, core_outputs) -> None:
        """One step's outputs to their streams: one wake-up per event loop for the whole step (waking a
        loop from this thread costs a system call), however many requests got a token."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._lock:
            outputs, stopped = self._output_processor.process(core_outputs)
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if output.finished:
                    self._streams.pop(output.request_id, None)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream.queue, output))
        for loop, items in by_loop.items():
            _call_in(loop, _put_all, items)
        if stopped:
            self._send_abort(tuple(stopped))

    def _send_abort(self, request_ids: tuple[str, ...]) -> None:
        if self._dead is None:
            self._connection.send(AbortRequests(request_ids))

    def _forget(self, request_id: str) -> _Stream | None:
        with self._lock:
            self._output_processor.abort(request_id)
            return self._streams.pop(request_id, None)

    def _fail(self, request_id: str, error: Exception) -> None:
        stream = self._forget(request_id)
        if stream is not None:
            _put(stream, error)

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self._streams):
            self._fail(request_id, error)


def _put(stream: _Stream, item) -> None:
    """Hand `item` to the stream's event loop (from any thread)."""
    _call_in(stream.loop, stream.queue.put_nowait, item)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, output in items:
        queue.put_nowait(output)


def _call_in(loop: asyncio.AbstractEventLoop, function, argument) -> None:
    """Run `function(argument)` in `loop` (from any thread); a closed loop has nobody left to tell."""
    try:
        loop.call_soon_threadsafe(function, argument)
    except RuntimeError:
        pass
