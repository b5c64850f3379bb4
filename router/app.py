"""The router's HTTP surface: OpenAI routes, health, readiness, metrics.

With `--api-key`, everything but `/health`, `/ready`, `/ping` (probes, which carry no key),
`/version` and the docs (protocol/utility_routes.py) needs a key: the OpenAI routes,
`/v1/models`, `/tokenize`, `/detokenize`, `/metrics` and `/debug/workers`. CORS preflights are
answered before any of that (protocol/cors.py). Every call to a worker
carries the worker key (`--worker-api-key`, default the first client key): a keyed worker
takes `kv_transfer_params` only from whoever holds it.

Every check that can fail (auth, body size, content type, JSON, model) runs before a response
starts; errors use OpenAI's shape. The lifespan owns the pooled upstream clients (http1.py on the
generation path, aiohttp for the rest) and the background tasks (probes, discovery, KV-event
subscriptions).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import types

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from pdserve.protocol import cors, utility_routes
from pdserve.protocol.auth import authorize
from pdserve.protocol.body import parse_object
from pdserve.protocol.contract import (HEADER_REQUEST_ID, HEADER_SESSION_ID, ROLE_DECODE, ROLE_PREFILL,
                                       request_id_from)
from pdserve.protocol.disconnect import ClientGone, unless_disconnected
from pdserve.protocol.errors import APIError, install_handlers
from pdserve.protocol.incoming import Incoming
from pdserve.protocol.request_limits import RequestLimits
from pdserve.protocol.response_headers import set_header
from pdserve.protocol.responses_api import from_chat
from pdserve.protocol.sse import SSEResponse, when_over
from pdserve.protocol.tokenize import PATH_DETOKENIZE, PATH_TOKENIZE, detokenize_request, tokenize_request
from pdserve.protocol.gc_heap import YOUNG_THRESHOLD, freeze_startup_heap
from pdserve.protocol.tracing import log_trace_ids
from pdserve.protocol.tracing import setup as setup_tracing
from pdserve.router.admission_queue import AdmissionQueue
from pdserve.router.config import RouterConfig
from pdserve.router.discovery import make_discovery
from pdserve.router.flow_control import (FAIRNESS_HEADER, PRIORITY_HEADER, FlowControlConfig, FlowController, Ticket,
                                         band_of, tenant_of)
from pdserve.router.flow_control.saturation import saturation_check
from pdserve.router.forward import Forwarder
from pdserve.router.http1 import Client
from pdserve.router.hot_routes import HotRoutesApp
from pdserve.router.intake import intake
from pdserve.router.kv_index import KVIndex
from pdserve.router.kv_subscriptions import KVSubscriptions
from pdserve.router.metrics import RouterMetrics
from pdserve.router.call import Call
from pdserve.router.offload import INLINE_BYTES, RequestIds, off_loop
from pdserve.router.orchestrator import Orchestrator
from pdserve.router.policies import PolicyContext, RoutingRequest, needs_kv_index
from pdserve.router.prober import Prober
from pdserve.router.selection import Selector
from pdserve.router.upstream import Upstream, make_session
from pdserve.router.workers import WorkerSet

log = logging.getLogger("pdserve.router")

_REQUEST_ID, _SESSION_ID = HEADER_REQUEST_ID.encode(), HEADER_SESSION_ID.encode()


def build_app(config: RouterConfig, freeze_heap: bool = False) -> FastAPI:
    """`freeze_heap`: once started, the process's heap so far leaves the garbage collector's reach
    (protocol/gc_heap.py); only where the process is the router's alone (router/server.py)."""
    metrics = RouterMetrics()
    tracing = setup_tracing(config.otlp_traces_endpoint, "pdserve-router", metrics.registry)
    log_trace_ids(tracing)
    workers = WorkerSet(config.eject_after_failures, config.eject_backoff_s, config.eject_backoff_max_s)
    wants_index = (needs_kv_index(config.prefill_policy) or needs_kv_index(config.decode_policy)
                   or config.kv_peer_prefix_min_tokens > 0)  # the peer prefix reads who holds what
    kv_index = KVIndex() if wants_index else None
    tokenizer = None
    # Prefix-aware needs token ids; without it, a given tokenizer still makes the arrival
    # counter exact (metrics.arrived_prompt_tokens), at one tokenization per request.
    if wants_index or config.tokenizer:
        from pdserve.router.prompt import PromptTokenizer

        tokenizer = PromptTokenizer(config.tokenizer)
    ctx = PolicyContext(kv_index=kv_index, pd_min_prompt_tokens=config.pd_min_prompt_tokens,
                        pd_min_uncached_tokens=config.pd_min_uncached_tokens)
    api_keys = tuple(k.encode() for k in config.api_keys)
    ids = RequestIds()
    limits = RequestLimits.of(config)
    flow_config = FlowControlConfig.of(config)
    flow = (FlowController(flow_config, metrics.flow, saturation_check(flow_config, workers))
            if flow_config.enabled else None)

    # What the lifespan makes and every request uses, read here rather than through `app.state`
    # (Starlette's State answers each attribute with a Python-level __getattr__).
    live = types.SimpleNamespace(orchestrator=None, admission=None)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async with make_session(config.max_connections) as session:
            if config.worker_api_key:
                # Default headers of the one session: requests, probes and scrapes all carry it.
                session.headers["Authorization"] = f"Bearer {config.worker_api_key}"
            # The generation path's client (http1.py): the worker key on every call, as the session's.
            client = Client(config.max_connections,
                            {"Authorization": f"Bearer {config.worker_api_key}"} if config.worker_api_key else None)
            upstream = Upstream(session, workers, metrics, client)
            selector = Selector(config, ctx, workers)
            live.orchestrator = app.state.orchestrator = Orchestrator(config, upstream, selector)
            live.orchestrator.tracing = tracing
            # A worker counts once probed serving the model: discovery may list a new pod a
            # moment before the prober has read its /v1/models.
            live.admission = app.state.admission = AdmissionQueue(
                config.hold_timeout_s, config.hold_queue,
                lambda m: any(m in w.models for role in (ROLE_DECODE, ROLE_PREFILL) for w in selector.pool(role, m)),
                workers.models, metrics)
            app.state.forwarder = Forwarder(config, upstream, selector)
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
            if freeze_heap:
                freeze_startup_heap(YOUNG_THRESHOLD)
            try:
                yield
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                if subs is not None:
                    subs.close()
                client.close()
                await asyncio.to_thread(tracing.shutdown)

    app = HotRoutesApp(title="pdserve router", lifespan=lifespan, **utility_routes.DOCS)
    app.state.config = config
    app.state.workers = workers
    app.state.metrics = metrics
    app.state.kv_index = kv_index
    app.state.flow = flow

    install_handlers(app)
    cors.install(app, config)

    def json_request(request: Incoming) -> None:
        """401 or 415, before the body is read."""
        authorize(request, api_keys)
        ctype = request.header(b"content-type") or ""
        if ctype.split(";")[0].strip().lower() != "application/json":
            raise APIError(415, f"Content-Type must be application/json, not {ctype or 'missing'!r}")

    async def read_json(request: Incoming) -> bytes:
        json_request(request)
        return await request.body(config.max_body_bytes, config.body_timeout_s)

    def served_model(model: str) -> None:
        served = workers.models()
        if not served:
            raise APIError(503, "no worker is ready yet", code="no_workers")
        if model not in served:
            raise APIError(404, f"model {model!r} is not served here (serving: {', '.join(sorted(served))})",
                           param="model", code="model_not_found")

    async def parse(request: Incoming, route: str, request_id: str, span) -> Call:
        # Parsed, validated and re-serialised (router/intake.py): CPU in proportion to the body,
        # on a thread when the body is large (router/offload.py), so /health and every other
        # request go on meanwhile.
        json_request(request)
        raw = request.received(config.max_body_bytes, config.body_timeout_s)
        if raw is None:  # (the ASGI path: it is read now)
            raw = await request.body(config.max_body_bytes, config.body_timeout_s)
        # (the common cases without a coroutine each: a small body, no hold, no tokenizer)
        taken = intake(raw, route, limits) if len(raw) <= INLINE_BYTES else \
            await off_loop(len(raw), intake, raw, route, limits)
        if live.admission.enabled:
            await live.admission.admit(taken.model)  # scale from zero: wait (bounded) for a worker
        served_model(taken.model)
        routing = RoutingRequest(taken.request, request.header(_SESSION_ID), tokenizer)
        if tokenizer is not None:
            await routing.tokenize_off_loop()
        # Counted as an arrival once a worker accepts it (Orchestrator._answered), not here.
        ids = routing.token_ids()
        return Call(taken.route, taken.request, taken.raw, request_id, routing, started=time.monotonic(),
                    prompt_tokens=taken.estimated_tokens if ids is None else len(ids), span=span,
                    made_fields=None if taken.fields is None else (taken.request, taken.fields),
                    responses_body=taken.responses)

    async def ticket(request: Incoming, call: Call) -> Ticket:
        """The request's band and tenant (400 on a malformed header or an unknown priority); a
        priority given by header is what the workers are sent too (--scheduling-policy priority)."""
        band = band_of(call.request.priority, request.headers.get(PRIORITY_HEADER), flow_config.bands)
        if band != call.request.priority:
            call.request = call.request.model_copy(update={"priority": band})
            # As intake serialised it: CPU in proportion to the body (router/offload.py).
            call.raw = await off_loop(len(call.raw),
                                      lambda: json.dumps({**json.loads(call.raw), "priority": band}).encode())
        tenant = tenant_of(request.headers.get(FAIRNESS_HEADER), request.headers.get("authorization"))
        budget = getattr(call.request, "requested_max_tokens", call.request.max_tokens)  # chat's, or completions'
        return Ticket(band, tenant, call.prompt_tokens + (budget or 0))

    async def in_turn(request: Incoming, call: Call) -> Response:
        """Under flow control, the orchestrator's answer once the request's turn has come, with
        its slot held until the answer is over (a stream's end or its client leaving)."""
        lease = await flow.acquire(await ticket(request, call))
        try:
            response = await live.orchestrator.handle(call)
        except BaseException:
            lease.release()
            raise
        when_over(response, lease.release)
        return response

    def traced(request: Incoming, route: str, request_id: str):
        """The request's span: under the client's `traceparent`, else a new trace's root."""
        if not tracing.enabled:
            return None
        span = tracing.start(f"router {route}", tracing.extract(request.headers), kind="server",
                             attributes={"gen_ai.request.id": request_id, "http.route": route})
        tracing.make_current(span)
        return span

    def end_when_sent(span, response: Response) -> None:
        """The span ends with the response: a stream's when it is over, however it ended."""
        if span is None:
            return
        attributes = {"http.response.status_code": response.status_code}
        failed = not isinstance(response, SSEResponse) and response.status_code >= 500
        when_over(response, lambda: tracing.end(span, attributes, error="upstream failed" if failed else None))

    async def serve(request: Incoming, route: str) -> Response:
        # One id for the client, both upstream legs and the logs; echoed as a response header.
        request_id = request_id_from(request.header(_REQUEST_ID), limits.max_request_id_chars) or ids.new()
        span = traced(request, route, request_id)
        started = time.monotonic()
        try:
            call = await parse(request, route, request_id, span)
            if span is not None:
                span.set_attributes({"gen_ai.request.model": call.model,
                                     "gen_ai.usage.prompt_tokens": call.prompt_tokens})
            work = live.orchestrator.handle(call) if flow is None else in_turn(request, call)
            response = await unless_disconnected(request, work)
            if route == "responses":
                response = from_chat(response, call.responses_body)
            set_header(response, _REQUEST_ID, request_id.encode("latin-1"))
            if span is not None:
                span.set_attribute("pdserve.disaggregated", call.disaggregated)
        except APIError as e:
            metrics.requests.labels(route, str(e.status), "no").inc()
            metrics.e2e.observe(time.monotonic() - started)
            response = e.response()
            set_header(response, _REQUEST_ID, request_id.encode("latin-1"))
        except ClientGone:
            metrics.requests.labels(route, "499", "no").inc()
            response = Response(status_code=499)
        except Exception:  # a bug of ours still answers in OpenAI's shape, and is logged
            log.exception("unexpected error on %s", route)
            metrics.requests.labels(route, "500", "no").inc()
            response = APIError(500, "internal router error", code="internal_error").response()
        except BaseException as e:  # cancelled: the client left
            tracing.end(span, error=type(e).__name__)
            raise
        end_when_sent(span, response)
        return response

    # (partials, not wrapper coroutines: one coroutine less for each request to pass through)
    app.hot_post("/v1/chat/completions", functools.partial(serve, route="chat"), "chat")
    app.hot_post("/v1/completions", functools.partial(serve, route="completions"), "completions")
    app.hot_post("/v1/responses", functools.partial(serve, route="responses"), "responses")

    async def forward(request: Request, path: str, check) -> Response:
        """/tokenize, /detokenize: validated here like any route (`check`: raw bytes to the request
        model, on a thread), answered by one worker."""
        incoming = Incoming.of_asgi(request.scope, request.receive)
        request_id = request_id_from(incoming.header(_REQUEST_ID), limits.max_request_id_chars) or ids.new()
        try:
            raw = await read_json(incoming)
        except ClientGone:
            return Response(status_code=499)
        req = await asyncio.to_thread(check, raw)
        model = req.model
        if model is None:  # optional, as on vLLM: the one model served, if there is one
            served = sorted(workers.models())
            if len(served) > 1:
                raise APIError(400, f"'model' is required: this router serves {', '.join(served)}", param="model")
            model = served[0] if served else ""
        served_model(model)
        # What was validated, never a client's unknown fields (as for the OpenAI routes).
        payload = await asyncio.to_thread(lambda: req.model_copy(update={"model": model}).model_dump_json(
            exclude_unset=True).encode())
        response = await app.state.forwarder.forward(path, payload, model, request_id)
        response.headers[HEADER_REQUEST_ID] = request_id
        return response

    def tokenize_body(raw: bytes):
        # A text's tokens are the worker's to count: it bounds the text as a completion's prompt.
        return tokenize_request(parse_object(raw, limits.body_values))

    def detokenize_body(raw: bytes):
        req = detokenize_request(parse_object(raw, limits.body_values))
        limits.check_prompt_tokens(len(req.tokens), "tokens")
        return req

    @app.post(PATH_TOKENIZE)
    async def tokenize(request: Request) -> Response:
        return await forward(request, PATH_TOKENIZE, tokenize_body)

    @app.post(PATH_DETOKENIZE)
    async def detokenize(request: Request) -> Response:
        return await forward(request, PATH_DETOKENIZE, detokenize_body)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authorize(request, api_keys)
        data = []
        for m in sorted(workers.models()):
            card = {"id": m, "object": "model", "created": 0, "owned_by": "pdserve"}
            # The smallest of its workers' limits: what every worker serving it accepts.
            lens = [w.max_model_len for w in workers.all() if m in w.models and w.max_model_len]
            if lens:
                card["max_model_len"] = min(lens)
            # vLLM's `root` (what the model was loaded from), passed through when its workers agree.
            roots = {w.roots[m] for w in workers.all() if m in w.models and m in w.roots}
            if len(roots) == 1:
                card["root"] = roots.pop()
            # A LoRA adapter names its base model, as vLLM lists it.
            parents = {w.parents[m] for w in workers.all() if m in w.models and m in w.parents}
            if len(parents) == 1:
                card["parent"] = parents.pop()
            data.append(card)
        return JSONResponse({"object": "list", "data": data})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        listing = json.loads((await models(request)).body)
        card = next((c for c in listing["data"] if c["id"] == model_id), None)
        if card is None:
            raise APIError(404, f"The model `{model_id}` does not exist.", "model", "model_not_found")
        return JSONResponse(card)

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok"})

    utility_routes.install(app, api_keys, health)

    @app.get("/ready")
    async def ready() -> Response:
        """Ready with a routable worker of either role (fallback.py: one role serves whole
        requests), or with none while requests are held for one (--hold-timeout: scale from zero,
        so the Service keeps sending the router the requests that wake the model up)."""
        # A worker counts once the router knows what it serves (its /v1/models scraped): before
        # that every request would get 503 "no worker is ready yet", so neither the Service nor
        # `pdserve up` should send any (a new worker is in its pool from discovery on).
        n, n_prefill = (sum(1 for w in workers.pool(role) if w.models) for role in ("decode", "prefill"))
        body = {"status": "ready", "decode_workers": n, "prefill_workers": n_prefill}
        degraded = {m: r for m, r in app.state.orchestrator.fallback.refresh().items() if r}
        if degraded:
            body["status"], body["missing_role"] = "degraded", degraded
        if n == 0 and n_prefill == 0:
            if not app.state.admission.enabled:
                return APIError(503, "no healthy decode worker", code="no_workers").response()
            body["status"] = "holding"
        return JSONResponse(body)

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        authorize(request, api_keys)
        app.state.orchestrator.fallback.refresh()  # the degraded gauge is current without traffic
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/debug/workers", include_in_schema=False)
    async def debug_workers(request: Request) -> Response:
        """Per worker: its revision (only workers of one revision pair) and models, health,
        ejection, the router's own in-flight count (tests prove every acquire was released by
        reading it back to 0) and its scraped LoRA slots."""
        authorize(request, api_keys)
        now = time.monotonic()
        return JSONResponse([{"url": w.url, "role": w.role, "revision": w.revision, "models": sorted(w.models),
                              "healthy": w.healthy, "routable": w.routable(now),
                              "inflight": w.inflight, "consecutive_failures": w.consecutive_failures,
                              "max_lora": w.max_lora, "lora_running": sorted(w.lora_running),
                              "lora_waiting": sorted(w.lora_waiting)}
                             for w in workers.all()])

    return app
