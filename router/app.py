"""The router's HTTP surface: OpenAI routes, health, readiness, metrics.

Every check that can fail (auth, body size, content type, JSON, model) runs before a response
starts; errors use OpenAI's shape. The lifespan owns the one pooled aiohttp session and the
background tasks (probes, discovery, KV-event subscriptions).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from typing import Awaitable

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from pdserve.router.config import RouterConfig
from pdserve.router.discovery import make_discovery
from pdserve.router.errors import RouterError
from pdserve.router.kv_index import KVIndex
from pdserve.router.kv_subscriptions import KVSubscriptions
from pdserve.router.metrics import RouterMetrics
from pdserve.router.orchestrator import Call, Orchestrator
from pdserve.router.policies import PolicyContext, RoutingRequest, create
from pdserve.router.policies.session_affinity import HEADER as SESSION_HEADER
from pdserve.router.prober import Prober
from pdserve.router.upstream import Upstream, make_session
from pdserve.router.workers import WorkerSet

log = logging.getLogger("pdserve.router")


class ClientGone(Exception):
    pass


async def _until_disconnect(request: Request, work: Awaitable):
    """Run `work`, cancelling it if the client goes away first (so upstream calls are closed
    and the workers abort). Only used before a response starts; Starlette's StreamingResponse
    does the same for streams."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        watcher.cancel()
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RouterError(413, f"request body is {declared} bytes; the limit is {limit}", code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RouterError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def build_app(config: RouterConfig) -> FastAPI:
    metrics = RouterMetrics()
    workers = WorkerSet(config.eject_after_failures, config.eject_backoff_s, config.eject_backoff_max_s)
    wants_index = "prefix-aware" in (config.prefill_policy, config.decode_policy)
    kv_index = KVIndex() if wants_index else None
    tokenizer = None
    if wants_index:
        from pdserve.router.prompt import PromptTokenizer

        tokenizer = PromptTokenizer(config.tokenizer)
    ctx = PolicyContext(kv_index=kv_index)
    api_keys = [k.encode() for k in config.api_keys]

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async with make_session(config.max_connections) as session:
            upstream = Upstream(session, workers, metrics)
            app.state.orchestrator = Orchestrator(config, upstream, create(config.prefill_policy, ctx),
                                                  create(config.decode_policy, ctx))
            prober = Prober(workers, session, config.probe_interval_s, config.connect_timeout_s)
            discovery = make_discovery(config)
            workers.update(await discovery.snapshot())
            await prober.probe_all()  # so /ready and model checks are right from the first request
            tasks = [asyncio.create_task(prober.run(), name="prober"),
                     asyncio.create_task(discovery.follow(workers), name="discovery")]
            subs = KVSubscriptions(kv_index, workers, config, metrics) if kv_index is not None else None
            if subs is not None:
                tasks.append(asyncio.create_task(subs.run(), name="kv-events"))
            app.state.kv_subscriptions = subs
            try:
                yield
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                if subs is not None:
                    subs.close()

    app = FastAPI(title="pdserve router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.config = config
    app.state.workers = workers
    app.state.metrics = metrics
    app.state.kv_index = kv_index

    @app.exception_handler(RouterError)
    async def _router_error(request: Request, exc: RouterError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return RouterError(exc.status_code, str(exc.detail)).response()

    def authorize(request: Request) -> None:
        if not api_keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(token.encode(), k) for k in api_keys):
            raise RouterError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")

    async def parse(request: Request, route: str) -> Call:
        authorize(request)
        ctype = request.headers.get("content-type", "")
        if ctype.split(";")[0].strip().lower() != "application/json":
            raise RouterError(415, f"Content-Type must be application/json, not {ctype or 'missing'!r}")
        raw = await _read_body(request, config.max_body_bytes)
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise RouterError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise RouterError(400, "request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise RouterError(400, "'model' is required and must be a string", param="model")
        required = "messages" if route == "chat" else "prompt"
        if required not in body:
            raise RouterError(400, f"'{required}' is required", param=required)
        if not isinstance(body.get("stream", False), bool):
            raise RouterError(400, "'stream' must be a boolean", param="stream")
        served = workers.models()
        if not served:
            raise RouterError(503, "no worker is ready yet", code="no_workers")
        if model not in served:
            raise RouterError(404, f"model {model!r} is not served here (serving: {', '.join(sorted(served))})",
                              param="model", code="model_not_found")
        if "kv_transfer_params" in body:  # only the router may steer KV transfer
            del body["kv_transfer_params"]
            raw = json.dumps(body).encode()
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        routing = RoutingRequest(body, request.headers.get(SESSION_HEADER), tokenizer)
        return Call(route, body, raw, request_id, routing, started=time.monotonic())

    async def serve(request: Request, route: str) -> Response:
        started = time.monotonic()
        try:
            call = await parse(request, route)
            return await _until_disconnect(request, app.state.orchestrator.handle(call))
        except RouterError as e:
            metrics.requests.labels(route, str(e.status), "no").inc()
            metrics.e2e.observe(time.monotonic() - started)
            return e.response()
        except ClientGone:
            metrics.requests.labels(route, "499", "no").inc()
            return Response(status_code=499)
        except Exception:  # a bug of ours still answers in OpenAI's shape, and is logged
            log.exception("unexpected error on %s", route)
            metrics.requests.labels(route, "500", "no").inc()
            return RouterError(500, "internal router error", code="internal_error").response()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await serve(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, "completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authorize(request)
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "pdserve"} for m in sorted(workers.models())]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        n = len(workers.pool("decode"))
        if n == 0:
            return RouterError(503, "no healthy decode worker", code="no_workers").response()
        return JSONResponse({"status": "ready", "decode_workers": n, "prefill_workers": len(workers.pool("prefill"))})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
