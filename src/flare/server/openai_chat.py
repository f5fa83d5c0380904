"""POST /v1/chat/completions: OpenAI Chat Completions, streamed (chat.completion.chunk) or not."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import AsyncIterator

from flare.frontend.chat_template import RENDER_ARGUMENTS, ChatTemplateError
from flare.frontend.reply import ReplyReader
from flare.frontend.tool_parsers import (ToolCall, ToolParser, ToolRequest, call_arguments, function_tool, new_call_id,
                                         tool_call_chunks)
from flare.server import sse
from flare.server.admission import RequestFields
from flare.server.constraints import openai_content_grammar
from flare.server.errors import bad_request
from flare.server.generation import Generation, new_id, usage_numbers, with_tool_tokens
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


def _template_call(call) -> dict:
    try:
        arguments = call_arguments(call.function.arguments)
    except ValueError:
        raise bad_request(f"the arguments of tool call {call.id or call.function.name!r} are not a JSON object: "
                          f"{call.function.arguments!r}", param="messages") from None
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """Messages as chat templates read them; `developer` is OpenAI's newer name for `system`, and tool
    calls take Hugging Face's shape (arguments as a dict)."""
    converted = []
    for message in messages:
        role = "system" if message.role == "developer" else message.role
        entry = {"role": role, "content": message_text(message)}
        if message.name:
            entry["name"] = message.name
        if message.tool_calls:
            entry["tool_calls"] = [_template_call(call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        converted.append(entry)
    return converted


def tool_request(body: ChatCompletionRequest) -> ToolRequest:
    tools = tuple(function_tool(t.function.name, t.function.description, t.function.parameters)
                  for t in body.tools or ())
    choice = body.tool_choice or "auto"
    if isinstance(choice, str):
        return ToolRequest(tools, choice, None, body.parallel_tool_calls)
    return ToolRequest(tools, "function", choice.function.name, body.parallel_tool_calls)


def prompt_ids(gen: Generation, body: ChatCompletionRequest) -> list[int]:
    """The prompt's token ids (as /tokenize counts them)."""
    return _encode(gen, body, tool_request(body), None)[0]


def _thinking(body: ChatCompletionRequest) -> bool | None:
    """The request's thinking switch: chat_template_kwargs' enable_thinking (vLLM's convention)."""
    value = (body.chat_template_kwargs or {}).get("enable_thinking")
    return value if isinstance(value, bool) else None


def _encode(gen: Generation, body: ChatCompletionRequest, tools: ToolRequest,
            parser: ToolParser | None) -> tuple[list[int], str]:
    """The prompt's token ids and text."""
    reused = sorted(RENDER_ARGUMENTS & set(body.chat_template_kwargs or ()))
    if reused:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(reused)}: the server passes "
                          f"{'that' if len(reused) == 1 else 'those'} to the chat template itself (set the "
                          f"request's own fields instead)", param="chat_template_kwargs")
    template_kwargs = dict(body.chat_template_kwargs or {})
    template_kwargs.update(gen.thinking_kwargs(None, body.reasoning_effort, "reasoning_effort"))
    try:
        return gen.encode_chat(template_messages(body.messages), tools, parser,
                               add_generation_prompt=body.add_generation_prompt,
                               continue_final_message=body.continue_final_message, **template_kwargs)
    except ChatTemplateError as error:
        raise bad_request(str(error), param="messages") from None


def openai_tool_calls(calls: tuple[ToolCall, ...]) -> list[dict]:
    return [{"id": new_call_id("call_"), "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}} for call in calls]


async def create(gen: Generation, body: ChatCompletionRequest) -> dict | AsyncIterator[str]:
    tools = tool_request(body)
    parser = gen.tool_parser(tools, "tools")
    ids, prompt_text = await gen.off_loop(_encode, gen, body, tools, parser)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", param="top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = gen.admit(len(ids), max_tokens, RequestFields("messages", field))
    reader = gen.reply_reader(tools, parser, prompt_text, _thinking(body))
    requested = with_tool_tokens(requested_sampling(body, max_tokens, logprobs), parser)
    requested = replace(requested, grammar=gen.reply_grammar(openai_content_grammar(body), reader,
                                                             stop=requested.stop))
    params = gen.sampling_params(requested, max_tokens, body.n)
    # vLLM's `echo`: the reply repeats the final assistant message it continues
    echo_text = message_text(body.messages[-1]) if body.echo and body.messages[-1].role == "assistant" else ""
    request_id = new_id("chatcmpl-")
    if body.stream:
        return _stream(gen, body, request_id, ids, params, logprobs, echo_text, reader)
    return await _complete(gen, body, request_id, ids, params, logprobs, echo_text, reader)


async def _complete(gen, body, request_id, ids, params, logprobs, echo_text, reader: ReplyReader) -> dict:
    completions = await gen.complete(request_id, [ids] * len(params), params)
    choices = []
    for index, completion in enumerate(completions):
        reply = reader.read(completion.text)
        finish_reason = "tool_calls" if reply.tool_calls else completion.finish_reason
        content = echo_text + reply.text
        message = {"role": "assistant", "content": content if content or not (reply.tool_calls or reader.tools.forced)
                   else None, "refusal": None, "tool_calls": openai_tool_calls(reply.tool_calls)}
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        choices.append({
            "index": index,
            "message": message,
            "logprobs": chat_logprobs(gen.frontend, completion.logprobs, logprobs) if logprobs is not None else None,
            "finish_reason": finish_reason,
            "stop_reason": completion.stop_reason,
        })
    prompt, generated, cached = usage_numbers(completions, len(ids))
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": body.model,
            "choices": choices, "usage": usage(prompt, generated, cached), "system_fingerprint": None}


async def _stream(gen, body, request_id, ids, params, logprobs, echo_text, reader: ReplyReader) -> AsyncIterator[str]:
    chunk = StreamChunks(request_id, "chat.completion.chunk", body)

    def delta(index: int, fields: dict, lp=None, finish_reason=None) -> str:
        return chunk([{"index": index, "delta": fields, "logprobs": lp, "finish_reason": finish_reason}])

    for index in range(len(params)):
        yield delta(index, {"role": "assistant", "content": echo_text})
    generated = 0
    cached = 0
    splitters = [reader.stream() for _ in params]
    async for index, output in gen.stream(request_id, [ids] * len(params), params):
        generated += len(output.new_token_ids)
        cached = max(cached, output.num_cached_tokens)
        reasoning, text = splitters[index].feed(output.new_text)
        if reasoning:
            yield delta(index, {"reasoning_content": reasoning})
        if text or output.new_logprobs:
            if logprobs is None:
                yield chunk.content(index, text)
            else:
                yield delta(index, {"content": text}, chat_logprobs(gen.frontend, output.new_logprobs, logprobs))
        if output.finished:
            rest = splitters[index].finish()
            if rest.reasoning:
                yield delta(index, {"reasoning_content": rest.reasoning})
            if rest.text:
                yield delta(index, {"content": rest.text})
            for call_index, call in enumerate(rest.tool_calls):
                for call_delta in _call_deltas(call_index, call):
                    yield delta(index, {"tool_calls": [call_delta]})
            finish_reason = "tool_calls" if rest.tool_calls else output.finish_reason
            yield chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason,
                          "stop_reason": output.stop_reason}])
    if chunk.include_usage:
        yield chunk([], usage(len(ids), generated, cached))
    yield sse.DONE


def _call_deltas(call_index: int, call: ToolCall):
    """One tool call as stream deltas: its id and name first, then the arguments text in pieces."""
    yield {"index": call_index, "id": new_call_id("call_"), "type": "function",
           "function": {"name": call.name, "arguments": ""}}
    for piece in tool_call_chunks(call.arguments):
        yield {"index": call_index, "function": {"arguments": piece}}
