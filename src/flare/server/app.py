"""The HTTP application: a table of routes, a table of exception handlers, and the auth middleware.

`build_app(engine, frontend, settings)` is all a caller needs. The engine is a
`flare.engine_client.EngineClient`; `frontend` is a `ServingFrontend`; `settings` a `ServerSettings`.
A new route is a row of `ROUTES` (its endpoint in `flare.server.routes`, or its own module); a new error
answer is a row of `EXCEPTION_HANDLERS`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from flare.engine.stats import EngineStats
from flare.engine_client.protocol import EngineClient
from flare.server import error_handlers, openapi, routes
from flare.server.auth import PUBLIC_PATHS, is_authorized
from flare.server.errors import APIError, error_body, family_for_path
from flare.server.frontend import ServingFrontend
from flare.server.generation import Generation
from flare.server.metrics import ServerMetrics
from flare.server.settings import ServerSettings


class ServingState:
    """What the routes share. `ready` is false while loading and once draining begins (then /health is 503)."""

    def __init__(self, engine: EngineClient | None, frontend: ServingFrontend | None,
                 settings: ServerSettings) -> None:
        self.settings = settings
        self.metrics = ServerMetrics(self.engine_stats)
        self.generation = Generation(engine, frontend, settings, self.metrics)
        self.ready = engine is not None
        self.draining = False

    @property
    def engine(self) -> EngineClient | None:
        return self.generation.engine

    def attach_engine(self, engine: EngineClient, frontend: ServingFrontend) -> None:
        self.generation.engine = engine
        self.generation.frontend = frontend
        self.ready = True

    def engine_stats(self) -> EngineStats | None:
        """The engine's numbers as of its latest step; None while no engine is attached."""
        return self.engine.stats() if self.engine is not None else None


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


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    endpoint: routes.Endpoint
    options: dict = field(default_factory=dict)     # more of FastAPI's add_api_route (e.g. openapi_extra)


ROUTES = (
    Route("POST", "/v1/chat/completions", routes.chat_completions),
    Route("POST", "/v1/completions", routes.completions),
    Route("POST", "/v1/responses", routes.responses),
    Route("POST", "/v1/messages", routes.messages),
    Route("POST", "/v1/messages/count_tokens", routes.count_tokens),
    Route("POST", "/tokenize", routes.tokenize),
    Route("POST", "/detokenize", routes.detokenize),
    Route("GET", "/version", routes.version),
    Route("GET", "/v1/models", routes.list_models),
    Route("GET", "/v1/models/{name:path}", routes.get_model),
    Route("GET", "/health", routes.health),
    Route("GET", "/metrics", routes.metrics),
    Route("GET", "/v1/engine/stats", routes.engine_stats),
    Route("GET", openapi.PATH, openapi.endpoint),
)

EXCEPTION_HANDLERS = (
    (APIError, error_handlers.api_error),
    (StarletteHTTPException, error_handlers.http_error),
    (Exception, error_handlers.server_error),          # a bug: a 500 in the route's shape, not plain text
)


def build_app(engine: EngineClient | None, frontend: ServingFrontend | None, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="Flare", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = ServingState(engine, frontend, settings)
    for error_type, handler in EXCEPTION_HANDLERS:
        app.add_exception_handler(error_type, handler)
    app.add_middleware(AuthMiddleware, api_key=settings.api_key)
    for route in ROUTES:
        app.add_api_route(route.path, route.endpoint, methods=[route.method], **route.options)
    return app
