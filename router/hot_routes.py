"""The generation routes' way in, past the framework's middleware stack.

Every request through FastAPI crosses its middleware layers (server errors, body limit,
exception handlers, CORS, the exit stack, the router's route matching) and every chunk of a
stream crosses their `send` wrappers: on the router's hot path that was a sizeable share of its
CPU per request. The generation routes' handlers already answer every error themselves in
OpenAI's shape (router/app.py `serve`), so a POST to one of them goes straight to its handler.

What the stack would still have done is done here: without an `Origin` header, CORS only adds
`Vary: Origin` (so added here); a request with one (a browser's) takes the whole stack, CORS
headers and all. Everything else (probes, /metrics, preflights, docs) is FastAPI's as before.

The same handlers serve pdserve's own HTTP path (protocol/native_http.py, `native_routes`),
which takes the plain requests off uvicorn's ASGI cycle altogether: a handler reads its request
as an `Incoming` (protocol/incoming.py) whichever way it came.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pdserve.protocol.incoming import Incoming
from pdserve.protocol.native_http import NativeRoutes
from pdserve.protocol.response_headers import set_header

Handler = Callable[[Incoming], Awaitable[Response]]

# What CORSMiddleware adds to an answer to a request without `Origin`.
_NO_ORIGIN = ((b"vary", b"Origin"),)


class HotRoutesApp(FastAPI):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._hot: dict[str, Handler] = {}

    def hot_post(self, path: str, handler: Handler, name: str) -> None:
        """`handler` answers POST `path` (it must answer every error itself); also registered as
        an ordinary route named `name`, for requests that take the whole stack and for the
        OpenAPI schema."""
        self._hot[path] = handler

        async def endpoint(request: Request) -> Response:
            return await handler(Incoming.of_asgi(request.scope, request.receive))

        endpoint.__name__ = endpoint.__qualname__ = name  # the schema's operation id
        self.add_api_route(path, endpoint, methods=["POST"])

    def native_routes(self, max_body_bytes: int, body_timeout_s: float) -> NativeRoutes:
        """The hot routes for pdserve's own HTTP path: what this app answers a request without
        `Origin`, `Vary: Origin` included."""
        return NativeRoutes(dict(self._hot), max_body_bytes, body_timeout_s, headers=_NO_ORIGIN)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self._hot.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is not None:
            for name, _ in scope["headers"]:  # a loop, not any(genexpr): no generator per request
                if name == b"origin":
                    handler = None
                    break
        if handler is None:
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        response = await handler(Incoming.of_asgi(scope, receive))
        for name, value in _NO_ORIGIN:  # as CORSMiddleware adds to an answer without Origin
            set_header(response, name, value)
        await response(scope, receive, send)
