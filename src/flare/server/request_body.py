"""A request body from bytes to a validated schema, refusing with a 400 (or 413) whatever the routes
and the engine must never see: malformed JSON, non-finite or out-of-range numbers, nesting deeper than
`MAX_JSON_DEPTH`, lone UTF-16 surrogates (which no tokenizer can encode), and fields that fail the schema.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from flare.server.errors import APIError, bad_request
from flare.server.limits import MAX_JSON_DEPTH

# Bodies at least this large are parsed in a worker thread, so the event loop keeps serving meanwhile.
_THREAD_PARSE_BYTES = 256 << 10
# A \uD800-\uDFFF escape: the only way JSON text can carry a surrogate (decoded UTF-8 never does).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


async def read_json(request: Request, limit: int) -> Any:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {int(declared):,} bytes; the limit is {limit:,} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > limit:
            raise APIError(413, f"the request body is over the limit of {limit:,} bytes")
    if len(body) >= _THREAD_PARSE_BYTES:
        return await asyncio.to_thread(decode_json, bytes(body))
    return decode_json(bytes(body))


def decode_json(body: bytes) -> Any:
    """The body as JSON values, checked as the module's docstring says."""
    try:
        data = json.loads(body, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise bad_request(f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise bad_request(f"the request body nests JSON too deeply; the limit is {MAX_JSON_DEPTH} levels") from None
    except ValueError as error:                  # an integer of more digits than Python converts
        raise bad_request(f"the request body has a number out of range: {error}") from None
    _check_values(data, check_strings=_SURROGATE_ESCAPE.search(body) is not None)
    return data


def _refuse_constant(name: str) -> float:
    raise bad_request(f"the request body has the number {name}; JSON numbers must be finite")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise bad_request(f"the request body has the number {text}, which is out of range of a 64-bit float")
    return value


def _check_values(data: Any, check_strings: bool) -> None:
    """Depth of nesting, and (when the body had surrogate escapes) that every string is valid Unicode."""
    pending = [(data, 1, "")]
    while pending:
        value, depth, where = pending.pop()
        if isinstance(value, dict):
            items = value.items()
        elif isinstance(value, list):
            items = enumerate(value)
        else:
            if check_strings and isinstance(value, str):
                _check_text(value, where)
            continue
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"the request body nests JSON more than {MAX_JSON_DEPTH} levels deep (at "
                              f"{where or 'the top'}); the limit is {MAX_JSON_DEPTH} levels")
        for key, item in items:
            place = f"{where}.{key}" if where else str(key)
            if check_strings and isinstance(key, str):
                _check_text(key, place)
            pending.append((item, depth + 1, place))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        where = where.encode("utf-8", "backslashreplace").decode()      # the place may be a key with one too
        raise bad_request(f"the text at {where} has a lone UTF-16 surrogate ({text[error.start]!r}), which is not "
                          f"valid Unicode; send surrogate pairs only as pairs", param=where.split(".")[0]) from None


def parse(schema: type[BaseModel], data: Any) -> BaseModel:
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        problems = _problems(error)
        raise bad_request("invalid request: " + "; ".join(message for _, message in problems[:5]),
                          param=problems[0][0] if problems else None) from None


# Pydantic names each member of a union in an error's location ("stop.list[constrained-str]"); those
# tags are types, not fields, and a client wants the field.
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|[A-Z]\w*|[a-z]+-[\w-]+.*|\w+\[.*)$")


def _problems(error: ValidationError) -> list[tuple[str, str]]:
    """(top-level field, "where: what") per problem. A union reports every member's failure; where some of a
    field's failures are more than "not of this member's type", only those are kept."""
    found = []
    for problem in error.errors():
        parts = [str(part) for part in problem["loc"] if not (isinstance(part, str) and _TYPE_TAG.match(part))]
        where = ".".join(parts) or "body"
        kind = problem["type"]
        wrong_type = kind.endswith(("_type", "_parsing")) or kind in ("union_tag_invalid", "model_attributes_type")
        found.append((parts[0] if parts else None, f"{where}: {problem['msg']}", wrong_type))
    telling = {field for field, _, wrong_type in found if not wrong_type}
    problems = []
    for field, message, wrong_type in found:
        if wrong_type and field in telling:
            continue
        if (field, message) not in problems:
            problems.append((field, message))
    return problems
