"""Admission: whether a prompt and its output limit fit the model's context and the KV page pool.

Refusals name the field to change and read in the section-6 form (what was needed, what there is, the
options). Context overflows on the OpenAI routes open with OpenAI's own sentence, "This model's maximum
context length is N tokens. However, you requested M tokens (...)", and carry the code
`context_length_exceeded`: clients match that text (litellm raises its ContextWindowExceededError, which
drives `context_window_fallbacks`). The Anthropic route opens with Anthropic's "prompt is too long" form.

The server owns the checks an HTTP client sees (their wording and fields); the engine's own prompt check
(`validate_prompt`, once, in `AsyncEngine.generate`) stays as the engine's guard.
"""

from __future__ import annotations

from dataclasses import dataclass

from flare.server.errors import APIError, ApiFamily, bad_request
from flare.server.settings import ServerSettings

CONTEXT_CODE = "context_length_exceeded"


@dataclass(frozen=True)
class RequestFields:
    """How one API names a request's prompt and its output limit."""

    prompt: str                      # "messages", "prompt" or "input"
    max_tokens: str                  # "max_tokens", "max_completion_tokens" or "max_output_tokens"
    family: ApiFamily = "openai"


def admit(settings: ServerSettings, prompt_len: int, max_tokens: int | None, fields: RequestFields) -> int:
    """The output limit this request gets (when not given: whatever the context and the page pool leave,
    as vLLM does); raises the 400 a request that cannot run gets."""
    context = settings.max_model_len
    if max_tokens is None and prompt_len >= context:
        raise _context_error(context, prompt_len, None, fields)
    if max_tokens is None:
        max_tokens = max(1, min(context, settings.kv_tokens or context) - prompt_len)
    elif prompt_len + max_tokens > context:
        raise _context_error(context, prompt_len, max_tokens, fields)
    kv_tokens = settings.kv_tokens
    needed = prompt_len + max_tokens
    # n samples queue in the engine when the pool is short; one sequence larger than the pool never runs.
    if kv_tokens is not None and needed > kv_tokens:
        raise bad_request(
            f"needs {needed:,} KV cache tokens ({prompt_len:,} prompt + {max_tokens:,} output); "
            f"the KV page pool holds {kv_tokens:,} tokens. Options: a lower {fields.max_tokens}, a shorter "
            f"prompt, or a larger pool with --kv-cache-limit memory or a higher --memory-limit.",
            param=fields.max_tokens, code="capacity_exceeded")
    return max_tokens


def _context_error(context: int, prompt_len: int, max_tokens: int | None, fields: RequestFields) -> APIError:
    """The refusal of a prompt (plus output limit, when given) longer than the context."""
    output = max_tokens if max_tokens is not None else 1
    prompt_fits = prompt_len < context
    if prompt_fits:
        options = f"{fields.max_tokens} = {context - prompt_len} or less, or a shorter {fields.prompt}"
    else:
        options = f"shorten the {fields.prompt} to at most {context - 1} tokens"
    param = fields.max_tokens if prompt_fits else fields.prompt
    if fields.family == "anthropic":
        if prompt_fits:
            opening = (f"max_tokens: {output} > {context - prompt_len}, which is what a prompt of {prompt_len} "
                       f"tokens leaves of the model's {context}-token context")
        else:
            opening = (f"prompt is too long: {prompt_len} tokens > {context - 1} maximum (the model's context "
                       f"of {context} tokens holds the prompt and at least 1 output token)")
        return bad_request(f"{opening}. Options: {options}.", param=param, code=CONTEXT_CODE)
    completion = f"{output} in the completion" if max_tokens is not None else "at least 1 in the completion"
    return bad_request(
        f"This model's maximum context length is {context} tokens. However, you requested "
        f"{prompt_len + output} tokens ({prompt_len} in the {fields.prompt}, {completion}). Please reduce the "
        f"length of the {fields.prompt} or completion. Options: {options}.", param=param, code=CONTEXT_CODE)
