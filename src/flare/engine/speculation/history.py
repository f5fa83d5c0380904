"""History drafts: continuations copied from a request's own prompt and output (n-gram lookup).

When the newest n tokens of a request occurred before in its prompt or output, the tokens that followed
that earlier occurrence are proposed as drafts (prompt lookup decoding: Saxena 2023; vLLM's `ngram`
proposer). Answers that repeat their prompt (editing code, quoting a document, filling a template) have
long such continuations, and verifying them costs one target step.

Per request an index maps every n-gram (n from `max_ngram` down to `min_ngram`) to the position just
after its latest occurrence; it grows by the new tokens of each step, so a proposal costs a few dict
lookups, never a scan of the context. The longest n that matches wins, and among its occurrences the
latest. The index lives as long as the request object (a weak reference), so finishing or aborting a
request needs no call here.
"""

from __future__ import annotations

import weakref

from flare.engine.request import Request

MAX_NGRAM = 4
MIN_NGRAM = 2


class _Index:
    __slots__ = ("table", "indexed")

    def __init__(self) -> None:
        self.table: dict[tuple[int, ...], int] = {}     # n-gram -> the position after its latest occurrence
        self.indexed = 0                                # n-grams ending before this position are in the table


class HistoryDrafter:
    """A `flare.engine.core.Drafter`: proposes up to `max_tokens` drafts for a request from its history."""

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"history drafts need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._indexes: weakref.WeakKeyDictionary[Request, _Index] = weakref.WeakKeyDictionary()

    def propose(self, request: Request, max_tokens: int) -> tuple[int, ...]:
        if max_tokens <= 0:
            return ()
        tokens = request.all_token_ids
        index = self._indexes.get(request)
        if index is None:
            index = self._indexes[request] = _Index()
        self._extend(index, tokens)
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            after = index.table.get(tuple(tokens[len(tokens) - n:]))
            if after is not None:
                return tuple(tokens[after:after + max_tokens])
        return ()

    def _extend(self, index: _Index, tokens: list[int]) -> None:
        """Add the n-grams ending at positions index.indexed .. len - 2 (the newest token's own n-grams
        stay out: their continuation is what is being proposed)."""
        table, low, high = index.table, self.min_ngram, self.max_ngram
        for end in range(max(index.indexed, low), len(tokens)):
            for n in range(low, min(high, end) + 1):
                table[tuple(tokens[end - n:end])] = end
        index.indexed = max(index.indexed, len(tokens))
