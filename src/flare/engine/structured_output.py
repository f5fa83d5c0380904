"""Grammar-constrained decoding in the engine core: a matcher per constrained request, the mask of the
token it samples next, and the token it then sampled.

The matcher lives here, beside the scheduler, because the mask for token N+1 depends on token N: the
frontend validates a request's `GrammarSpec` where it enters (`flare.frontend.grammar`, a 400 naming
what failed), and the core compiles it against the model's vocabulary with xgrammar (compiled grammars
cached per spec by the compiler) and advances the matcher with every token the request samples.

`StructuredOutputs` is the core's `TokenMasker` (`flare.engine.core`). Compiling happens off the core's
loop: `compile` hands the request's grammar to a worker thread (xgrammar releases the GIL while it
compiles, and one GrammarCompiler serves several threads: its cache is thread-safe; xgrammar's docs,
"Multi-threaded Compilation" and "Engine Integration"), the request waits unscheduled meanwhile, and
once the future is done the core `admit`s it with its matcher (a grammar that cannot be compiled is an
InvalidRequest, the same 400 whenever it is found). For the constrained
rows of a step that sample asks `next_token_masks`, which first lets each matcher accept the tokens its
request received since (and the ids of the step in flight the core has not read in yet), then fills
the bitmasks (int32 `[ceil(V/32)]` each, bit set = allowed) on xgrammar's threads, all rows at once.
They reach the runner after a decode step's forward was launched (`StepRunner.launch_before_masks`) or in
`ScheduledRow.token_mask`; the device sampler applies them after penalties and bias, in the captured
decode graphs too (raw logprobs stay those of the model). A request whose grammar
has terminated (it accepted a stop token and goes on only with `ignore_eos`) is no longer masked.
Preemption keeps the matcher: output tokens survive it.

Vocabulary: xgrammar's `TokenizerInfo` is built once, on a thread of its own that `load_vocabulary`
starts when the engine starts (`build_core`; seconds for a 128K vocabulary, which neither the start nor
the first constrained request should wait for; a compile that comes first waits for it on its worker),
from the Hugging Face tokenizer the core is given a loader for, padded to the model's vocabulary (ids the
tokenizer lacks are never allowed). Stop tokens are the engine's EOS ids, so a finished grammar lets
exactly those through.

One step ahead and speculation (docs/architecture.md, "Constrained decoding"): the mask for step N+1
needs token N on the host, so the core plans step N+1 while step N runs, launches N+1's forward, then
reads N's ids and fills the masks while it runs, and launches N+1's sampling with them. k draft tokens
need k + 1 masks, one per position, filled by accepting the drafts in turn, and `rollback` of the
rejected ones after verification.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flare.engine.request import Request
from flare.engine.sampling_params import GrammarSpec

logger = logging.getLogger(__name__)


# JSON replies (and tool-call arguments) are written on one line with ", " and ": " between elements, as
# json.dumps does: a model cannot spend its tokens on blank space (a weak one would).
def json_whitespace() -> dict:
    """xgrammar's whitespace options for JSON replies (the frontend's check converts with the same)."""
    return {"any_whitespace": False}


# Grammars compiled at once, each on its own thread (xgrammar's compiler adds its own threads per grammar):
# a slow schema does not hold up a quick one behind it, and a burst of new schemas does not take every core.
COMPILE_THREADS = 2


class GrammarRefused(ValueError):
    """A grammar the engine cannot compile against this model's vocabulary (the message says why)."""


def bitmask_width(vocab_size: int) -> int:
    """int32 words per mask row: one bit per token id."""
    return -(-vocab_size // 32)


GrammarCompile = Callable[[Any, GrammarSpec], Any]     # (xgrammar.GrammarCompiler, spec) -> CompiledGrammar


def compile_spec(compiler: Any, spec: GrammarSpec) -> Any:
    """The xgrammar CompiledGrammar of `spec` (the compiler caches each distinct input)."""
    if spec.kind == "json_schema":
        return compiler.compile_json_schema(spec.source, strict_mode=spec.strict, **json_whitespace())
    if spec.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **json_whitespace())
    if spec.kind == "regex":
        return compiler.compile_regex(spec.source)
    if spec.kind == "ebnf":
        return compiler.compile_grammar(spec.source)
    if spec.kind == "structural_tag":
        return compiler.compile_structural_tag(spec.source)
    raise GrammarRefused(f"unknown grammar kind {spec.kind!r}")


@dataclass
class _Matching:
    matcher: Any                     # xgrammar.GrammarMatcher
    num_accepted: int = 0            # output tokens the matcher has accepted
    refused: bool = False            # it refused a token: the reply can only end


class StructuredOutputs:
    """The core's grammar matchers (`EngineCore`'s TokenMasker), one per constrained request.

    `compile` starts a request's grammar compiling on a worker thread; when its future is done the core
    `admit`s the request with the result (a matcher is made), or refuses it (the future's GrammarRefused).
    A matcher is dropped with its request (held weakly by the request object). It catches up with the
    request's output tokens when the next mask is asked for, so the core need not report each token.

    `load_tokenizer` returns the Hugging Face tokenizer whose ids the model speaks; it is called once, on
    the vocabulary's thread (`load_vocabulary`, or the first `compile`). `compile_grammar` compiles a spec
    with the compiler (default `compile_spec`; tests put a slow one here). Worker threads are daemons:
    a core that stops does not wait for a compile nobody needs any more."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int, stop_token_ids: Sequence[int],
                 compile_grammar: GrammarCompile = compile_spec) -> None:
        self._load_tokenizer = load_tokenizer
        self._compile_grammar = compile_grammar
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self._compiler: Future | None = None     # xgrammar.GrammarCompiler, once the vocabulary is read
        self._compile_slots = threading.BoundedSemaphore(COMPILE_THREADS)
        self._batch = None                 # xgrammar.BatchGrammarMatcher: fills a step's masks on its threads
        self._matching: weakref.WeakKeyDictionary[Request, _Matching] = weakref.WeakKeyDictionary()

    def __len__(self) -> int:
        """Requests with a live matcher."""
        return len(self._matching)

    def constrains(self, request: Request) -> bool:
        return request.params.grammar is not None

    def load_vocabulary(self) -> Future:
        """Start reading the vocabulary into xgrammar's TokenizerInfo on a thread of its own (once); the
        future's result is the GrammarCompiler, or GrammarRefused if the tokenizer cannot be read."""
        if self._compiler is None:
            self._compiler = _on_daemon_thread("flare-grammar-vocabulary", self._make_compiler)
        return self._compiler

    def compile(self, request: Request) -> Future:
        """Compile the request's grammar on a worker thread; the future's result is what `admit` takes,
        or GrammarRefused with the reason. Cancelling the future before its turn skips the compile."""
        return _on_daemon_thread("flare-grammar-compile", self._compile, self.load_vocabulary(),
                                 request.params.grammar, slots=self._compile_slots)

    def admit(self, request: Request, compiled: Any) -> None:
        """Give a constrained request its matcher, from its compiled grammar (`compile`'s result)."""
        import xgrammar

        self._matching[request] = _Matching(xgrammar.GrammarMatcher(compiled))

    def next_token_masks(self, requests: Sequence[Request], unread: Sequence[Sequence[int]]) -> np.ndarray:
        """int32 [len(requests), ceil(V/32)], bit set = allowed: row i for the token after request i's
        output so far and then `unread[i]` (ids sampled for it that its request has not received yet).
        All allowed once a grammar has terminated (only `ignore_eos` goes on past its stop token)."""
        masks = np.full((len(requests), bitmask_width(self.vocab_size)), -1, dtype=np.int32)
        matchers, rows = [], []
        for i, (request, ahead) in enumerate(zip(requests, unread)):
            matching = self._catch_up(request, ahead)
            if matching.refused:
                masks[i] = self._stop_only()
            elif not matching.matcher.is_terminated():
                matchers.append(matching.matcher)
                rows.append(i)
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(torch.from_numpy(masks), rows[0])
        elif matchers:
            self._batch_matcher().batch_fill_next_token_bitmask(matchers, torch.from_numpy(masks), rows)
        return masks

    def rollback(self, request: Request, num_tokens: int) -> None:
        """Forget the last `num_tokens` accepted tokens (rejected draft tokens of speculative decoding)."""
        matching = self._matching[request]
        matching.matcher.rollback(num_tokens)
        matching.num_accepted -= num_tokens

    def _catch_up(self, request: Request, unread: Sequence[int] = ()) -> _Matching:
        """The request's matcher, having accepted its output so far and then `unread`."""
        matching = self._matching[request]
        received = request.output_token_ids
        if matching.num_accepted > len(received):
            raise RuntimeError(f"request {request.request_id}: the grammar accepted {matching.num_accepted} "
                               f"tokens ahead of the {len(received)} it received")
        for token_id in [*received[matching.num_accepted:], *unread]:
            if matching.refused or matching.matcher.is_terminated():
                break
            if not matching.matcher.accept_token(token_id):
                # Cannot happen while masks are applied; if it does, the reply ends rather than go on unchecked.
                logger.error("request %s: the grammar refused token %d its mask allowed; ending the reply",
                             request.request_id, token_id)
                matching.refused = True
        matching.num_accepted = len(received) + len(unread)
        return matching

    def _batch_matcher(self):
        if self._batch is None:
            import xgrammar

            self._batch = xgrammar.BatchGrammarMatcher()
        return self._batch

    def _stop_only(self) -> np.ndarray:
        mask = np.zeros(bitmask_width(self.vocab_size), dtype=np.uint32)
        for token_id in self.stop_token_ids:
            mask[token_id // 32] |= np.uint32(1 << (token_id % 32))
        return mask.view(np.int32)

    def _make_compiler(self):
        import xgrammar

        try:
            info = xgrammar.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self.vocab_size,
                                                           stop_token_ids=list(self.stop_token_ids) or None)
        except Exception as error:                 # missing or unreadable tokenizer files
            raise GrammarRefused(f"the engine cannot read the model's vocabulary for constrained decoding: "
                                 f"{type(error).__name__}: {error}") from None
        return xgrammar.GrammarCompiler(info)

    def _compile(self, compiler: Future, spec: GrammarSpec) -> Any:
        try:
            return self._compile_grammar(compiler.result(), spec)
        except RuntimeError as error:                  # xgrammar reports a bad grammar this way
            raise GrammarRefused(f"the {spec.kind} grammar cannot be compiled: {error}") from None


def _on_daemon_thread(name: str, function: Callable, *args: Any, slots: threading.Semaphore | None = None) -> Future:
    """Run `function(*args)` on a new daemon thread (holding one of `slots` while it runs, if given);
    its outcome lands in the returned future. Cancelled before it started, it does not run."""
    future: Future = Future()

    def run() -> None:
        with slots if slots is not None else contextlib.nullcontext():
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(function(*args))
            except BaseException as error:             # the waiting side decides what it means
                future.set_exception(error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future

