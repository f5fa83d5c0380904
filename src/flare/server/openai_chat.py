"""POST /v1/chat/completions: OpenAI Chat Completions, streamed (chat.completion.chunk) or not."""

from __future__ import annotations

import time
from typing import AsyncIterator

from flare.frontend.chat_template import ChatTemplateError
from flare.server import sse
from flare.server.errors import bad_request
from flare.server.generation import Generation, new_id, usage_numbers
from flare.server.openai_common import StreamChunks, chat_logprobs, requested_sampling, usage
from flare.server.schemas import ChatCompletionRequest, ChatMessage


def message_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for part in message.content:
        if part.type not in ("text", "input_text", "output_text"):
            raise bad_request(f"content parts of type {part.type!r} are not supported: this model reads text only",
                              param="messages")
        texts.append(part.text or "")
    return "".join(texts)


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Plain {role, content} dicts; `developer` is OpenAI's newer name for `system`."""
    converted = []
    for message in messages:
        role = "system" if message.role == "developer" else message.role
        entry = {"role": role, "content": message_text(message)}
        if message.name:
            entry["name"] = message.name
        converted.append(entry)
    return converted


def prompt_ids(gen: Generation, body: ChatCompletionRequest) -> list[int]:
    try:
        return gen.frontend.encode_chat(template_messages(body.messages),
                                        add_generation_prompt=body.add_generation_prompt,
                                        continue_final_message=body.continue_final_message,
                                        **(body.chat_template_kwargs or {}))
    except ChatTemplateError as error:
        raise bad_request(str(error), param="messages") from None


async def create(gen: Generation, body: ChatCompletionRequest) -> dict | AsyncIterator[str]:
    ids = prompt_ids(gen, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = gen.admit(len(ids), max_tokens, body.n, field)
    requested = requested_sampling(body, max_tokens, logprobs)
    params = [gen.sampling_params(requested, max_tokens, index) for index in range(body.n)]
    # vLLM's `echo`: the reply repeats the final assistant message it continues
    echo_text = message_text(body.messages[-1]) if body.echo and body.messages[-1].role == "assistant" else ""
    request_id = new_id("chatcmpl-")
    if body.stream:
        return _stream(gen, body, request_id, ids, params, logprobs, echo_text)
    return await _complete(gen, body, request_id, ids, params, logprobs, echo_text)


async def _complete(gen, body, request_id, ids, params, logprobs, echo_text) -> dict:
    completions = await gen.complete(request_id, [ids] * len(params), params)
    choices = []
    for index, completion in enumerate(completions):
        choices.append({
            "index": index,
            "message": {"role": "assistant", "content": echo_text + completion.text, "refusal": None,
                        "tool_calls": []},
            "logprobs": chat_logprobs(gen.frontend, completion.logprobs, logprobs) if logprobs is not None else None,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        })
    prompt, generated, cached = usage_numbers(completions, len(ids))
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": body.model,
            "choices": choices, "usage": usage(prompt, generated, cached), "system_fingerprint": None}


async def _stream(gen, body, request_id, ids, params, logprobs, echo_text) -> AsyncIterator[str]:
    chunk = StreamChunks(request_id, "chat.completion.chunk", body)

    for index in range(len(params)):
        yield chunk([{"index": index, "delta": {"role": "assistant", "content": echo_text}, "logprobs": None,
                      "finish_reason": None}])
    generated = 0
    cached = 0
    async for index, output in gen.stream(request_id, [ids] * len(params), params):
        generated += len(output.new_token_ids)
        cached = max(cached, output.num_cached_tokens)
        if output.new_text or output.new_logprobs:
            lp = chat_logprobs(gen.frontend, output.new_logprobs, logprobs) if logprobs is not None else None
            yield chunk([{"index": index, "delta": {"content": output.new_text}, "logprobs": lp,
                          "finish_reason": None}])
        if output.finished:
            yield chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": output.finish_reason,
                          "stop_reason": output.stop_reason}])
    if chunk.include_usage:
        yield chunk([], usage(len(ids), generated, cached))
    yield sse.DONE
