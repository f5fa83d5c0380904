"""Streaming answers and clients that leave: a request's engine work ends the moment its client goes.

`SSEResponse` streams events and closes their source on a disconnect; `until_disconnect` runs a
non-streamed request's work and cancels it if the client leaves first. Either way the engine request is
aborted and its KV pages are freed at once.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from flare.server import error_handlers, sse
from flare.server.errors import APIError, ApiFamily, error_body


class SSEResponse(StreamingResponse):
    """Streams events, and on a client disconnect closes the event source at once (which aborts the engine
    request and frees its pages) instead of waiting for the next write to fail."""

    media_type = sse.MEDIA_TYPE

    def __init__(self, events: AsyncIterator[str], family: ApiFamily) -> None:
        super().__init__(events, status_code=200, headers=sse.SSE_HEADERS, media_type=sse.MEDIA_TYPE)
        self.events = events
        self.family = family

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writer = asyncio.ensure_future(self._write(send))
        listener = asyncio.ensure_future(self._wait_for_disconnect(receive))
        try:
            await asyncio.wait({writer, listener}, return_when=asyncio.FIRST_COMPLETED)
            failure = writer.exception() if writer.done() and not writer.cancelled() else None
            if failure is not None and not isinstance(failure, OSError):     # OSError: the client left
                raise failure
        finally:
            for task in (writer, listener):
                task.cancel()
            await asyncio.gather(writer, listener, return_exceptions=True)
            await self.events.aclose()

    @staticmethod
    async def _wait_for_disconnect(receive: Receive) -> None:
        while True:
            if (await receive())["type"] == "http.disconnect":
                return

    async def _write(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for event in self._events_or_error():
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _events_or_error(self) -> AsyncIterator[str]:
        """The events; a failure after the headers went out ends the stream with an error event."""
        try:
            async for event in self.events:
                yield event
        except APIError as error:
            yield self._error_event(error)
        except Exception as error:              # a bug: still end the stream in the API's own terms
            yield self._error_event(error_handlers.unexpected(error, "while streaming"))

    def _error_event(self, error: APIError) -> str:
        body = error_body(error, self.family)
        return sse.named_event(body) if self.family == "anthropic" else sse.data_event(body)


async def until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`, cancelling it (and so aborting its engine requests) if the client goes away first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise APIError(499, "the client closed the connection")
    return task.result()
