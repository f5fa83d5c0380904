"""What every route shares: admission checks, sampling parameters, and running requests on the engine.

The engine is a `flare.engine_client.EngineClient`: token ids in, `RequestOutput`s out.
A request that ends early (client gone, server stopping) is aborted at once so its KV pages are freed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable, Sequence, TypeVar

from flare.engine.request import InvalidRequest
from flare.engine.outputs import RequestOutput, TokenLogprob
from flare.engine.sampling_params import GrammarSpec, InvalidSamplingParams, SamplingParams
from flare.engine_client.protocol import EngineClient, EngineDeadError
from flare.frontend.grammar import GrammarError, reply_grammar
from flare.frontend.reasoning import get_reasoning_parser
from flare.frontend.reply import ReplyReader
from flare.frontend.tool_grammar import forced_calls_format
from flare.frontend.tool_parsers import DEFAULT_PARSER, ToolParser, ToolRequest, get_parser, with_history_ids
from flare.server.admission import RequestFields, admit
from flare.server.error_handlers import unexpected
from flare.server.errors import APIError, bad_request, public_reason
from flare.server.frontend import ServingFrontend
from flare.server.limits import LOGIT_BIAS_RANGE, SEED_MIN
from flare.server.metrics import ServerMetrics
from flare.server.settings import SAMPLING_CONTROLS, ServerSettings


LOWEST_BIAS, HIGHEST_BIAS = LOGIT_BIAS_RANGE
T = TypeVar("T")


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


@dataclass(frozen=True)
class RequestedSampling:
    """The sampling and stop fields as a request wrote them (None: not given)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    grammar: GrammarSpec | None = None          # constrained decoding (flare.frontend.grammar)


@dataclass
class Completion:
    """One finished sequence, gathered from its stream of outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: tuple | None = None

    def add(self, output: RequestOutput) -> None:
        self.text += output.new_text
        self.token_ids.extend(output.new_token_ids)
        self.logprobs.extend(output.new_logprobs)
        self.num_prompt_tokens = output.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens = output.num_cached_tokens or self.num_cached_tokens
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        if output.finished:
            self.finish_reason = output.finish_reason
            self.stop_reason = output.stop_reason


def stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    values = (stop,) if isinstance(stop, str) else tuple(stop)
    return tuple(value for value in values if value)


def vocabulary_size(frontend: ServingFrontend) -> int | None:
    return getattr(getattr(frontend, "tokenizer", None), "vocab_size", None)


def check_token_ids(frontend: ServingFrontend, token_ids, param: str) -> None:
    size = vocabulary_size(frontend)
    if size is None:
        return
    bad = [t for t in token_ids if not 0 <= t < size]
    if bad:
        raise bad_request(f"{param}: token ids {bad[:5]} are outside the vocabulary (0..{size - 1})", param=param)


def _wrap_seed(seed: int) -> int:
    return (seed - SEED_MIN) % 2 ** 64 + SEED_MIN


def _logit_bias(frontend: ServingFrontend, raw: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    if not raw:
        return ()
    bias = []
    for key, value in raw.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        bias.append((token_id, min(max(float(value), LOWEST_BIAS), HIGHEST_BIAS)))   # OpenAI's range
    check_token_ids(frontend, [token_id for token_id, _ in bias], "logit_bias")
    return tuple(bias)


class Generation:
    """Admission, sampling parameters and engine calls, shared by every API route."""

    def __init__(self, engine: EngineClient | None, frontend: ServingFrontend | None, settings: ServerSettings,
                 metrics: ServerMetrics) -> None:
        self.engine = engine
        self.frontend = frontend
        self.settings = settings
        self.metrics = metrics
        # Told of each sequence's tokens as they stream and of how it ended (the live dashboard):
        # an object with tokens_streamed(count) and sequence_ended(status, prompt_tokens,
        # generated_tokens, ttft_s); None when nobody watches.
        self.observer: Any = None

    # ---- admission -------------------------------------------------------------------------------

    def admit(self, prompt_len: int, max_tokens: int | None, fields: RequestFields) -> int:
        """The output limit this request gets; refuses what cannot run (`flare.server.admission`)."""
        return admit(self.settings, prompt_len, max_tokens, fields)

    @staticmethod
    async def off_loop(work: Callable[..., T], *args: Any) -> T:
        """Run blocking prompt work (a chat template, tokenizing: seconds for a prompt of megabytes) in a
        worker thread, so the event loop keeps serving every other request meanwhile."""
        return await asyncio.to_thread(work, *args)

    # ---- tools -----------------------------------------------------------------------------------

    def tool_parser(self, tools: ToolRequest, param: str) -> ToolParser | None:
        """The parser for a reply to a request with these tools (None: tools are not in play).

        Refuses a call demanded of no tools, a named function that is not among the tools, and tools the
        chat template cannot show."""
        if tools.choice in ("required", "function") and not tools.tools:
            demanded = "a call to the function " + repr(tools.function) if tools.function else "a tool call"
            raise bad_request(f"tool_choice demands {demanded}, but the request declares no tools; declare them "
                              f"in `tools`, or leave tool_choice out", param="tool_choice")
        if tools.function is not None and tools.function not in tools.names:
            raise bad_request(f"tool_choice names the function {tools.function!r}, which is not among the tools "
                              f"({', '.join(tools.names) or 'none'})", param="tool_choice")
        if not tools.active:
            return None
        template = self.frontend.chat_template
        if not template.supports_tools:
            from flare.frontend.chat_template import TOOLS_UNSUPPORTED

            raise bad_request(TOOLS_UNSUPPORTED, param=param)
        return get_parser(getattr(template, "tool_parser", DEFAULT_PARSER))

    def encode_chat(self, messages: Sequence[dict], tools: ToolRequest, parser: ToolParser | None,
                    **template_kwargs: Any) -> tuple[list[int], str]:
        """The prompt's token ids and its text (the text says whether the reply starts inside reasoning)."""
        history_parser = parser or get_parser(getattr(self.frontend.chat_template, "tool_parser", DEFAULT_PARSER))
        messages = with_history_ids(list(messages), history_parser)
        text = self.frontend.chat_template.render(messages, tools=tools.template_tools(), **template_kwargs)
        # The template writes the special tokens (BOS) itself; adding them again would double them.
        return self.frontend.encode(text, add_special_tokens=False), text

    # ---- structured replies ----------------------------------------------------------------------

    def thinking_kwargs(self, thinking: bool | None, effort: str | None, effort_param: str) -> dict:
        """Template arguments for a request's thinking switch (Qwen3's `enable_thinking`) and effort
        (`reasoning_effort`); a setting the template cannot honour is refused by name."""
        template = self.frontend.chat_template
        found: dict[str, Any] = {}
        if thinking is not None:
            if not template.reads("enable_thinking") and template.reasoning_parser is None:
                raise bad_request("this model does not reason (its chat template has no thinking switch and "
                                  "it writes no reasoning block); leave out the thinking setting", param="thinking")
            if template.reads("enable_thinking"):
                found["enable_thinking"] = thinking
        if effort is not None:
            if not template.reads("reasoning_effort"):
                raise bad_request("this model's chat template does not read reasoning_effort; leave it out",
                                  param=effort_param)
            found["reasoning_effort"] = effort
        return found

    def reply_reader(self, tools: ToolRequest, parser: ToolParser | None, prompt_text: str,
                     thinking: bool | None = None) -> ReplyReader:
        reasoning = get_reasoning_parser(getattr(self.frontend.chat_template, "reasoning_parser", None))
        if reasoning is None or thinking is False:
            return ReplyReader(tools, parser)
        return ReplyReader(tools, parser, reasoning, reasoning.starts_inside(prompt_text))

    def reply_grammar(self, content: GrammarSpec | None, reader: ReplyReader, reasoning_budget: int | None = None,
                      stop: Sequence[str] = ()) -> GrammarSpec | None:
        """The grammar of the reply: its content format and/or a forced tool call, after the model's
        reasoning block when it reasons; refused with a 400 naming the field that cannot be enforced.

        A forced call then always completes unless max_tokens cuts it (finish reason "length"), so stop
        strings, which could cut it silently, are refused beside it."""
        try:
            calls = None
            if reader.tools.forced and stop:
                raise GrammarError("stop sequences could end a forced tool call before it is complete; leave "
                                   "them out or let tool_choice be \"auto\"", "stop")
            if reader.tools.forced:
                if content is not None:
                    raise GrammarError("a forced tool call leaves no reply to format: drop the response format "
                                       "or let tool_choice be \"auto\"", "tool_choice")
                calls = forced_calls_format(reader.tool_parser, reader.tools, self._marker_token(reader.tool_parser))
            prefix = None
            if reader.reasoning is not None and (calls is not None or content is not None or reasoning_budget):
                prefix = reader.reasoning.reasoning_format(reader.starts_in_reasoning, reasoning_budget)
            return reply_grammar(content, calls, prefix)
        except GrammarError as error:
            raise bad_request(str(error), param=error.param) from None

    def _marker_token(self, parser: ToolParser) -> int | None:
        """The id of the parser's call marker when the tokenizer has it as one added (special) token."""
        hf = getattr(getattr(self.frontend, "tokenizer", None), "hf", None)
        if not parser.keeps_special_tokens or hf is None:
            return None
        return hf.get_added_vocab().get(parser.markers[0])

    # ---- sampling --------------------------------------------------------------------------------

    def sampling_params(self, requested: RequestedSampling, max_tokens: int, n: int = 1) -> list[SamplingParams]:
        """One SamplingParams per sample, converted once; sample i's seed is the request's seed + i."""
        first = self._sampling_params(requested, max_tokens)
        if first.seed is None:
            return [first] * n
        # n samples must differ; their seeds wrap around within the signed 64-bit range a seed has
        return [first] + [replace(first, seed=_wrap_seed(first.seed + index)) for index in range(1, n)]

    def _sampling_params(self, requested: RequestedSampling, max_tokens: int) -> SamplingParams:
        policy = self.settings.sampling
        values: dict[str, Any] = {}
        for name in SAMPLING_CONTROLS:
            value = policy.resolve(name, getattr(requested, name))
            if value is not None:
                values[name] = int(value) if name == "top_k" else float(value)
        if requested.stop_token_ids:
            check_token_ids(self.frontend, requested.stop_token_ids, "stop_token_ids")
        stop_ids = tuple(requested.stop_token_ids)
        if not requested.ignore_eos:
            stop_ids += tuple(t for t in self.frontend.eos_token_ids if t not in stop_ids)
        try:
            return SamplingParams(max_tokens=max_tokens, seed=requested.seed, stop=tuple(requested.stop),
                                  stop_token_ids=stop_ids, ignore_eos=requested.ignore_eos,
                                  include_stop_str_in_output=requested.include_stop_str_in_output,
                                  skip_special_tokens=requested.skip_special_tokens,
                                  logit_bias=_logit_bias(self.frontend, requested.logit_bias), logprobs=requested.logprobs,
                                  prompt_logprobs=requested.prompt_logprobs, grammar=requested.grammar,
                                  **values)
        except InvalidSamplingParams as error:
            raise bad_request(str(error)) from None

    # ---- running ---------------------------------------------------------------------------------

    async def stream_one(self, request_id: str, prompt_ids: Sequence[int],
                         params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for one sequence; aborts the request if the consumer stops early."""
        arrival = last = time.monotonic()
        produced = 0
        finished = False
        ttft = None
        final = None
        try:
            async for output in self.engine.generate(request_id, list(prompt_ids), params):
                if output.new_token_ids:
                    now = time.monotonic()
                    if produced == 0:
                        ttft = now - arrival
                        self.metrics.time_to_first_token.observe(ttft)
                    else:
                        self.metrics.inter_token_latency.observe((now - last) / len(output.new_token_ids))
                    produced += len(output.new_token_ids)
                    last = now
                    if self.observer is not None:
                        self.observer.tokens_streamed(len(output.new_token_ids))
                if output.finished:
                    final = output
                    finished = True
                    self.metrics.prompt_tokens.inc(output.num_prompt_tokens)
                    self.metrics.e2e_latency.observe(time.monotonic() - arrival)
                yield output
                if finished:
                    return
        finally:
            self.metrics.generation_tokens.inc(produced)
            if self.observer is not None:
                status = str(final.finish_reason) if final is not None else "aborted"
                prompt_tokens = final.num_prompt_tokens if final is not None else len(prompt_ids)
                self.observer.sequence_ended(status, prompt_tokens, produced, ttft)
            if not finished:
                self.engine.abort(request_id)

    async def stream(self, request_id: str, prompts: Sequence[Sequence[int]],
                     params: Sequence[SamplingParams]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) for the sequences of one request, interleaved as they arrive.

        Sequence i runs prompts[i] with params[i] (n samples of one prompt repeat the prompt).

        Several sequences run in their own tasks; closing this iterator cancels them all, which aborts
        whatever is still running in the engine. One sequence (most requests) is read here directly: a
        task and a queue between the engine and the response would cost two more task switches per token.
        """
        if len(prompts) == 1:
            outputs = self.stream_one(f"{request_id}-0", prompts[0], params[0])
            try:
                while True:
                    try:
                        output = await outputs.__anext__()
                    except StopAsyncIteration:
                        return
                    except Exception as error:      # engine failures, as the consumer sees them
                        raise _engine_error(error) from error
                    yield 0, output
            finally:
                await outputs.aclose()              # now (aborting the request if it still runs)
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(index: int, prompt_ids: Sequence[int], sequence_params: SamplingParams) -> None:
            try:
                async for output in self.stream_one(f"{request_id}-{index}", prompt_ids, sequence_params):
                    queue.put_nowait((index, output))
            except asyncio.CancelledError:
                raise
            except BaseException as error:     # hand engine failures to the consumer
                queue.put_nowait((index, error))
            finally:
                queue.put_nowait((index, done))

        tasks = [asyncio.create_task(pump(i, prompt, p)) for i, (prompt, p) in enumerate(zip(prompts, params))]
        running = len(tasks)
        try:
            while running:
                index, item = await queue.get()
                if item is done:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise _engine_error(item) from item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def complete(self, request_id: str, prompts: Sequence[Sequence[int]],
                       params: Sequence[SamplingParams]) -> list[Completion]:
        completions = [Completion() for _ in params]
        stream = self.stream(request_id, prompts, params)
        try:
            async for index, output in stream:
                completions[index].add(output)
        finally:
            await stream.aclose()
        return completions


def _engine_error(error: BaseException) -> APIError:
    """An engine exception as the HTTP error a client should see (no traceback: those go to the log)."""
    if isinstance(error, InvalidRequest):       # the engine refused the request as given
        return bad_request(str(error))
    if isinstance(error, EngineDeadError):
        return APIError(503, f"the engine stopped: {public_reason(str(error))}")
    return unexpected(error, "this request in the engine")


def usage_numbers(completions: Sequence[Completion], prompt_len: int) -> tuple[int, int, int]:
    """(prompt, completion, cached) token counts over the n samples of one prompt (counted once, as OpenAI)."""
    completion_tokens = sum(len(c.token_ids) for c in completions)
    cached = max((c.num_cached_tokens for c in completions), default=0)
    return prompt_len, completion_tokens, cached


def with_tool_tokens(requested: RequestedSampling, parser: ToolParser | None) -> RequestedSampling:
    """Keep special tokens in the text when the parser's markers are special tokens (Mistral's [TOOL_CALLS])."""
    if parser is not None and parser.keeps_special_tokens:
        return replace(requested, skip_special_tokens=False)
    return requested
