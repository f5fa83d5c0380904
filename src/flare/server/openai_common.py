"""Pieces the OpenAI routes share: logprob shapes, usage, finish reasons, request fields."""

from __future__ import annotations

import math
import time
from typing import Any, Sequence

from flare.engine.outputs import TokenLogprob
from flare.server import sse
from flare.server.frontend import ServingFrontend
from flare.server.generation import RequestedSampling, stop_strings
from flare.server.schemas import SamplingFields


def _finite(value: float) -> float:
    # JSON has no -inf; a token the sampler ruled out gets the most negative finite number, as vLLM does.
    return value if math.isfinite(value) else -9999.0


def token_entry(frontend: ServingFrontend, token_id: int, logprob: float) -> dict:
    text = frontend.token_text(token_id)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(frontend: ServingFrontend, logprobs: Sequence[TokenLogprob], top_k: int) -> dict:
    """Chat Completions `logprobs`: one entry per generated token with its `top_logprobs`."""
    content = []
    for entry in logprobs:
        item = token_entry(frontend, entry.token_id, entry.logprob)
        item["top_logprobs"] = [token_entry(frontend, token_id, lp) for token_id, lp in entry.top[:top_k]]
        content.append(item)
    return {"content": content}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class StreamChunks:
    """The `data:` events of one streamed OpenAI response (chat or completions): each chunk carries the
    response's id, object, creation time and model; `usage` appears only when the client asked for it."""

    def __init__(self, request_id: str, object_name: str, body: Any) -> None:
        self.base = {"id": request_id, "object": object_name, "created": int(time.time()), "model": body.model}
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        # Every chunk starts with the same fields: encoded once, the rest of a chunk is encoded per token.
        self._head = "data: " + sse.dumps(self.base)[:-1] + ',"choices":'
        self._tail = ',"system_fingerprint":null' + (',"usage":null' if self.include_usage else "") + "}\n\n"

    def __call__(self, choices: list[dict], usage_value: Any = None) -> str:
        """`sse.data_event` of {**base, choices, system_fingerprint: None[, usage]}, byte for byte."""
        if usage_value is None:
            return self._head + sse.dumps(choices) + self._tail
        tail = ',"system_fingerprint":null' + (',"usage":' + sse.dumps(usage_value) if self.include_usage else "")
        return self._head + sse.dumps(choices) + tail + "}\n\n"

    # The chunk of nearly every token, from a template (the same bytes as through __call__).

    def text(self, index: int, text: str) -> str:
        """Completions: one choice's text, no logprobs, not finished."""
        return (f'{self._head}[{{"index":{index:d},"text":{sse.json_string(text)},"logprobs":null,'
                f'"finish_reason":null,"stop_reason":null}}]{self._tail}')

    def content(self, index: int, text: str) -> str:
        """Chat Completions: one choice's content delta, no logprobs, not finished."""
        return (f'{self._head}[{{"index":{index:d},"delta":{{"content":{sse.json_string(text)}}},'
                f'"logprobs":null,"finish_reason":null}}]{self._tail}')


def requested_sampling(body: SamplingFields, max_tokens: int | None, logprobs: int | None,
                       prompt_logprobs: int | None = None) -> RequestedSampling:
    return RequestedSampling(
        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
        top_k=body.top_k, min_p=body.min_p, repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty, seed=body.seed,
        stop=stop_strings(body.stop), stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos, include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens, logit_bias=body.logit_bias, logprobs=logprobs,
        prompt_logprobs=prompt_logprobs, n=body.n)
