"""POST /v1/messages and /v1/messages/count_tokens: Anthropic Messages, streamed or not."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from flare.frontend.chat_template import ChatTemplateError
from flare.server import sse
from flare.server.errors import bad_request
from flare.server.generation import Completion, Generation, RequestedSampling, new_id
from flare.server.schemas import AnthropicBlock, AnthropicCountTokensRequest, AnthropicMessagesRequest

_SKIPPED_BLOCKS = ("thinking", "redacted_thinking")


def _block_text(block: AnthropicBlock) -> str | None:
    if block.type == "text":
        return block.text or ""
    if block.type == "tool_result":                  # a tool's answer is text the model must read
        if isinstance(block.content, str):
            return block.content
        return "".join(str(part.get("text", "")) for part in block.content or [] if isinstance(part, dict))
    if block.type in _SKIPPED_BLOCKS:
        return None
    if block.type == "tool_use":                     # an earlier turn's call, kept readable in the history
        extra = block.model_extra or {}
        return f"[tool call {extra.get('name', '')}: {json.dumps(extra.get('input', {}), ensure_ascii=False)}]"
    raise bad_request(f"content blocks of type {block.type!r} are not supported: this model reads text only")


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
            turns.append({"role": message.role, "content": _text(message.content)})
    leading = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    return leading + turns


def prompt_ids(gen: Generation, body: AnthropicCountTokensRequest) -> list[int]:
    messages = template_messages(body)
    # A final assistant turn is a prefill: the answer continues it (Anthropic semantics).
    prefill = messages[-1]["role"] == "assistant"
    try:
        return gen.frontend.encode_chat(messages, add_generation_prompt=not prefill, continue_final_message=prefill)
    except ChatTemplateError as error:
        raise bad_request(str(error), param="messages") from None


def count_tokens(gen: Generation, body: AnthropicCountTokensRequest) -> dict:
    return {"input_tokens": len(prompt_ids(gen, body))}


def _stop(completion: Completion) -> tuple[str, str | None]:
    if completion.finish_reason == "length":
        return "max_tokens", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


async def create(gen: Generation, body: AnthropicMessagesRequest) -> dict | AsyncIterator[str]:
    ids = prompt_ids(gen, body)
    max_tokens = gen.admit(len(ids), body.max_tokens, 1, "max_tokens")
    requested = RequestedSampling(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                                  top_k=body.top_k, stop=tuple(s for s in body.stop_sequences or () if s))
    params = [gen.sampling_params(requested, max_tokens)]
    message_id = new_id("msg_")
    if body.stream:
        return _stream(gen, body, message_id, ids, params)
    completion = (await gen.complete(message_id, [ids], params))[0]
    stop_reason, stop_sequence = _stop(completion)
    return {"id": message_id, "type": "message", "role": "assistant", "model": body.model,
            "content": [{"type": "text", "text": completion.text}], "stop_reason": stop_reason,
            "stop_sequence": stop_sequence, "usage": _usage(len(ids), len(completion.token_ids), completion)}


def _usage(prompt: int, generated: int, completion: Completion) -> dict:
    cached = completion.num_cached_tokens
    return {"input_tokens": prompt, "output_tokens": generated, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


async def _stream(gen, body, message_id, ids, params) -> AsyncIterator[str]:
    def event(kind: str, **fields: Any) -> str:
        return sse.named_event({"type": kind, **fields})

    yield event("message_start", message={
        "id": message_id, "type": "message", "role": "assistant", "model": body.model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": len(ids), "output_tokens": 0}})
    yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
    yield event("ping")
    completion = Completion()
    async for _, output in gen.stream(message_id, [ids], params):
        completion.add(output)
        if output.new_text:
            yield event("content_block_delta", index=0, delta={"type": "text_delta", "text": output.new_text})
    stop_reason, stop_sequence = _stop(completion)
    yield event("content_block_stop", index=0)
    yield event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                usage={"output_tokens": len(completion.token_ids)})
    yield event("message_stop")
