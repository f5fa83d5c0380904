"""AsyncEngine: the serving frontend's handle on an engine core running in its own process.

The core process (`core_process.run_engine_core`) builds the model from a picklable factory and
streams CoreOutputs back; this side turns them into RequestOutputs (detokenizing, stop strings) and
hands each request's outputs to the asyncio task awaiting them. A reader thread receives from the
core, so any event loop (or several, one after another) can use the engine.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import shutil
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from flare.engine.core import EngineStats, InvalidRequest, validate_prompt
from flare.engine.core_process import ReadyInfo, run_engine_core
from flare.engine.outputs import RequestOutput
from flare.engine.request import EngineRequest
from flare.engine.sampling_params import SamplingParams
from flare.frontend.output_processor import OutputProcessor
from flare.frontend.tokenizer import Tokenizer

POLL_MS = 500


class EngineDeadError(RuntimeError):
    """The engine-core process stopped; the message carries its last words when it sent any."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, factory, tokenizer: Tokenizer | Future, seed: int | None = None,
                 startup_timeout_s: float = 600) -> None:
        """Start the engine-core process and wait until its model is loaded (raises EngineDeadError if it fails).

        `tokenizer` may still be loading (a Future): it is needed only once the core is ready, so the two
        load side by side."""
        import zmq

        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()                  # streams and output processor: loop and reader thread
        self._send_lock = threading.Lock()             # ZMQ sockets are not thread-safe
        self._dead: str | None = None
        self._closed = False
        self._stopping = False
        self._socket_dir = Path(tempfile.mkdtemp(prefix="flare-engine-"))
        self._context = zmq.Context()
        self._commands = self._context.socket(zmq.PUSH)
        self._commands.bind(f"ipc://{self._socket_dir}/commands")
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.bind(f"ipc://{self._socket_dir}/outputs")
        self._process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name="flare-engine-core", daemon=True,
            args=(factory, seed, f"ipc://{self._socket_dir}/commands", f"ipc://{self._socket_dir}/outputs"))
        self._process.start()
        try:
            self._ready = self._wait_until_ready(startup_timeout_s)
            self.tokenizer = tokenizer.result() if isinstance(tokenizer, Future) else tokenizer
        except BaseException:
            if self._process.is_alive():
                self._process.terminate()
                self._process.join(5)
            self._close()
            raise
        self._output_processor = OutputProcessor(self.tokenizer)
        self._stats = self._ready.stats
        self._reader = threading.Thread(target=self._read_outputs, name="flare-engine-outputs", daemon=True)
        self._reader.start()

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
        return cls(factory, tokenizer, seed)

    # ---- what serving calls ----------------------------------------------------------------------

    @property
    def engine_config(self):
        return self._ready.engine_config

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._ready.eos_token_ids

    def stats(self) -> EngineStats:
        """The core's numbers as of its latest report: running and waiting requests, KV pages in use, and
        the prefix cache's counters (hit and miss prompt tokens, evicted pages) and resident pages, and the
        page integrity check's result from the last time the core went idle. What bound the KV pool at startup is `engine_config.kv_pool_limited_by`."""
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
        self._send(("add", EngineRequest(request_id, tuple(prompt_token_ids), params)))
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
        with self._lock:
            stream = self._streams.pop(request_id, None)
            self._output_processor.abort(request_id)
        if stream is None:
            return
        self._send(("abort", [request_id]))
        _put(stream, RequestOutput(request_id, (), "", finished=True, finish_reason="abort"))

    def shutdown(self, timeout_s: float = 10) -> None:
        """Stop the core process (waiting for it to exit, then terminating it) and release the sockets.
        Requests still streaming end with EngineDeadError. Calling it again does nothing."""
        if self._closed:
            return
        self._stopping = True                         # the core's exit from here on is expected
        if self._process.is_alive():
            self._send(("shutdown",))
            self._process.join(timeout_s)
            if self._process.is_alive():
                self._process.terminate()
                self._process.join(timeout_s)
        self._dead = self._dead or "the engine was shut down"
        self._reader.join(timeout_s)
        self._fail_all(EngineDeadError(self._dead))
        self._close()

    # ---- internals -------------------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            if self._dead is None:
                self._commands.send(pickle.dumps(message))

    def _wait_until_ready(self, timeout_s: float) -> ReadyInfo:
        waited_ms = 0
        while waited_ms < timeout_s * 1000:
            if self._outputs.poll(POLL_MS):
                message = pickle.loads(self._outputs.recv())
                if message[0] == "ready":
                    return message[1]
                raise EngineDeadError(f"the engine core failed to start:\n{message[-1]}")
            waited_ms += POLL_MS
            if not self._process.is_alive():
                raise EngineDeadError(f"the engine core exited during startup (exit code {self._process.exitcode})")
        raise EngineDeadError(f"the engine core did not start within {timeout_s:.0f} s")

    def _read_outputs(self) -> None:
        while self._dead is None:
            if not self._outputs.poll(POLL_MS):
                if not self._process.is_alive():
                    self._dead = f"the engine core exited (exit code {self._process.exitcode})"
                continue
            message = pickle.loads(self._outputs.recv())
            if message[0] == "outputs":
                self._stats = message[2]
                self._deliver(message[1])
            elif message[0] == "error":
                self._fail(message[1], InvalidRequest(message[2]))
            elif message[0] == "fatal":
                self._dead = f"the engine core failed:\n{message[1]}"
        if not self._stopping:
            # Every request fails from here on; the operator needs the reason in the server's log, not
            # only in the error bodies clients receive.
            print(f"flare: {self._dead}", file=sys.stderr, flush=True)
        self._fail_all(EngineDeadError(self._dead))

    def _deliver(self, core_outputs) -> None:
        with self._lock:
            outputs, stopped = self._output_processor.process(core_outputs)
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if output.finished:
                    self._streams.pop(output.request_id, None)
                if stream is not None:
                    _put(stream, output)
        if stopped:
            self._send(("abort", stopped))

    def _fail(self, request_id: str, error: Exception) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
            self._output_processor.abort(request_id)
        if stream is not None:
            _put(stream, error)

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self._streams):
            self._fail(request_id, error)

    def _close(self) -> None:
        self._closed = True
        self._commands.close(linger=0)
        self._outputs.close(linger=0)
        self._context.term()
        shutil.rmtree(self._socket_dir, ignore_errors=True)


def _put(stream: _Stream, item) -> None:
    """Hand `item` to the stream's event loop (from any thread); a closed loop has nobody left to tell."""
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:
        pass
