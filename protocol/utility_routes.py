"""The small routes vLLM's server has beside the OpenAI ones, the same on the router and the
worker: `/version`, `/ping`, FastAPI's `/docs`, `/redoc` and `/openapi.json`, and an honest
answer on `/v1/embeddings` (these models are generative: a 400 saying so, not "Not Found").

Which need the API key: `/version`, `/ping`, `/health` and the docs stay open, as on vLLM
(probes carry no key; the docs describe routes, not data, and the browser fetching them sends
none). Everything that reaches a model or shows state keeps needing it (`/v1/*`, `/tokenize`,
`/detokenize`, `/metrics`, `/debug/*`), unlike vLLM, whose key covers `/v1/*` only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import metadata

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from pdserve.protocol.auth import authorize
from pdserve.protocol.errors import bad_request

# FastAPI's own defaults, as vLLM keeps them.
DOCS = {"docs_url": "/docs", "redoc_url": "/redoc", "openapi_url": "/openapi.json"}


def version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def install(app: FastAPI, api_keys: tuple[bytes, ...], ping: Callable[[], Awaitable[Response]]) -> None:
    """`ping`: what /ping answers, the component's liveness (vLLM's /ping is its /health)."""
    pdserve_version = version()

    @app.get("/version")
    async def get_version() -> Response:
        return JSONResponse({"version": pdserve_version})

    @app.api_route("/ping", methods=["GET", "POST"])
    async def get_ping() -> Response:
        return await ping()

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        authorize(request, api_keys)
        raise bad_request("this model is generative; embeddings are not supported (pdserve serves "
                          "completions, chat and responses)", "model", "model_not_supported")
