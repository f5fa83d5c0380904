"""The routes' endpoints: each takes the request and answers from the app's `ServingState`.

The generation routes of the four APIs share `generate` (readiness, body, model name, the API module's
handler, metrics); the rest are small: tokenizer routes, model cards, health, metrics, engine stats.
`flare.server.app.ROUTES` maps paths to them.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from flare.server import anthropic_messages, openai_chat, openai_completions, openai_responses
from flare.server.errors import APIError, bad_request, family_for_path, public_reason
from flare.server.generation import Generation, check_token_ids
from flare.server.metrics import CONTENT_TYPE
from flare.server.request_body import parse, read_json
from flare.server.schemas import (AnthropicCountTokensRequest, AnthropicMessagesRequest, ChatCompletionRequest,
                                  CompletionRequest, DetokenizeRequest, ResponsesRequest, TokenizeRequest)
from flare.server.settings import ServerSettings
from flare.server.streaming import SSEResponse, until_disconnect

Endpoint = Callable[[Request], Awaitable[Response]]
Handler = Callable[[Generation, Any], Awaitable[Any]]      # an API module's create(): a dict or SSE events


def state_of(request: Request) -> Any:
    """The app's `flare.server.app.ServingState`."""
    return request.app.state.serving


def check_model(settings: ServerSettings, name: str) -> None:
    if name not in settings.accepted_names:
        raise APIError(404, f"the model {name!r} does not exist here; this server serves "
                            f"{', '.join(repr(n) for n in settings.served_names)}", code="model_not_found",
                       param="model")


# ---- generation: the four APIs ----------------------------------------------------------------------

async def generate(request: Request, schema: type[BaseModel], handler: Handler, api: str) -> Response:
    """One generation request: refused while loading or draining, then parsed, run, and counted."""
    state = state_of(request)
    outcome = "error"
    try:
        if not state.ready:
            raise APIError(503, "the model is still loading" if not state.draining else "the server is shutting down")
        body = parse(schema, await read_json(request, state.settings.body_limit_bytes))
        check_model(state.settings, body.model)
        result = await until_disconnect(request, handler(state.generation, body))
        outcome = "ok"
    finally:
        state.metrics.requests.labels(api=api, outcome=outcome).inc()
    if isinstance(result, dict):
        return JSONResponse(result)
    return SSEResponse(result, family_for_path(request.url.path))


def generation_endpoint(schema: type[BaseModel], handler: Handler, api: str) -> Endpoint:
    async def endpoint(request: Request) -> Response:
        return await generate(request, schema, handler, api)

    endpoint.__name__ = api
    return endpoint


chat_completions = generation_endpoint(ChatCompletionRequest, openai_chat.create, "chat_completions")
completions = generation_endpoint(CompletionRequest, openai_completions.create, "completions")
responses = generation_endpoint(ResponsesRequest, openai_responses.create, "responses")
messages = generation_endpoint(AnthropicMessagesRequest, anthropic_messages.create, "messages")
count_tokens = generation_endpoint(AnthropicCountTokensRequest, anthropic_messages.count_tokens, "count_tokens")


# ---- the tokenizer, as vLLM serves it ------------------------------------------------------------------

async def tokenize(request: Request) -> JSONResponse:
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
    state = state_of(request)
    settings, generation = state.settings, state.generation
    body = parse(TokenizeRequest, await read_json(request, settings.body_limit_bytes))
    if body.model is not None:
        check_model(settings, body.model)
    if body.messages is not None:
        tokens = await generation.off_loop(openai_chat.prompt_ids, generation, ChatCompletionRequest(
            model=body.model or settings.canonical_id, messages=body.messages,
            add_generation_prompt=body.add_generation_prompt))
    elif body.prompt is not None:
        tokens = await generation.off_loop(generation.frontend.encode, body.prompt, body.add_special_tokens)
    else:
        raise bad_request("send `prompt` or `messages`")
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": settings.max_model_len})


async def detokenize(request: Request) -> JSONResponse:
    state = state_of(request)
    body = parse(DetokenizeRequest, await read_json(request, state.settings.body_limit_bytes))
    if body.model is not None:
        check_model(state.settings, body.model)
    generation = state.generation
    check_token_ids(generation.frontend, body.tokens, "tokens")
    return JSONResponse({"prompt": await generation.off_loop(generation.frontend.decode, body.tokens)})


# ---- models ----------------------------------------------------------------------------------------------

def model_cards(settings: ServerSettings, anthropic: bool) -> list[dict]:
    if anthropic:
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(settings.created))
        return [{"type": "model", "id": name, "display_name": name, "created_at": created}
                for name in settings.served_names]
    return [{"id": name, "object": "model", "created": settings.created, "owned_by": "flare",
             "root": settings.canonical_id, "parent": None, "max_model_len": settings.max_model_len}
            for name in settings.served_names]


async def list_models(request: Request) -> JSONResponse:
    settings = state_of(request).settings
    if "anthropic-version" in request.headers:       # the Anthropic SDK's models.list()
        cards = model_cards(settings, anthropic=True)
        return JSONResponse({"data": cards, "has_more": False, "first_id": cards[0]["id"],
                             "last_id": cards[-1]["id"]})
    return JSONResponse({"object": "list", "data": model_cards(settings, anthropic=False)})


async def get_model(request: Request) -> JSONResponse:
    settings, name = state_of(request).settings, request.path_params["name"]
    anthropic = "anthropic-version" in request.headers
    cards = {card["id"]: card for card in model_cards(settings, anthropic)}
    if name == settings.canonical_id and name not in cards:
        cards[name] = {**next(iter(cards.values())), "id": name}
        if anthropic:
            cards[name]["display_name"] = name
    if name not in cards:
        raise APIError(404, f"the model {name!r} does not exist here", code="model_not_found")
    return JSONResponse(cards[name])


# ---- operations ------------------------------------------------------------------------------------------

async def version(request: Request) -> JSONResponse:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return JSONResponse({"version": installed("ignition")})
    except PackageNotFoundError:            # running from a source checkout
        return JSONResponse({"version": "source"})


async def health(request: Request) -> JSONResponse:
    state = state_of(request)
    if not state.ready:
        return JSONResponse({"status": "shutting down" if state.draining else "loading"}, status_code=503)
    dead = state.engine.dead_reason
    if dead:
        return JSONResponse({"status": "engine failed", "message": f"{public_reason(dead)}; restart the server"},
                            status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    return Response(state_of(request).metrics.render(), media_type=CONTENT_TYPE)


async def engine_stats(request: Request) -> JSONResponse:
    """The engine's own numbers, including its KV page integrity check (for operators and tests)."""
    import dataclasses

    stats = state_of(request).engine_stats()
    return JSONResponse(dataclasses.asdict(stats) if stats is not None else {})
