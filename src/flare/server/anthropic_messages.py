"""POST /v1/messages and /v1/messages/count_tokens: Anthropic Messages, streamed or not."""

from __future__ import annotations

from typing import Any, AsyncIterator

from flare.frontend.chat_template import ChatTemplateError
from flare.frontend.reply import Reply, ReplyReader
from flare.frontend.tool_parsers import ToolCall, ToolRequest, function_tool, new_call_id, tool_call_chunks
from flare.server import sse
from flare.server.admission import RequestFields
from flare.server.errors import bad_request
from flare.server.generation import Completion, Generation, RequestedSampling, new_id, with_tool_tokens
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


def _thinking(body: AnthropicCountTokensRequest) -> bool | None:
    return None if body.thinking is None else body.thinking.type != "disabled"


def prompt_ids(gen: Generation, body: AnthropicCountTokensRequest) -> tuple[list[int], ToolRequest, Any, str]:
    """The prompt's token ids and text, the request's tools and their parser."""
    messages = template_messages(body)
    tools = tool_request(body)
    parser = gen.tool_parser(tools, "tools")
    # A final assistant turn is a prefill: the answer continues it (Anthropic semantics).
    prefill = messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls")
    template_kwargs = gen.thinking_kwargs(_thinking(body), None, "thinking")
    try:
        ids, prompt_text = gen.encode_chat(messages, tools, parser, add_generation_prompt=not prefill,
                                           continue_final_message=prefill, **template_kwargs)
    except ChatTemplateError as error:
        raise bad_request(str(error), param="messages") from None
    return ids, tools, parser, prompt_text


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
    ids, tools, parser, prompt_text = await gen.off_loop(prompt_ids, gen, body)
    max_tokens = gen.admit(len(ids), body.max_tokens, RequestFields("messages", "max_tokens", "anthropic"))
    reader = gen.reply_reader(tools, parser, prompt_text, _thinking(body))
    budget = body.thinking.budget_tokens if body.thinking is not None and body.thinking.type == "enabled" else None
    stop = tuple(s for s in body.stop_sequences or () if s)
    requested = RequestedSampling(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                  top_k=body.top_k, stop=stop,
                                  grammar=gen.reply_grammar(None, reader, budget if reader.reasoning else None, stop))
    params = gen.sampling_params(with_tool_tokens(requested, parser), max_tokens)
    message_id = new_id("msg_")
    if body.stream:
        return _stream(gen, body, message_id, ids, params, reader)
    completion = (await gen.complete(message_id, [ids], params))[0]
    reply = reader.read(completion.text)
    stop_reason, stop_sequence = _stop(completion, bool(reply.tool_calls))
    return {"id": message_id, "type": "message", "role": "assistant", "model": body.model,
            "content": _content_blocks(reply, reader.tools.forced), "stop_reason": stop_reason,
            "stop_sequence": stop_sequence, "usage": _usage(len(ids), completion)}


def _tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": new_call_id("toolu_"), "name": call.name, "input": call.input}


def _content_blocks(reply: Reply, forced: bool) -> list[dict]:
    thinking = [{"type": "thinking", "thinking": reply.reasoning, "signature": ""}] if reply.reasoning else []
    shown = reply.text or not (reply.tool_calls or forced or thinking)
    text = [{"type": "text", "text": reply.text}] if shown else []
    return thinking + text + [_tool_use(call) for call in reply.tool_calls]


def _usage(prompt: int, completion: Completion) -> dict:
    """Anthropic's usage: `input_tokens` are the prompt tokens not read from the cache, so the three input
    counts add up to the prompt (the prefix cache fills itself: nothing is billed as cache creation)."""
    cached = completion.num_cached_tokens
    return {"input_tokens": prompt - cached, "output_tokens": len(completion.token_ids),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


async def _stream(gen, body, message_id, ids, params, reader: ReplyReader) -> AsyncIterator[str]:
    def event(kind: str, **fields: Any) -> str:
        return sse.named_event({"type": kind, **fields})

    yield event("message_start", message={
        "id": message_id, "type": "message", "role": "assistant", "model": body.model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": len(ids), "output_tokens": 0}})
    yield event("ping")
    blocks = _Blocks(event)
    splitter = reader.stream()
    completion = Completion()
    async for _, output in gen.stream(message_id, [ids], params):
        completion.add(output)
        reasoning, text = splitter.feed(output.new_text)
        for line in blocks.thinking(reasoning) + blocks.text(text):
            yield line
    rest = splitter.finish()
    for line in blocks.thinking(rest.reasoning) + blocks.text(rest.text):
        yield line
    calls = rest.tool_calls
    if blocks.count == 0 and not (calls or reader.tools.forced):   # a reply without a call has a text block
        for line in blocks.text("", force=True):
            yield line
    for line in blocks.close():
        yield line
    for call in calls:
        index = blocks.count
        blocks.count += 1
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


def delta_event(index: int, kind: str, field: str, text: str) -> str:
    """The content_block_delta event of a text or thinking piece, from a template: the same bytes as
    `sse.named_event({"type": "content_block_delta", "index": index, "delta": {"type": kind, field: text}})`."""
    return (f'event: content_block_delta\ndata: {{"type":"content_block_delta","index":{index:d},'
            f'"delta":{{"type":"{kind}","{field}":{sse.json_string(text)}}}}}\n\n')


class _Blocks:
    """The thinking and text blocks of a streamed message: one open at a time, in order."""

    def __init__(self, event) -> None:
        self.event = event
        self.count = 0                     # blocks started so far
        self.open: str | None = None       # "thinking" | "text"

    def thinking(self, text: str) -> list[str]:
        if not text:
            return []
        lines = self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
        return lines + [delta_event(self.count - 1, "thinking_delta", "thinking", text)]

    def text(self, text: str, force: bool = False) -> list[str]:
        if not text and not force:
            return []
        lines = self._start("text", {"type": "text", "text": ""})
        if text:
            lines.append(delta_event(self.count - 1, "text_delta", "text", text))
        return lines

    def close(self) -> list[str]:
        if self.open is None:
            return []
        lines = []
        if self.open == "thinking":        # the signature comes just before a thinking block stops
            lines.append(self.event("content_block_delta", index=self.count - 1,
                                    delta={"type": "signature_delta", "signature": ""}))
        self.open = None
        return lines + [self.event("content_block_stop", index=self.count - 1)]

    def _start(self, kind: str, block: dict) -> list[str]:
        if self.open == kind:
            return []
        lines = self.close()
        self.open = kind
        self.count += 1
        return lines + [self.event("content_block_start", index=self.count - 1, content_block=block)]
