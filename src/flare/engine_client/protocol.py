"""`EngineClient`: what the routes need from an engine, whichever process the engine core runs in."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol, runtime_checkable

from flare.engine.stats import EngineStats
from flare.engine.outputs import RequestOutput
from flare.engine.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine core stopped; the message says why in one line (the traceback goes to the server's log)."""


@runtime_checkable
class EngineClient(Protocol):
    """Raises, from `generate`: `flare.engine.core.InvalidRequest` for a request the engine refuses as
    given (the HTTP answer is 400), `EngineDeadError` once the engine core has stopped (503)."""

    def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The request's outputs until one says `finished`; leaving the iterator early aborts the request."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request now (unknown or finished ids are ignored); its pages are freed."""
        ...

    def stats(self) -> EngineStats:
        """The engine's numbers as of its latest step; never blocks on the engine."""
        ...

    @property
    def dead_reason(self) -> str | None:
        """Why the engine core stopped while it should be running (one line); None while it runs."""
        ...

    def shutdown(self) -> None:
        """Stop the engine core; requests still streaming end with EngineDeadError. Repeating it does nothing."""
        ...
