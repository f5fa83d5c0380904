"""Request bodies: read within the size limit, parsed as JSON, validated against the route's schema."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ValidationError

from flare.server.errors import APIError, bad_request


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
