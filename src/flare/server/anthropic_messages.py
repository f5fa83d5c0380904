"""POST /v1/messages and /v1/messages/count_tokens: Anthropic Messages, streamed or not."""

from __future__ import annotations

from typing import Any, AsyncIterator

from flare.frontend.chat_template import ChatTemplateError
from flare.frontend.tool_parsers import (ParsedOutput, ToolCall, ToolCallStream, ToolRequest, function_tool,
                                         new_call_id, tool_call_chunks)
from flare.server import sse
from flare.server.admission import RequestFields
from flare.server.errors import bad_request
from flare.server.generation import (Completion, Generation, RequestedSampling, new_id, parse_reply,
                                     with_tool_tokens)
from flare.server.schemas import AnthropicBlock, AnthropicCountTokensRequest, AnthropicMessagesRequest

_SKIPPED_BLOCKS = ("thinking", "redacted_thinking")


def _block_text(block: AnthropicBlock) -> str | None:
    if block.type == "text":
        return block.text or ""
    if block.type in _SKIPPED_BLOCKS:
        return None
    raise bad_request(f"content blocks of type {block.type!r} are not supported: this model reads text only")


def _result_text(block: AnthropicBlock) -> str:
    """A tool_result's content: a string, or text blocks."""
    if isinstance(block.content, str):
        return block.content
    texts = []
    for part in block.content or []:
        if part.get("type") != "text":
            raise bad_request(f"tool_result content of type {part.get('type')!r} is not supported: this model "
                              f"reads text only", param="messages")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def _template_call(block: AnthropicBlock) -> dict:
    extra = block.model_extra or {}
    arguments = extra.get("input")
    if not isinstance(arguments, dict):
        raise bad_request("a tool_use block needs `input`, a JSON object", param="messages")
    return {"id": extra.get("id", ""), "type": "function",
            "function": {"name": extra.get("name", ""), "arguments": arguments}}


def _turn_messages(role: str, content: str | list[AnthropicBlock]) -> list[dict]:
    """One Anthropic turn as chat-template messages: an assistant's tool_use blocks become its `tool_calls`;
    a user's tool_result blocks become `tool` messages (first, as they answer the calls just made)."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    texts, calls, results = [], [], []
    for block in content:
        if block.type == "tool_use" and role == "assistant":
            calls.append(_template_call(block))
        elif block.type == "tool_result" and role == "user":
            extra = block.model_extra or {}
            text = _result_text(block)
            if extra.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": extra.get("tool_use_id", ""), "content": text})
        else:
            text = _block_text(block)
            if text is not None:
                texts.append(text)
    messages = list(results)
    if texts or calls or not results:
        entry = {"role": role, "content": "".join(texts)}
        if calls:
            entry["tool_calls"] = calls
        messages.append(entry)
    return messages


def _text(content: str | list[AnthropicBlock] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(text for text in map(_block_text, content) if text is not None)


def template_messages(body: AnthropicCountTokensRequest) -> list[dict]:
    """The conversation for the chat template. Every system text (the `system` field and any `system`
    role inside `messages`) becomes one leading system message, which every chat template accepts."""
    system = [_text(body.system)] if body.system else []
    turns = []
    for message in body.messages:
        if message.role == "system":
            system.append(_text(message.content))
        else:
            turns.extend(_turn_messages(message.role, message.content))
    leading = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    return leading + turns


def tool_request(body: AnthropicCountTokensRequest) -> ToolRequest:
    tools = []
    for tool in body.tools or ():
        if tool.input_schema is None:
            raise bad_request(f"tool {tool.name!r} has no input_schema: server tools ({tool.type}) are not "
                              f"supported here; declare client tools with an input_schema", param="tools")
        tools.append(function_tool(tool.name, tool.description, tool.input_schema))
    choice = body.tool_choice
    if choice is None:
        return ToolRequest(tuple(tools))
    kind = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}[choice.type]
    if kind == "function" and not choice.name:
        raise bad_request("tool_choice of type \"tool\" needs the tool's `name`", param="tool_choice")
    return ToolRequest(tuple(tools), kind, choice.name if kind == "function" else None,
                       not choice.disable_parallel_tool_use)


def prompt_ids(gen: Generation, body: AnthropicCountTokensRequest) -> tuple[list[int], ToolRequest, Any, str]:
    """The prompt's token ids, the request's tools and their parser, and the reply's forced opening."""
    messages = template_messages(body)
    tools = tool_request(body)
    parser = gen.tool_parser(tools, "tools")
    # A final assistant turn is a prefill: the answer continues it (Anthropic semantics).
    prefill = messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
    try:
        ids, prefix = gen.encode_chat(messages, tools, parser, add_generation_prompt=not prefill,
                                      continue_final_message=prefill)
    except ChatTemplateError as error:
        raise bad_request(str(error), param="messages") from None
    return ids, tools, parser, prefix


async def count_tokens(gen: Generation, body: AnthropicCountTokensRequest) -> dict:
    return {"input_tokens": len((await gen.off_loop(prompt_ids, gen, body))[0])}


def _stop(completion: Completion, called: bool = False) -> tuple[str, str | None]:
    if called:
        return "tool_use", None
    if completion.finish_reason == "length":
        return "max_tokens", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


async def create(gen: Generation, body: AnthropicMessagesRequest) -> dict | AsyncIterator[str]:
    ids, tools, parser, prefix = await gen.off_loop(prompt_ids, gen, body)
    max_tokens = gen.admit(len(ids), body.max_tokens, RequestFields("messages", "max_tokens", "anthropic"))
    requested = RequestedSampling(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                  top_k=body.top_k, stop=tuple(s for s in body.stop_sequences or () if s))
    params = gen.sampling_params(with_tool_tokens(requested, parser), max_tokens)
    message_id = new_id("msg_")
    if body.stream:
        return _stream(gen, body, message_id, ids, params, (parser, tools, prefix))
    completion = (await gen.complete(message_id, [ids], params))[0]
    parsed = parse_reply(completion.text, parser, tools, prefix)
    stop_reason, stop_sequence = _stop(completion, bool(parsed.tool_calls))
    return {"id": message_id, "type": "message", "role": "assistant", "model": body.model,
            "content": _content_blocks(parsed), "stop_reason": stop_reason,
            "stop_sequence": stop_sequence, "usage": _usage(len(ids), completion)}


def _tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": new_call_id("toolu_"), "name": call.name, "input": call.input}


def _content_blocks(parsed: ParsedOutput) -> list[dict]:
    text = [{"type": "text", "text": parsed.text}] if parsed.text or not parsed.tool_calls else []
    return text + [_tool_use(call) for call in parsed.tool_calls]


def _usage(prompt: int, completion: Completion) -> dict:
    """Anthropic's usage: `input_tokens` are the prompt tokens not read from the cache, so the three input
    counts add up to the prompt (the prefix cache fills itself: nothing is billed as cache creation)."""
    cached = completion.num_cached_tokens
    return {"input_tokens": prompt - cached, "output_tokens": len(completion.token_ids),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


async def _stream(gen, body, message_id, ids, params, reading) -> AsyncIterator[str]:
    def event(kind: str, **fields: Any) -> str:
        return sse.named_event({"type": kind, **fields})

    parser, tools, prefix = reading
    splitter = ToolCallStream(parser, prefix) if parser is not None else None
    blocks = 0                                    # content blocks started so far
    yield event("message_start", message={
        "id": message_id, "type": "message", "role": "assistant", "model": body.model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": len(ids), "output_tokens": 0}})
    yield event("ping")
    completion = Completion()
    async for _, output in gen.stream(message_id, [ids], params):
        completion.add(output)
        text = splitter.feed(output.new_text) if splitter is not None else output.new_text
        if text:
            if not blocks:
                blocks = 1
                yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
            yield event("content_block_delta", index=0, delta={"type": "text_delta", "text": text})
    parsed = splitter.finish() if splitter is not None else ParsedOutput("")
    calls = tools.keep(parsed.tool_calls)
    if parsed.text or (not blocks and not calls):  # a reply with no tool call always has its text block
        if not blocks:
            blocks = 1
            yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
        if parsed.text:
            yield event("content_block_delta", index=0, delta={"type": "text_delta", "text": parsed.text})
    if blocks:
        yield event("content_block_stop", index=0)
    for index, call in enumerate(calls, start=blocks):
        yield event("content_block_start", index=index,
                    content_block={"type": "tool_use", "id": new_call_id("toolu_"), "name": call.name, "input": {}})
        for piece in tool_call_chunks(call.arguments):
            yield event("content_block_delta", index=index, delta={"type": "input_json_delta", "partial_json": piece})
        yield event("content_block_stop", index=index)
    stop_reason, stop_sequence = _stop(completion, bool(calls))
    # The final usage: the cache's share of the prompt is known only once the engine has started it.
    yield event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                usage=_usage(len(ids), completion))
    yield event("message_stop")
