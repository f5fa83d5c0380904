"""The HTTP application: routes of the four APIs, auth, body limits, errors, health and metrics.

`build_app(engine, frontend, settings)` is all a caller needs. The engine is a
`flare.engine_client.EngineClient`; `frontend` is a `ServingFrontend`; `settings` a `ServerSettings`.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from flare.engine.core import EngineStats
from flare.server import (anthropic_messages, openai_chat, openai_completions, openai_responses, sse)
from flare.server.auth import PUBLIC_PATHS, is_authorized
from flare.server.errors import APIError, ApiFamily, bad_request, error_body, family_for_path
from flare.server.generation import Generation, check_token_ids
from flare.server.metrics import CONTENT_TYPE, ServerMetrics
from flare.server.schemas import (AnthropicCountTokensRequest, AnthropicMessagesRequest,
                                  ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ResponsesRequest,
                                  TokenizeRequest)
from flare.server.settings import ServerSettings


class ServingState:
    """What the routes share. `ready` is false while loading and once draining begins (then /health is 503)."""

    def __init__(self, engine: Any, frontend: Any, settings: ServerSettings) -> None:
        self.settings = settings
        self.metrics = ServerMetrics(self.engine_stats)
        self.generation = Generation(engine, frontend, settings, self.metrics)
        self.ready = engine is not None
        self.draining = False

    @property
    def engine(self) -> Any:
        return self.generation.engine

    def attach_engine(self, engine: Any, frontend: Any) -> None:
        self.generation.engine = engine
        self.generation.frontend = frontend
        self.ready = True

    def engine_stats(self) -> EngineStats | None:
        """The engine's numbers as of its latest step; None while no engine is attached."""
        return self.engine.stats() if self.engine is not None else None


class SSEResponse(StreamingResponse):
    """Streams events, and on a client disconnect closes the event source at once (which aborts the engine
    request and frees its pages) instead of waiting for the next write to fail."""

    media_type = sse.MEDIA_TYPE

    def __init__(self, events: AsyncIterator[str], family: ApiFamily) -> None:
        super().__init__(events, status_code=200, headers=sse.SSE_HEADERS, media_type=sse.MEDIA_TYPE)
        self.events = events
        self.family = family

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        writer = asyncio.ensure_future(self._write(send))
        listener = asyncio.ensure_future(self._wait_for_disconnect(receive))
        try:
            await asyncio.wait({writer, listener}, return_when=asyncio.FIRST_COMPLETED)
            failure = writer.exception() if writer.done() and not writer.cancelled() else None
            if failure is not None and not isinstance(failure, OSError):     # OSError: the client left
                raise failure
        finally:
            for task in (writer, listener):
                task.cancel()
            await asyncio.gather(writer, listener, return_exceptions=True)
            await self.events.aclose()

    @staticmethod
    async def _wait_for_disconnect(receive: Receive) -> None:
        while True:
            if (await receive())["type"] == "http.disconnect":
                return

    async def _write(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for event in self._events_or_error():
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _events_or_error(self) -> AsyncIterator[str]:
        """The events; a failure after the headers went out ends the stream with an error event."""
        try:
            async for event in self.events:
                yield event
        except APIError as error:
            yield self._error_event(error)
        except Exception as error:              # a bug: still end the stream in the API's own terms
            yield self._error_event(APIError(500, f"the server failed while streaming: "
                                                  f"{type(error).__name__}: {error}"))

    def _error_event(self, error: APIError) -> str:
        body = error_body(error, self.family)
        return sse.named_event(body) if self.family == "anthropic" else sse.data_event(body)


class AuthMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which hides client disconnects from streaming routes)."""

    def __init__(self, app: Any, api_key: str | None) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS and self.api_key:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            if not is_authorized(self.api_key, headers):
                error = APIError(401, "a valid API key is required: send it as `Authorization: Bearer KEY` "
                                      "or `x-api-key: KEY`", code="invalid_api_key")
                response = JSONResponse(error_body(error, family_for_path(scope["path"])), status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_message(error: ValidationError) -> str:
    problems = []
    for problem in error.errors()[:5]:
        where = ".".join(str(part) for part in problem["loc"]) or "body"
        problems.append(f"{where}: {problem['msg']}")
    return "invalid request: " + "; ".join(problems)


async def read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {int(declared):,} bytes; the limit is {limit:,} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > limit:
            raise APIError(413, f"the request body is over the limit of {limit:,} bytes")
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise bad_request(f"the request body is not valid JSON: {error}") from None


def parse(schema: type[BaseModel], data: Any) -> BaseModel:
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        raise bad_request(_validation_message(error)) from None


async def _until_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`, cancelling it (and so aborting its engine requests) if the client goes away first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise APIError(499, "the client closed the connection")
    return task.result()


def build_app(engine: Any, frontend: Any, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="Flare", docs_url=None, redoc_url=None, openapi_url=None)
    state = ServingState(engine, frontend, settings)
    app.state.serving = state

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error_body(error, family_for_path(request.url.path)), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        """Unknown routes and methods, answered in the caller's API shape too."""
        message = (f"{request.method} {request.url.path} is not served here" if error.status_code in (404, 405)
                   else str(error.detail))
        body = error_body(APIError(error.status_code, message), family_for_path(request.url.path))
        return JSONResponse(body, status_code=error.status_code)

    app.add_middleware(AuthMiddleware, api_key=settings.api_key)

    def check_model(name: str, family: ApiFamily) -> None:
        if name not in settings.accepted_names:
            raise APIError(404, f"the model {name!r} does not exist here; this server serves "
                                f"{', '.join(repr(n) for n in settings.served_names)}", code="model_not_found",
                           param="model")

    async def serve(request: Request, schema: type[BaseModel],
                    handler: Callable[[Generation, Any], Awaitable[Any]], api: str) -> Response:
        family = family_for_path(request.url.path)
        outcome = "error"
        try:
            if not state.ready:
                raise APIError(503, "the model is still loading" if not state.draining
                               else "the server is shutting down")
            body = parse(schema, await read_json(request, settings.body_limit_bytes))
            check_model(body.model, family)
            result = await _until_disconnect(request, handler(state.generation, body))
            outcome = "ok"
        finally:
            state.metrics.requests.labels(api=api, outcome=outcome).inc()
        if isinstance(result, dict):
            return JSONResponse(result)
        return SSEResponse(result, family)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, ChatCompletionRequest, openai_chat.create, "chat_completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, CompletionRequest, openai_completions.create, "completions")

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await serve(request, ResponsesRequest, openai_responses.create, "responses")

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await serve(request, AnthropicMessagesRequest, anthropic_messages.create, "messages")

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        async def handler(gen: Generation, body: AnthropicCountTokensRequest) -> dict:
            return anthropic_messages.count_tokens(gen, body)
        return await serve(request, AnthropicCountTokensRequest, handler, "count_tokens")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
        body = parse(TokenizeRequest, await read_json(request, settings.body_limit_bytes))
        if body.model is not None:
            check_model(body.model, "openai")
        frontend = state.generation.frontend
        if body.messages is not None:
            tokens = openai_chat.prompt_ids(state.generation, ChatCompletionRequest(
                model=body.model or settings.canonical_id, messages=body.messages,
                add_generation_prompt=body.add_generation_prompt))
        elif body.prompt is not None:
            tokens = frontend.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise bad_request("send `prompt` or `messages`")
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": settings.max_model_len})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body = parse(DetokenizeRequest, await read_json(request, settings.body_limit_bytes))
        if body.model is not None:
            check_model(body.model, "openai")
        check_token_ids(state.generation.frontend, body.tokens, "tokens")
        return JSONResponse({"prompt": state.generation.frontend.decode(body.tokens)})

    @app.get("/version")
    async def version() -> JSONResponse:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as installed

        try:
            return JSONResponse({"version": installed("ignition")})
        except PackageNotFoundError:            # running from a source checkout
            return JSONResponse({"version": "source"})

    def model_cards(anthropic: bool) -> list[dict]:
        if anthropic:
            created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(settings.created))
            return [{"type": "model", "id": name, "display_name": name, "created_at": created}
                    for name in settings.served_names]
        return [{"id": name, "object": "model", "created": settings.created, "owned_by": "flare",
                 "root": settings.canonical_id, "parent": None, "max_model_len": settings.max_model_len}
                for name in settings.served_names]

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        if "anthropic-version" in request.headers:       # the Anthropic SDK's models.list()
            cards = model_cards(anthropic=True)
            return JSONResponse({"data": cards, "has_more": False, "first_id": cards[0]["id"],
                                 "last_id": cards[-1]["id"]})
        return JSONResponse({"object": "list", "data": model_cards(anthropic=False)})

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, request: Request) -> JSONResponse:
        anthropic = "anthropic-version" in request.headers
        cards = {card["id"]: card for card in model_cards(anthropic)}
        if name == settings.canonical_id and name not in cards:
            cards[name] = {**next(iter(cards.values())), "id": name}
            if anthropic:
                cards[name]["display_name"] = name
        if name not in cards:
            raise APIError(404, f"the model {name!r} does not exist here", code="model_not_found")
        return JSONResponse(cards[name])

    @app.get("/health")
    async def health() -> Response:
        if not state.ready:
            reason = "shutting down" if state.draining else "loading"
            return JSONResponse({"status": reason}, status_code=503)
        dead = getattr(state.engine, "dead_reason", None)
        if dead:
            return JSONResponse({"status": "engine failed", "message": f"{dead}; restart the server"},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/engine/stats")
    async def engine_stats() -> JSONResponse:
        """The engine's own numbers, including its KV page integrity check (for operators and tests)."""
        return JSONResponse(_jsonable(state.engine_stats()))

    return app


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        return {name: _jsonable(getattr(value, name)) for name in value.__dataclass_fields__}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
