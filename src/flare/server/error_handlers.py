"""Every failure answers in the caller's API shape (OpenAI or Anthropic, by route), never as plain text,
and no traceback or local path reaches a client: unexpected exceptions are logged here, on the server,
and the client is told only their type. `flare.server.app.EXCEPTION_HANDLERS` lists these handlers.
"""

from __future__ import annotations

import json
import logging

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from flare.server.errors import APIError, error_body, family_for_path

# uvicorn's error log: what `flare run` prints on its stderr.
log = logging.getLogger("uvicorn.error")


class ErrorResponse(JSONResponse):
    """JSON as ASCII: an error that quotes a client's text can never fail to encode."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


def error_response(error: APIError, path: str) -> ErrorResponse:
    return ErrorResponse(error_body(error, family_for_path(path)), status_code=error.status)


def unexpected(error: BaseException, while_doing: str) -> APIError:
    """A bug's exception as the 500 a client sees; its traceback goes to the server's log."""
    log.error("the server failed %s", while_doing, exc_info=error)
    return APIError(500, f"the server failed {while_doing} ({type(error).__name__}); the server's log has "
                         f"the details")


async def api_error(request: Request, error: APIError) -> JSONResponse:
    return error_response(error, request.url.path)


async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    """Unknown routes and methods, answered in the caller's API shape too."""
    message = (f"{request.method} {request.url.path} is not served here" if error.status_code in (404, 405)
               else str(error.detail))
    return error_response(APIError(error.status_code, message), request.url.path)


async def server_error(request: Request, error: Exception) -> JSONResponse:
    """A bug. Starlette re-raises it after this answer, and uvicorn logs its traceback."""
    return error_response(APIError(500, f"the server failed this request ({type(error).__name__}); the server's "
                                        f"log has the details"), request.url.path)
