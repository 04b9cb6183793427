"""The OpenAI error envelope, and handlers so that no input ever produces a 422 or a 500.

Every malformed or out-of-range input is a 400; unknown routes and models 404; wrong methods 405;
a missing or bad key 401; a body over --max-request-bytes 413; a full queue or a worker that is not
ready 503. Under /v1/messages (the Anthropic Messages API) the same errors come in Anthropic's envelope
`{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("dsv4serve.api")

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestTooLargeError",
    503: "ServiceUnavailableError",
    500: "InternalServerError",
}


class APIError(Exception):
    """An error answered with the OpenAI envelope and `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code if code is not None else status}}


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


ANTHROPIC_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def error_response_for(
    path: str,
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict | None = None,
) -> JSONResponse:
    """The error in the envelope of the API that `path` belongs to."""
    if is_anthropic(path):
        return JSONResponse(anthropic_error_body(status, message), status_code=status, headers=headers)
    return error_response(status, message, param, code, headers)


def describe_validation(errors: list) -> tuple[str, str | None]:
    """One readable line for pydantic errors, and the top-level field it is about."""
    parts, param = [], None
    for err in errors[:3]:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body",)]
        where = ".".join(loc) or "body"
        param = param or (loc[0] if loc else None)
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response_for(request.url.path, exc.status, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError):
        message, param = describe_validation(list(exc.errors()))
        return error_response_for(request.url.path, 400, message, param)

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, exc: ValidationError):
        message, param = describe_validation(list(exc.errors()))
        return error_response_for(request.url.path, 400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        status = exc.status_code
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(status).phrase
        if status == 404 and message == "Not Found":
            message = "the route does not exist"
        if status == 422:  # never 422: every malformed input is a 400
            status = 400
        return error_response_for(request.url.path, status, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):  # last resort; a bug, logged with its trace
        log.exception("unexpected error: %s", exc)
        return error_response_for(request.url.path, 500, f"internal error: {type(exc).__name__}")
