"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

One table for the router and the worker. `type` names the error class the OpenAI SDK raises
for that status (BadRequestError, AuthenticationError, NotFoundError, RateLimitError,
InternalServerError: the names vLLM's server puts in `type`), in the snake_case of OpenAI's
own API; `code` is the machine-readable detail (`model_not_found`, `context_length_exceeded`).
Every failure a client can cause is raised as `APIError` before a response starts; the
handlers installed here turn it, FastAPI's own validation and HTTP errors, and anything
unexpected into that shape, so a client never sees a traceback or `{"detail": ...}`.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

log = logging.getLogger("pdserve.protocol")

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


def error_type(status: int) -> str:
    return TYPES.get(status, "internal_server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


class APIError(Exception):
    """Raised anywhere on a request path; becomes an OpenAI error response (or SSE event)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> Response:
        return Response(json.dumps(self.body()), status_code=self.status, headers=self.headers,
                        media_type="application/json")

    def sse_event(self) -> bytes:
        """The one error event of a stream that broke after its 200 went out, then [DONE]."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\ndata: [DONE]\n\n"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def from_validation_error(e: ValidationError | RequestValidationError) -> APIError:
    """The first pydantic complaint, with its field path as `param` (e.g. `messages.0.role`)."""
    err = e.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    named = param is None or msg.startswith(param)  # a custom error that names its field already
    return bad_request(msg if named else f"{param}: {msg}", param)


class UpstreamError(APIError):
    """A worker's own error answer, handed to the client unchanged when it is OpenAI-shaped."""

    def __init__(self, status: int, content: bytes):
        super().__init__(status, f"worker answered {status}: {content[:500].decode(errors='replace')}")
        self.content = content

    def response(self) -> Response:
        try:
            body = json.loads(self.content)
            if isinstance(body, dict) and isinstance(body.get("error"), dict):
                return Response(self.content, status_code=self.status, media_type="application/json")
        except ValueError:
            pass
        return super().response()


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        return from_validation_error(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return APIError(e.status_code, str(e.detail), code=code).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):
        log.exception("unhandled error")
        return APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error").response()
