"""GET /openapi.json: the OpenAPI 3.1 document of what this server serves, so clients and fuzzers can read
the contract. The request bodies are the schemas the routes validate with (`flare.server.schemas`, with
their caps), so the document cannot drift from what is enforced; `model` lists the names this server
accepts. Behind the API key like the model routes (it names the served models); FastAPI's own document and
docs pages stay off.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic.json_schema import models_json_schema

from flare.server import schemas
from flare.server.auth import PUBLIC_PATHS
from flare.server.settings import ServerSettings

PATH = "/openapi.json"
_REF = "#/components/schemas/{model}"

# (path, request schema, API family, summary); every one is a POST whose reply is JSON or, with
# "stream": true, server-sent events.
_GENERATION_ROUTES = (
    ("/v1/chat/completions", schemas.ChatCompletionRequest, "openai", "OpenAI Chat Completions"),
    ("/v1/completions", schemas.CompletionRequest, "openai", "OpenAI Completions"),
    ("/v1/responses", schemas.ResponsesRequest, "openai", "OpenAI Responses (stateless)"),
    ("/v1/messages", schemas.AnthropicMessagesRequest, "anthropic", "Anthropic Messages"),
    ("/v1/messages/count_tokens", schemas.AnthropicCountTokensRequest, "anthropic", "Anthropic token count"),
    ("/tokenize", schemas.TokenizeRequest, "openai", "vLLM's /tokenize: a prompt or chat messages to token ids"),
    ("/detokenize", schemas.DetokenizeRequest, "openai", "vLLM's /detokenize: token ids to text"),
)
_STREAMING = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})
_GETS = (
    ("/v1/models", "The served models (Anthropic's list shape when `anthropic-version` is sent)", "openai"),
    ("/v1/models/{name}", "One served model", "openai"),
    ("/health", "200 when serving; 503 while loading, draining, or after the engine failed", None),
    ("/metrics", "Prometheus metrics", None),
    ("/version", "The server's version", None),
    ("/v1/engine/stats", "The engine's numbers, including its KV page integrity check", "openai"),
    (PATH, "This document", "openai"),
)

_ERROR_SCHEMAS = {
    "OpenAIError": {
        "type": "object", "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}},
    "AnthropicError": {
        "type": "object", "required": ["type", "error"],
        "properties": {"type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"],
                                                              "properties": {"type": {"type": "string"},
                                                                             "message": {"type": "string"}}}}},
}
_ERROR_STATUSES = {"400": "The request is invalid (the message names the field and what to change)",
                   "401": "A valid API key is required", "404": "Unknown model or route",
                   "413": "The request body is over the size limit", "500": "The server failed",
                   "503": "The model is loading, the server is draining, or the engine stopped"}


async def endpoint(request: Request) -> JSONResponse:
    """The document, built once per app (it depends only on the settings)."""
    state = request.app.state
    if getattr(state, "openapi_document", None) is None:
        state.openapi_document = openapi_document(state.serving.settings)
    return JSONResponse(state.openapi_document)


def openapi_document(settings: ServerSettings) -> dict:
    references, definitions = models_json_schema(
        [(schema, "validation") for _, schema, _, _ in _GENERATION_ROUTES], ref_template=_REF)
    components = {**definitions.get("$defs", {}), **_ERROR_SCHEMAS}
    _name_the_models(components, settings)
    paths: dict[str, Any] = {}
    for path, schema, family, summary in _GENERATION_ROUTES:
        paths[path] = {"post": {
            "summary": summary, "operationId": _operation_id("post", path),
            "requestBody": {"required": True,
                            "content": {"application/json": {"schema": references[(schema, "validation")]}}},
            "responses": {"200": _success(path in _STREAMING), **_errors(family)}}}
    for path, summary, family in _GETS:
        operation: dict[str, Any] = {"summary": summary, "operationId": _operation_id("get", path),
                                     "responses": {"200": {"description": "OK"}, **_errors(family)}}
        if "{name}" in path:
            operation["parameters"] = [{"name": "name", "in": "path", "required": True,
                                        "schema": {"type": "string", "enum": sorted(settings.accepted_names)}}]
        if path in PUBLIC_PATHS:
            operation["security"] = []
        paths[path] = {"get": operation}
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "Flare", "version": _version(),
                 "description": "OpenAI (Chat Completions, Completions, Responses) and Anthropic Messages APIs."},
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}},
    }
    if settings.api_key:
        document["security"] = [{"bearer": []}, {"apiKey": []}]
    return document


def _name_the_models(components: dict, settings: ServerSettings) -> None:
    """`model` takes the names this server accepts (anything else is a 404)."""
    names = sorted(settings.accepted_names)
    for schema in components.values():
        field = schema.get("properties", {}).get("model")
        if field is None:
            continue
        if field.get("type") == "string":
            field["enum"] = names
        for choice in field.get("anyOf", ()):
            if choice.get("type") == "string":
                choice["enum"] = names


def _success(streams: bool) -> dict:
    content = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        content["text/event-stream"] = {"schema": {"type": "string", "description": "server-sent events"}}
    return {"description": "The API's response object" + (", or its events when `stream` is true" if streams else ""),
            "content": content}


def _errors(family: str | None) -> dict:
    if family is None:
        return {}
    reference = {"$ref": _REF.format(model="AnthropicError" if family == "anthropic" else "OpenAIError")}
    return {status: {"description": description, "content": {"application/json": {"schema": reference}}}
            for status, description in _ERROR_STATUSES.items()}


def _operation_id(method: str, path: str) -> str:
    return method + "".join(part.capitalize() for part in path.replace("{", "").replace("}", "").replace(
        ".", "_").replace("/", "_").split("_") if part)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ignition")
    except PackageNotFoundError:               # running from a source checkout
        return "source"
