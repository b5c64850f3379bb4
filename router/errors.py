"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

import json

from starlette.responses import Response

# status -> OpenAI error type, as OpenAI's and vLLM's servers name them.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class RouterError(Exception):
    """Raised anywhere on the request path; the app turns it into an OpenAI error response."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(json.dumps(self.body()), status_code=self.status, media_type="application/json")

    def sse_event(self) -> bytes:
        """The one error event sent when a stream breaks after its 200 went out, then [DONE]."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\ndata: [DONE]\n\n"


def upstream_error_response(status: int, content: bytes) -> Response:
    """Pass a worker's own 4xx through unchanged when it is already OpenAI-shaped."""
    try:
        body = json.loads(content)
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return Response(content, status_code=status, media_type="application/json")
    except ValueError:
        pass
    text = content.decode(errors="replace")[:500]
    return RouterError(status, f"worker answered {status}: {text}").response()
