"""Constrained requests on their way into the core, and the grammar masks of each step's rows.

A constrained request is not scheduled until its grammar is compiled: `TokenMasker.compile` prepares it
on a worker thread, the request waits here (counted as waiting) while the other requests step on, and
`take_admitted` hands it to the scheduler once the compile is done; a grammar that failed becomes a
`RefusedRequest` (`take_refused`). Per step, `masked_rows` says which of a plan's rows sample under a
grammar and `masks` fills their next-token bitmasks (step.ScheduledRow.token_mask's layout).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, Protocol

import numpy as np

from flare.engine.request import InvalidRequest, Request
from flare.engine.stats import RefusedRequest

# While nothing runs but grammars compile, a step waits at most this long for one to finish, so the loop
# still takes its commands (a new request, an abort) between waits and does not spin meanwhile.
GRAMMAR_WAIT_S = 0.005

# The ids a launched step sampled for each of some requests that the core has not read in yet.
UnreadIds = Callable[[Sequence[Request]], list[tuple[int, ...]]]


class TokenMasker(Protocol):
    """Grammar-constrained decoding plugs in here: the tokens a request may sample next
    (`flare.engine.structured_output.StructuredOutputs`)."""

    def constrains(self, request: Request) -> bool: ...

    def compile(self, request: Request) -> Future:
        """Start preparing a new request's grammar off the core's thread; the future's result is for
        `admit`, or a ValueError (with the reason) for a grammar it cannot constrain the request with."""

    def admit(self, request: Request, compiled: Any) -> None:
        """Take a constrained request whose grammar `compile` prepared."""

    def next_token_masks(self, requests: Sequence[Request], unread: Sequence[tuple[int, ...]]) -> np.ndarray:
        """int32 [len(requests), ceil(V / 32)] (step.ScheduledRow.token_mask): row i for the token after
        request i's received output and then `unread[i]`, the ids a launched step sampled for it that the
        core has not read in yet."""


class GrammarGate:
    """The core's grammar side: requests waiting for their grammars, refusals, and per-step masks."""

    def __init__(self, masker: TokenMasker | None) -> None:
        self.masker = masker
        self._compiling: dict[str, tuple[Request, Future]] = {}   # waiting, unscheduled, for their grammar
        self._refused: list[RefusedRequest] = []

    @property
    def num_waiting(self) -> int:
        """Requests whose grammars are still compiling."""
        return len(self._compiling)

    def holds(self, request_id: str) -> bool:
        return request_id in self._compiling

    def constrains(self, request: Request) -> bool:
        return self.masker is not None and self.masker.constrains(request)

    def take_in(self, request: Request, wait_for_grammar: bool) -> Request | None:
        """A new request: returned when it may be scheduled now (no grammar, or `wait_for_grammar` and its
        grammar compiled; InvalidRequest if it did not), else kept here until `take_admitted` gives it."""
        if request.params.grammar is None:
            return request
        if self.masker is None:
            raise InvalidRequest("this engine has no vocabulary for constrained decoding (it was built "
                                 "without a tokenizer); send the request without a grammar")
        compiling = self.masker.compile(request)
        if wait_for_grammar:
            return self._admit(request, compiling)
        self._compiling[request.request_id] = (request, compiling)
        return None

    def take_admitted(self, idle: bool) -> list[Request]:
        """The requests whose grammars compiled since (those that failed go to `take_refused`). With the
        core `idle`, wait a little for one (GRAMMAR_WAIT_S) rather than return at once."""
        if idle:
            wait([future for _, future in self._compiling.values()], GRAMMAR_WAIT_S, FIRST_COMPLETED)
        admitted = []
        for request_id, (request, compiling) in list(self._compiling.items()):
            if compiling.done():
                del self._compiling[request_id]
                try:
                    admitted.append(self._admit(request, compiling))
                except InvalidRequest as error:
                    self._refused.append(RefusedRequest(request_id, str(error)))
        return admitted

    def take_refused(self) -> list[RefusedRequest]:
        """The requests refused since the last call (their grammars failed to compile)."""
        refused, self._refused = self._refused, []
        return refused

    def forget(self, request_id: str) -> bool:
        """Drop a request still waiting for its grammar (its compile skipped, or its result dropped);
        False if it waits for none."""
        if request_id not in self._compiling:
            return False
        request, compiling = self._compiling.pop(request_id)
        request.finish_reason = "abort"
        compiling.cancel()
        return True

    def masked_rows(self, rows, requests: Sequence[Request]) -> tuple[int, ...]:
        """The plan rows (`rows[i]` runs for `requests[i]`) that sample for a constrained request."""
        if self.masker is None:
            return ()
        return tuple(i for i, (row, request) in enumerate(zip(rows, requests))
                     if row.samples and self.masker.constrains(request))

    def masks(self, requests: Sequence[Request], unread: UnreadIds) -> np.ndarray:
        """The next-token masks of these requests, int32 [len(requests), ceil(V / 32)]; `unread` gives the
        ids still in flight that each must accept first."""
        return self.masker.next_token_masks(requests, unread(requests))

    def _admit(self, request: Request, compiling: Future) -> Request:
        """A constrained request whose grammar is compiled, ready to schedule; InvalidRequest if it failed."""
        try:
            compiled = compiling.result()
        except ValueError as error:
            raise InvalidRequest(str(error)) from None
        self.masker.admit(request, compiled)
        return request
