"""Output processor: core token ids -> RequestOutput with text, stop strings and usage counts.

Per request it keeps an incremental detokenizer and the text generated so far. Text that could
still grow into a stop string is held back; when a stop string appears, the text is cut before it
(or after it, with include_stop_str_in_output), the request finishes with reason "stop", and its id
is returned so the caller aborts it in the core.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from flare.engine.outputs import CoreOutput, RequestOutput
from flare.engine.sampling_params import SamplingParams
from flare.frontend.detokenizer import IncrementalDetokenizer
from flare.frontend.tokenizer import Tokenizer


@dataclass
class _RequestState:
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_emitted_chars: int = 0
    num_output_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens)
        self._states[request_id] = _RequestState(params, detokenizer)

    def abort(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def process(self, core_outputs: Iterable[CoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Return the outputs to deliver and the ids a stop string finished (to abort in the core)."""
        outputs, stopped = [], []
        for core_output in core_outputs:
            state = self._states.get(core_output.request_id)
            if state is None:
                continue                                    # aborted while its step ran
            output = self._process_one(state, core_output)
            if output.finished:
                del self._states[core_output.request_id]
                if core_output.finish_reason is None:
                    stopped.append(core_output.request_id)
            outputs.append(output)
        return outputs, stopped

    def _process_one(self, state: _RequestState, core_output: CoreOutput) -> RequestOutput:
        params = state.params
        token_ids = core_output.new_token_ids
        finish_reason, stop_reason = core_output.finish_reason, None
        if core_output.stop_token_id is not None:
            stop_reason = core_output.stop_token_id if core_output.stop_token_id in params.stop_token_ids else None
            if not params.include_stop_str_in_output:
                token_ids = token_ids[:-1]                  # a stop token adds no text
        state.num_output_tokens += len(core_output.new_token_ids)
        searched_from = len(state.text)
        state.text += state.detokenizer.add(token_ids)
        if params.stop and finish_reason != "stop":
            match = find_stop_string(state.text, params.stop, searched_from)
            if match is not None:
                position, stop = match
                state.text = state.text[:position + (len(stop) if params.include_stop_str_in_output else 0)]
                finish_reason, stop_reason = "stop", stop
        visible = len(state.text)
        if finish_reason is None and params.stop and not params.include_stop_str_in_output:
            visible -= partial_stop_length(state.text, params.stop)
        new_text = state.text[state.num_emitted_chars:visible]
        state.num_emitted_chars = max(state.num_emitted_chars, visible)
        return RequestOutput(
            request_id=core_output.request_id,
            new_token_ids=core_output.new_token_ids,
            new_text=new_text,
            new_logprobs=core_output.new_logprobs,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_prompt_tokens=core_output.num_prompt_tokens,
            num_output_tokens=state.num_output_tokens,
            num_cached_tokens=core_output.num_cached_tokens,
            prompt_logprobs=core_output.prompt_logprobs,
        )


def find_stop_string(text: str, stops: Sequence[str], searched_from: int) -> tuple[int, str] | None:
    """The earliest stop string in `text` that ends after `searched_from` (older text was searched)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        position = text.find(stop, max(0, searched_from - len(stop) + 1))
        if position >= 0 and (best is None or position < best[0]):
            best = (position, stop)
    return best


def partial_stop_length(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that is the start of a stop string (held back for now).

    Tool-call markers are held back the same way (`tool_parsers.ToolCallStream`)."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest
