"""POST /v1/responses: OpenAI Responses, stateless (the whole conversation comes in `input`)."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from flare.frontend.chat_template import ChatTemplateError
from flare.frontend.reply import ReplyReader
from flare.frontend.tool_parsers import ToolCall, ToolRequest, call_arguments, function_tool, new_call_id, tool_call_chunks
from flare.server import sse
from flare.server.admission import RequestFields
from flare.server.errors import bad_request
from flare.server.constraints import responses_content_grammar
from flare.server.generation import Completion, Generation, RequestedSampling, new_id, with_tool_tokens
from flare.server.openai_common import token_entry
from flare.server.schemas import ResponsesRequest

_TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _item_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("each input message needs `content`: a string or a list of text parts", param="input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"input parts of type {kind!r} are not supported: this model reads text only",
                              param="input")
        texts.append(str(part.get("text") or ""))
    return "".join(texts)


def _function_call(item: dict) -> dict:
    """A `function_call` input item (an earlier reply's call) in Hugging Face's tool_calls shape."""
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("a function_call input item needs the function's `name`", param="input")
    try:
        arguments = call_arguments(item.get("arguments"))
    except ValueError:
        raise bad_request(f"the arguments of function_call {item.get('call_id', name)!r} are not a JSON object",
                          param="input") from None
    return {"id": item.get("call_id", ""), "type": "function", "function": {"name": name, "arguments": arguments}}


def _add_call(messages: list[dict], call: dict) -> None:
    """Calls join the assistant message just before them, as one reply holds its text and its calls."""
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def template_messages(body: ResponsesRequest) -> list[dict]:
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    for item in body.input:
        kind = item.get("type", "message")
        if kind == "reasoning":                        # earlier reasoning summaries carry no prompt text
            continue
        if kind == "function_call":
            _add_call(messages, _function_call(item))
            continue
        if kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id", ""),
                             "content": _item_text(item.get("output", ""))})
            continue
        if kind != "message" or "role" not in item:
            raise bad_request(f"input items of type {kind!r} are not supported; send messages with a role and "
                              f"text content", param="input")
        role = item["role"]
        if role not in ("user", "assistant", "system", "developer"):
            raise bad_request(f"unknown input role {role!r}", param="input")
        messages.append({"role": "system" if role == "developer" else role, "content": _item_text(item.get("content"))})
    return messages


def tool_request(body: ResponsesRequest) -> ToolRequest:
    tools = []
    for tool in body.tools or ():
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools of type {tool.get('type')!r} are not supported: declare functions "
                              f"({{\"type\": \"function\", \"name\": ..., \"parameters\": ...}})", param="tools")
        tools.append(function_tool(tool["name"], tool.get("description"), tool.get("parameters")))
    choice = body.tool_choice or "auto"
    if isinstance(choice, str):
        return ToolRequest(tuple(tools), choice, None, body.parallel_tool_calls)
    if choice.get("type") != "function" or not choice.get("name"):
        raise bad_request("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                          "\"name\": ...}", param="tool_choice")
    return ToolRequest(tuple(tools), "function", choice["name"], body.parallel_tool_calls)


def _logprobs(gen: Generation, completion_logprobs, top_k: int) -> list[dict]:
    entries = []
    for entry in completion_logprobs:
        item = token_entry(gen.frontend, entry.token_id, entry.logprob)
        item["top_logprobs"] = [token_entry(gen.frontend, tid, lp) for tid, lp in entry.top[:top_k]]
        entries.append(item)
    return entries


def _usage(prompt: int, generated: int, cached: int) -> dict:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + generated}


class _Response:
    """Builds the `response` object and the message item as a request moves through its states."""

    def __init__(self, body: ResponsesRequest, response_id: str, message_id: str) -> None:
        self.body = body
        self.id = response_id
        self.message_id = message_id
        self.reasoning_id = new_id("rs_")
        self.created_at = int(time.time())

    def reasoning(self, text: str) -> dict:
        return {"id": self.reasoning_id, "type": "reasoning", "summary": [], "status": "completed",
                "content": [{"type": "reasoning_text", "text": text}]}

    def function_call(self, call: ToolCall) -> dict:
        return {"id": new_id("fc_"), "type": "function_call", "status": "completed", "call_id": new_call_id("call_"),
                "name": call.name, "arguments": call.arguments}

    def message(self, text: str, logprobs: list | None, status: str) -> dict:
        part = {"type": "output_text", "text": text, "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs
        return {"id": self.message_id, "type": "message", "status": status, "role": "assistant", "content": [part]}

    def envelope(self, status: str, output: list, usage: dict | None, finish_reason: str | None = None) -> dict:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": "incomplete" if incomplete else status, "model": body.model, "output": output,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "temperature": body.temperature, "top_p": body.top_p, "top_logprobs": body.top_logprobs,
                "parallel_tool_calls": body.parallel_tool_calls, "tool_choice": body.tool_choice or "auto",
                "tools": body.tools or [], "previous_response_id": None,
                "metadata": body.metadata or {}, "incomplete_details": incomplete, "error": None,
                "text": {"format": _text_format(body)}, "truncation": "disabled", "store": False,
                "background": False, "usage": usage}


def _encode(gen: Generation, body: ResponsesRequest, tools: ToolRequest, parser) -> tuple[list[int], str]:
    effort = (body.reasoning or {}).get("effort")
    try:
        return gen.encode_chat(template_messages(body), tools, parser,
                               **gen.thinking_kwargs(None, effort, "reasoning.effort"))
    except ChatTemplateError as error:
        raise bad_request(str(error), param="input") from None


def _text_format(body: ResponsesRequest) -> dict:
    """The response's `text.format`: the request's, as it asked for it."""
    requested = body.text.format if body.text is not None else None
    if requested is None or requested.type != "json_schema":
        return {"type": requested.type if requested is not None else "text"}
    return {"type": "json_schema", "name": requested.name, "schema": requested.schema_,
            "description": requested.description, "strict": requested.strict}


async def create(gen: Generation, body: ResponsesRequest) -> dict | AsyncIterator[str]:
    if body.previous_response_id:
        raise bad_request("previous_response_id is not supported: this server keeps no responses (it is "
                          "stateless). Send the whole conversation in `input` instead.",
                          param="previous_response_id")
    tools = tool_request(body)
    parser = gen.tool_parser(tools, "tools")
    ids, prompt_text = await gen.off_loop(_encode, gen, body, tools, parser)
    max_tokens = gen.admit(len(ids), body.max_output_tokens, RequestFields("input", "max_output_tokens"))
    want_logprobs = body.top_logprobs is not None or LOGPROBS_INCLUDE in (body.include or [])
    top_k = body.top_logprobs or 0
    reader = gen.reply_reader(tools, parser, prompt_text)
    requested = RequestedSampling(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                  top_k=body.top_k, min_p=body.min_p, repetition_penalty=body.repetition_penalty,
                                  seed=body.seed, ignore_eos=body.ignore_eos,
                                  logprobs=top_k if want_logprobs else None,
                                  grammar=gen.reply_grammar(responses_content_grammar(body), reader))
    params = gen.sampling_params(with_tool_tokens(requested, parser), max_tokens)
    response = _Response(body, new_id("resp_"), new_id("msg_"))
    if body.stream:
        return _stream(gen, response, ids, params, want_logprobs, top_k, reader)
    completion = (await gen.complete(response.id, [ids], params))[0]
    logprobs = _logprobs(gen, completion.logprobs, top_k) if want_logprobs else None
    reply = reader.read(completion.text)
    calls = [response.function_call(call) for call in reply.tool_calls]
    reasoning = [response.reasoning(reply.reasoning)] if reply.reasoning else []
    return _final(response, completion, logprobs, len(ids), reply.text, reasoning + calls,
                  show_text=bool(reply.text) or not (calls or reader.tools.forced))


def _final(response: _Response, completion: Completion, logprobs: list | None, prompt_len: int, text: str,
           items: list[dict], show_text: bool) -> dict:
    """The finished response: its reasoning, its message (when shown), then its calls."""
    status = "incomplete" if completion.finish_reason == "length" else "completed"
    reasoning = [item for item in items if item["type"] == "reasoning"]
    calls = [item for item in items if item["type"] != "reasoning"]
    output = reasoning + ([response.message(text, logprobs, status)] if show_text else []) + calls
    return response.envelope("completed", output, _usage(prompt_len, len(completion.token_ids),
                                                         completion.num_cached_tokens), completion.finish_reason)


class _Events:
    """The numbered SSE events of one streamed response, and the output items opened so far."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items = 0                       # output items opened so far

    def __call__(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse.named_event(payload)

    def open(self, item: dict, part: dict | None) -> tuple[int, list[str]]:
        """Open an output item (and its first content part): its output index and the events."""
        index, self.items = self.items, self.items + 1
        events = [self("response.output_item.added", output_index=index, item=item)]
        if part is not None:
            events.append(self("response.content_part.added", item_id=item["id"], output_index=index,
                               content_index=0, part=part))
        return index, events


async def _stream(gen, response: _Response, ids, params, want_logprobs: bool, top_k: int,
                  reader: ReplyReader) -> AsyncIterator[str]:
    event = _Events()
    yield event("response.created", response=response.envelope("in_progress", [], None))
    yield event("response.in_progress", response=response.envelope("in_progress", [], None))
    thinking = _OpenPart(event, "reasoning", response.reasoning_id)
    message = _OpenPart(event, "message", response.message_id)
    splitter = reader.stream()
    completion = Completion()
    async for _, output in gen.stream(response.id, [ids], params):
        completion.add(output)
        reasoning, shown = splitter.feed(output.new_text)
        for line in thinking.add(reasoning):
            yield line
        if shown or (output.new_logprobs and message.index is not None):
            for line in thinking.close():
                yield line
            for line in message.add(shown, _logprobs(gen, output.new_logprobs, top_k) if want_logprobs else []):
                yield line
    rest = splitter.finish()
    for line in thinking.add(rest.reasoning):
        yield line
    for line in thinking.close():
        yield line
    calls = rest.tool_calls
    if rest.text or (message.index is None and not (calls or reader.tools.forced)):
        for line in message.add(rest.text, [], force=True):
            yield line
    logprobs = _logprobs(gen, completion.logprobs, top_k) if want_logprobs else None
    call_items = [response.function_call(call) for call in calls]
    reasoning_items = [response.reasoning(thinking.text)] if thinking.text else []
    final = _final(response, completion, logprobs, len(ids), message.text, reasoning_items + call_items,
                   show_text=message.index is not None)
    if message.index is not None:
        for line in message.close(final["output"][len(reasoning_items)], logprobs or []):
            yield line
    for call, item in zip(calls, call_items):
        output_index, opened = event.open(dict(item, status="in_progress", arguments=""), None)
        for line in opened:
            yield line
        for piece in tool_call_chunks(call.arguments):
            yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=output_index,
                        delta=piece)
        yield event("response.function_call_arguments.done", item_id=item["id"], output_index=output_index,
                    name=call.name, arguments=call.arguments)
        yield event("response.output_item.done", output_index=output_index, item=item)
    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    yield event(kind, response=final)


class _OpenPart:
    """The reasoning item or the message while it streams: opened at its first text, closed once."""

    KINDS = {"reasoning": ("reasoning_text", "response.reasoning_text"),
             "message": ("output_text", "response.output_text")}

    def __init__(self, event: _Events, kind: str, item_id: str) -> None:
        self.event, self.kind, self.item_id = event, kind, item_id
        self.part_type, self.prefix = self.KINDS[kind]
        self.index: int | None = None
        self.text = ""
        self.closed = False

    def _located(self) -> dict:
        return {"item_id": self.item_id, "output_index": self.index, "content_index": 0}

    def add(self, text: str, logprobs: list | None = None, force: bool = False) -> list[str]:
        if (not text and not force) or self.closed:
            return []
        events = []
        if self.index is None:
            item = ({"id": self.item_id, "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
                    if self.kind == "reasoning" else
                    {"id": self.item_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []})
            part = {"type": self.part_type, "text": ""}
            if self.kind == "message":
                part.update(annotations=[], logprobs=[])
            self.index, events = self.event.open(item, part)
        if text or logprobs:
            fields = {"logprobs": logprobs or []} if self.kind == "message" else {}
            events.append(self.event(f"{self.prefix}.delta", **self._located(), delta=text, **fields))
        self.text += text
        return events

    def close(self, item: dict | None = None, logprobs: list | None = None) -> list[str]:
        """The closing events; the reasoning item closes itself, the message with its final item."""
        if self.index is None or self.closed:
            return []
        self.closed = True
        if item is None:
            item = {"id": self.item_id, "type": "reasoning", "summary": [], "status": "completed",
                    "content": [{"type": "reasoning_text", "text": self.text}]}
        fields = {"logprobs": logprobs or []} if self.kind == "message" else {}
        return [self.event(f"{self.prefix}.done", **self._located(), text=self.text, **fields),
                self.event("response.content_part.done", **self._located(), part=item["content"][0]),
                self.event("response.output_item.done", output_index=self.index, item=item)]
