"""The server's errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, whatever
failed: the body (:func:`invalid_request`, :func:`too_large`), the route (404, 405), a generation that
ended early (:func:`ended_early`) or a bug (500 without a trace); :func:`install_error_handlers` makes
an app answer every one of them so."""
from __future__ import annotations

import logging
import os
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from genspec.serve.protocol import APIError


def too_large(max_bytes: int) -> APIError:
    return APIError(f"the request body is larger than this server accepts ({max_bytes} bytes)", status=413,
                    code="request_too_large")


def invalid_request(errors: list[dict]) -> APIError:
    """The 400 of a request pydantic refused, about the field of its first error: ``param`` names it (none
    for a body that is not JSON: no field is to blame). A field of several types (``prompt``, ``stop``)
    has an error per type, each at the field's location followed by the type's name: the field is their
    common part, and the message that of the type that got furthest."""
    if not errors:
        return APIError("invalid request")
    if errors[0].get("type") == "json_invalid":
        return APIError(f"the request body is not valid JSON: {errors[0]['msg'].removeprefix('Invalid JSON: ')}")
    locs = [[part for part in error.get("loc", ()) if part != "body"] for error in errors]
    if errors[0].get("type") == "extra_forbidden":  # OpenAI's own words for a field it does not know
        where = ".".join(str(part) for part in locs[0])
        return APIError(f"Unrecognized request argument supplied: {where}", param=where or None,
                        code="unknown_parameter")
    field = [(loc, error) for loc, error in zip(locs, errors) if loc[:1] == locs[0][:1]]
    where = ".".join(str(part) for part in os.path.commonprefix([loc for loc, _ in field]))
    message = max(field, key=lambda pair: len(pair[0]))[1].get("msg", "invalid")
    return APIError(f"{where}: {message}" if where else message, param=where or None)


def ended_early(finish_reason: str | None, error: str | None) -> APIError | None:
    """The error a choice that did not finish normally ends its response with: its own failure, or the
    server's shutdown (a request still running when a drain's grace period ran out is cancelled: no
    OpenAI client knows a finish reason "cancelled")."""
    if finish_reason == "error":
        return APIError(f"generation failed: {error}", status=500, kind="server_error")
    if finish_reason == "cancelled":
        return APIError("the server shut down before this request finished (its grace period for requests in "
                        "flight ran out); send it again", status=503, kind="server_error", code="shutting_down")
    return None


def install_error_handlers(app: FastAPI, on_invalid: Callable[[], None]) -> None:
    """Make ``app`` answer every error with an OpenAI error body: :class:`APIError` as itself, a request
    FastAPI's validation refused as a 400 (``on_invalid`` counts it), routing's own 404 and 405, and any
    other exception (a bug) as a 500 whose traceback goes to the log, not to the client."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        logging.getLogger("genspec.serve").exception("request failed")
        return JSONResponse(APIError(f"internal error: {type(exc).__name__}", status=500, kind="server_error").body(),
                            status_code=500)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        on_invalid()
        return JSONResponse(invalid_request(list(exc.errors())).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # routing's own: 404, 405
        route = f"{request.method} {request.url.path}"
        message = {404: f"Invalid URL ({route})", 405: f"Method not allowed ({route})"}.get(exc.status_code,
                                                                                         f"{exc.detail} ({route})")
        return JSONResponse(APIError(message, status=exc.status_code).body(), status_code=exc.status_code,
                            headers=exc.headers)
