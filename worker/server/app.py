"""The worker's FastAPI app: OpenAI endpoints, health, metrics, and the engine's lifetime.

The lifespan starts loading the engine in a thread and returns at once, so the port answers
from the first second: /health says 503 (Kubernetes keeps the pod unready), API calls get 503,
and only when the engine runs does /health turn 200. A load failure is fatal (`on_fatal`): the
process exits non-zero and the pod restarts, rather than serving 503 forever.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from pdserve.protocol import cors, utility_routes
from pdserve.protocol.auth import authorize
from pdserve.protocol.body import parse_object, read_body, read_model, validate
from pdserve.protocol.chat_render import ChatTemplates
from pdserve.protocol.contract import ENV_RUNTIME_LORA, PATH_KV_RELEASE
from pdserve.protocol.disconnect import ClientGone
from pdserve.protocol.errors import APIError, bad_request, install_handlers
from pdserve.protocol.gc_heap import freeze_startup_heap
from pdserve.protocol.kv_transfer import PARAM, KVTransferParams, KVTransferParamsError
from pdserve.protocol.request_limits import RequestLimits
from pdserve.protocol.requests import ChatCompletionRequest, CompletionRequest
from pdserve.protocol.responses_api import as_chat, from_chat
from pdserve.protocol.tokenize import PATH_DETOKENIZE, PATH_TOKENIZE
from pdserve.protocol.tracing import log_trace_ids
from pdserve.protocol.tracing import setup as setup_tracing
from pdserve.worker.config.unsupported_model import UnsupportedModelError
from pdserve.worker.server import chat, completions, tokenize
from pdserve.worker.server.config import ServerConfig
from pdserve.worker.server.generation import Generation
from pdserve.worker.server.metrics import CONTENT_TYPE, ServerMetrics
from pdserve.worker.server.serving import max_prompt_chars, off_loop

log = logging.getLogger("pdserve.worker.server")


class WorkerState:
    """Everything the routes share; lives on `app.state.worker`."""

    def __init__(self, config: ServerConfig, served_model_name: str, engine_factory: Callable[[], object],
                 on_fatal: Callable[[BaseException], None] | None = None, model_source: str | None = None,
                 freeze_heap: bool = False):
        self.config = config
        self._freeze_heap = freeze_heap  # the process is this server's alone (protocol/gc_heap.py)
        self.served_model_name = served_model_name
        self.model_source = model_source  # --model as given: a hub id or a directory; None: the default model
        self.created = int(time.time())
        self._factory = engine_factory
        self._on_fatal = on_fatal
        self.engine = None  # set once loaded and started
        self.max_prompt_chars = 0  # serving.max_prompt_chars, set with the engine
        self.chat_templates: ChatTemplates | None = None  # set with the engine
        self.limits = RequestLimits.of(config)
        self.draining = False
        self._drained: asyncio.Event | None = None  # set when drain() is done (None: no drain began)
        self.inflight: dict[str, str] = {}  # engine request id -> the X-Request-Id it serves ('' without)
        self.metrics = ServerMetrics(served_model_name, lambda: self.engine.stats() if self.engine else None)
        self.tracing = setup_tracing(config.otlp_traces_endpoint, "pdserve-worker", self.metrics.registry)
        log_trace_ids(self.tracing)
        # $VLLM_ALLOW_RUNTIME_LORA_UPDATING, as vLLM reads it: the runtime adapter endpoints, and
        # a hand-off's adapter loaded where this worker lacks it.
        self.runtime_lora = os.environ.get(ENV_RUNTIME_LORA, "").strip().lower() in ("1", "true")
        self._lora_loads = None

    @property
    def model_root(self) -> str | None:
        """vLLM's `root` of a model card: what the model was loaded from, so a client (`pdserve
        bench serve`) finds its tokenizer. --model as given (a hub id; a directory, made
        absolute), else the default model's directory once the engine has it."""
        if self.model_source:
            return os.path.abspath(self.model_source) if os.path.isdir(self.model_source) else self.model_source
        return getattr(self.engine, "model_path", None) if self.engine is not None else None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return len(self.engine.tokenizer)

    @property
    def lora(self):
        """The engine's LoRA adapters (worker/lora/manager.py), None without --enable-lora."""
        return getattr(self.engine, "lora", None) if self.engine is not None else None

    @property
    def lora_loads(self):
        """Loads of a hand-off's adapter this worker lacks (worker/lora/on_demand.py); None
        without --enable-lora or without runtime loading."""
        if not self.runtime_lora or self.lora is None:
            return None
        if self._lora_loads is None:
            from pdserve.worker.lora.on_demand import OnDemandLoads

            self._lora_loads = OnDemandLoads(self.lora)
        return self._lora_loads

    def new_generation(self, request_id, prompts, params, n, kv_transfer_params, continuation=None,
                       lora_name: str | None = None, trace_headers=None) -> Generation:
        """`continuation`: a migrated stream's (token ids per choice, the choices that ended);
        `lora_name`: the adapter the request runs (serving.resolve_model), None for the base."""
        ids, finished = continuation or (None, frozenset())
        return Generation(self.engine, self.metrics, self.inflight, request_id, prompts, params, n, kv_transfer_params,
                          ids, finished, lora_name, self.tracing, trace_headers)

    async def load(self) -> None:
        t0 = time.perf_counter()
        try:
            engine = await asyncio.to_thread(self._factory)
            await engine.start()
            self.max_prompt_chars = await asyncio.to_thread(max_prompt_chars, engine.tokenizer, engine.max_model_len)
            self.chat_templates = ChatTemplates(engine.tokenizer, engine.max_model_len, self.max_prompt_chars,
                                                self.config.chat_template_timeout_s,
                                                self.config.trust_request_chat_template)
        except Exception as e:
            if isinstance(e, UnsupportedModelError):  # a model or format we cannot run: the message says which
                log.error("engine failed to load: %s", e)
            else:
                log.exception("engine failed to load")
            if self._on_fatal is not None:
                self._on_fatal(e)
            return
        for collector in engine.metrics_collectors():  # one registry per process: /metrics lists each family once
            self.metrics.registry.register(collector)
        self.engine = engine
        if self._freeze_heap:
            freeze_startup_heap()
        log.info("engine ready in %.1fs: serving %s (max_model_len=%d)", time.perf_counter() - t0,
                 self.served_model_name, engine.max_model_len)

    def begin_drain(self, grace_s: float) -> None:
        """On the loop's thread, from the signal handler: `drained` waits for this drain from
        now on, whichever of it and the server's shutdown runs first."""
        self._drained = asyncio.Event()
        asyncio.get_running_loop().create_task(self.drain(grace_s))

    async def drain(self, grace_s: float) -> None:
        """SIGTERM: refuse new requests, let in-flight ones run `grace_s`, then abort the rest.
        Within the same grace, a prefill worker then keeps the KV it pinned for decode workers
        until they have read it (or its TTL ends): a scale-down must not turn the hand-offs in
        flight into local prefills. The engine, its side channel and data listener stay up until
        this returns (the lifespan's shutdown awaits `drained`)."""
        self.draining = True
        self._drained = self._drained or asyncio.Event()
        try:
            log.info("draining: %d engine request(s) in flight, grace %.1fs", len(self.inflight), grace_s)
            deadline = time.monotonic() + grace_s
            while self.inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            for rid in list(self.inflight):
                log.warning("aborting %s at the end of the shutdown grace period", rid)
                self.engine.abort(rid)
            if (pinned := self.engine.stats().num_pinned_blocks) and time.monotonic() < deadline:
                log.info("draining: waiting for decode workers to read %d pinned KV block(s)", pinned)
                while self.engine.stats().num_pinned_blocks and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
            if pinned := self.engine.stats().num_pinned_blocks:
                log.warning("draining: %d pinned KV block(s) unread at the end of the grace period; "
                            "their decode workers prefill locally", pinned)
        finally:
            self._drained.set()

    async def drained(self) -> None:
        """Until a drain that began has ended (at once if none began)."""
        if self._drained is not None:
            await self._drained.wait()

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.shutdown()


def build_app(config: ServerConfig, served_model_name: str, engine_factory: Callable[[], object],
              on_fatal: Callable[[BaseException], None] | None = None, model_source: str | None = None,
              freeze_heap: bool = False) -> FastAPI:
    """`freeze_heap`: once the engine runs, the process's heap so far leaves the garbage
    collector's reach (protocol/gc_heap.py); only where the process is the server's alone, never
    in a process that builds apps and engines and drops them (tests)."""
    state = WorkerState(config, served_model_name, engine_factory, on_fatal, model_source, freeze_heap)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loader = asyncio.create_task(state.load())
        try:
            yield
        finally:
            if not loader.done():
                loader.cancel()  # the loading thread itself cannot be stopped; we just stop waiting
            await asyncio.gather(loader, return_exceptions=True)
            await state.drained()  # uvicorn gets here once no connection is open: pins may still be unread
            await state.close()
            await asyncio.to_thread(state.tracing.shutdown)

    app = FastAPI(title="pdserve worker", lifespan=lifespan, **utility_routes.DOCS)
    app.state.worker = state
    install_handlers(app)
    cors.install(app, config)

    api_keys = tuple(k.encode() for k in config.api_keys)

    def authorized(request: Request) -> None:
        authorize(request, api_keys)

    def ready() -> WorkerState:
        if state.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if state.engine is None:
            raise APIError(503, "the model is still loading", code="not_ready", headers={"Retry-After": "5"})
        if not getattr(state.engine, "is_ready", True):
            raise APIError(503, "the engine has failed; this worker must be restarted", code="engine_dead")
        return state

    def gone() -> Response:
        return Response(status_code=499)  # nobody reads it: the client left

    # Bodies are parsed, validated and bounded (protocol/request_limits.py) on a thread: CPU in
    # proportion to what a client sent must not stall /health (protocol/body.py).
    limits = state.limits

    async def read(request: Request) -> bytes:
        return await read_body(request, config.max_request_bytes, config.body_timeout_s)

    async def serve(request: Request, st: WorkerState, model, create):
        """Read and validate the body as `model`, then answer it with `create(st, request, body)`."""
        try:
            body = await read_model(request, model, config.max_request_bytes, config.body_timeout_s,
                                    limits.body_values, limits.check)
            return await create(st, request, body)
        except ClientGone:
            return gone()

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def v1_completions(request: Request, st: WorkerState = Depends(ready)):
        return await serve(request, st, CompletionRequest, completions.create_completion)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def v1_chat_completions(request: Request, st: WorkerState = Depends(ready)):
        return await serve(request, st, ChatCompletionRequest, chat.create_chat_completion)

    def responses_request(raw: bytes) -> tuple[ChatCompletionRequest, dict]:
        chat, answer_fields = as_chat(parse_object(raw, limits.body_values), limits)
        body = validate(ChatCompletionRequest, chat)
        limits.check(body)
        return body, answer_fields

    @app.post("/v1/responses", dependencies=[Depends(authorized)])
    async def v1_responses(request: Request, st: WorkerState = Depends(ready)):
        """The Responses API, mapped onto chat (protocol/responses_api.py)."""
        try:
            body, answer_fields = await off_loop(responses_request, await read(request))
            return from_chat(await chat.create_chat_completion(st, request, body), answer_fields)
        except ClientGone:
            return gone()

    def token_route(path: str, handler) -> None:
        def answer(st: WorkerState, raw: bytes) -> Response:
            # Encoded here too: FastAPI would encode a returned dict on the loop, and a million
            # token ids (with their strings) took seconds of it.
            out = handler(st, parse_object(raw, limits.body_values))
            return Response(json.dumps(out, ensure_ascii=False, separators=(",", ":")).encode(),
                            media_type="application/json")

        async def route(request: Request, st: WorkerState = Depends(ready)):
            try:
                return await off_loop(answer, st, await read(request))
            except ClientGone:
                return gone()

        app.post(path, dependencies=[Depends(authorized)], name=handler.__name__)(route)

    token_route(PATH_TOKENIZE, tokenize.tokenize)
    token_route(PATH_DETOKENIZE, tokenize.detokenize)

    @app.post(PATH_KV_RELEASE, dependencies=[Depends(authorized)], include_in_schema=False)
    async def kv_release(request: Request, st: WorkerState = Depends(ready)):
        """The router gave up on a hand-off before sending its params to any decode worker:
        free the pinned blocks now, not at the TTL. Only a holder of the params can (the pin
        table checks their transfer token, as for the side channel's release)."""
        try:
            params = KVTransferParams.from_dict(await off_loop(parse_object, await read(request), limits.body_values))
        except KVTransferParamsError as e:
            raise bad_request(str(e), PARAM) from None
        except ClientGone:
            return gone()
        st.engine.unpin(params.remote_request_id, params)
        return Response(status_code=202)

    def model_card() -> dict:
        card = {"id": state.served_model_name, "object": "model", "created": state.created, "owned_by": "pdserve"}
        if root := state.model_root:
            card["root"] = root
        if state.engine is not None:
            card["max_model_len"] = state.engine.max_model_len
        if state.lora_loads is not None:  # pdserve's: a router may send it hand-offs of adapters it lacks
            card["runtime_lora_loading"] = True
        return card

    def adapter_cards() -> list[dict]:
        """LoRA adapters as vLLM lists them: their own id, `parent` the base model."""
        lora = state.lora
        if lora is None:
            return []
        base = model_card()
        return [{**base, "id": m.name, "root": m.path, "parent": state.served_model_name} for m in lora.served()]

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def v1_models():
        return {"object": "list", "data": [model_card(), *adapter_cards()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorized)])
    async def v1_model(model_id: str):
        if model_id == state.served_model_name:
            return model_card()
        for card in adapter_cards():
            if card["id"] == model_id:
                return card
        raise APIError(404, f"The model `{model_id}` does not exist.", "model", "model_not_found")

    if state.runtime_lora:
        install_lora_routes(app, state, authorized, ready, read, limits)

    @app.get("/health")
    async def health():
        ready()
        return {"status": "ok"}

    async def ping() -> Response:
        ready()
        return Response(status_code=200)

    utility_routes.install(app, api_keys, ping)

    # Public: /health, /ping, /version and the docs (Kubernetes probes and the router's carry no
    # key; protocol/utility_routes.py). With --api-key, /v1/*, /tokenize, /detokenize, /metrics
    # and /debug/kv need it: the router scrapes with its worker key, Prometheus
    # with a bearer token (ServiceMonitor `authorization`).
    @app.get("/metrics", dependencies=[Depends(authorized)])
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/debug/kv", dependencies=[Depends(authorized)], include_in_schema=False)
    async def debug_kv():
        """For tests and operators: free-block counts prove requests leak no KV memory."""
        if state.engine is None:
            raise APIError(503, "the model is still loading", code="not_ready")
        s = state.engine.stats()
        # `requests`: the X-Request-Ids served here now (the router sends its request id to both legs),
        # so an operator or a benchmark (bench/migration.py) finds the worker serving a stream.
        return {"num_free_blocks": s.num_free_blocks, "num_total_blocks": s.num_total_blocks,
                "num_pinned_blocks": s.num_pinned_blocks, "num_running": s.num_running,
                "num_waiting": s.num_waiting, "requests": sorted({r for r in state.inflight.values() if r})}

    return app


def install_lora_routes(app: FastAPI, state: WorkerState, authorized, ready, read, limits) -> None:
    """vLLM's runtime adapter endpoints (only with $VLLM_ALLOW_RUNTIME_LORA_UPDATING true, as
    vLLM): load reads and checks the adapter on a thread (400 naming what is wrong, nothing
    registered); unload stops new requests at once, running ones finish with it."""
    from pdserve.worker.lora.adapter import LoRAError
    from pdserve.worker.config.lora_modules import LoRAModule

    def body_field(body: dict, name: str) -> str:
        value = body.get(name)
        if not isinstance(value, str) or not value:
            raise bad_request(f"{name} must be a non-empty string", name)
        return value

    def manager(st: WorkerState):
        if st.lora is None:
            raise bad_request("this worker serves no LoRA adapters (start it with --enable-lora)", "lora_name")
        return st.lora

    @app.post("/v1/load_lora_adapter", dependencies=[Depends(authorized)])
    async def load_lora_adapter(request: Request, st: WorkerState = Depends(ready)):
        body = parse_object(await read(request), limits.body_values)
        name, path = body_field(body, "lora_name"), body_field(body, "lora_path")
        if name == st.served_model_name:
            raise bad_request(f"{name!r} is the base model's name", "lora_name")
        try:
            await asyncio.to_thread(manager(st).add, LoRAModule(name, path))
        except LoRAError as e:
            raise bad_request(str(e), "lora_path") from None
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(authorized)])
    async def unload_lora_adapter(request: Request, st: WorkerState = Depends(ready)):
        body = parse_object(await read(request), limits.body_values)
        name = body_field(body, "lora_name")
        try:
            manager(st).remove(name)
        except LoRAError as e:
            raise APIError(404, str(e), "lora_name", "model_not_found") from None
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")
