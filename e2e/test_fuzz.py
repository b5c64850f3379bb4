"""Bounded fuzzing of the router's and the decode worker's HTTP endpoints, in front of real
processes (a tiny random-weight checkpoint, P/D over TCP, --max-model-len 128 so any valid
request is cheap).

Routes and methods come from each app's OpenAPI document; request bodies from the worker's
request models' JSON Schemas (the router accepts the same bodies), mixed with arbitrary JSON,
raw bytes and wrong content types. Promise: no 5xx, every error is OpenAI's error JSON, every
stream ends with [DONE], no process dies, and no KV block is left behind. Strings carry lone
surrogates and NUL bytes (schema_strategies), and a share of the bodies are adversarial on
purpose (`ADVERSARIAL`: huge numbers, deep nesting, string-typed numbers).
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from tests.net import free_port
from e2e.processes import Stack, eventually
from e2e.schema_strategies import JSON_VALUES, from_schema
from pdserve.cli.stack import StackConfig

pytestmark = pytest.mark.slow

MODEL = "tiny"
MAX_EXAMPLES = 200
# Fields most random values make invalid (penalties out of range, logit_bias ids outside the
# vocabulary, echo without logprobs, malformed tools, ...): a second body strategy leaves them
# out, so more generated requests get past validation and run; the first keeps every field.
RUNNABLE_FIELDS = {"model", "prompt", "messages", "n", "stream", "stream_options", "max_tokens",
                   "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                   "ignore_eos", "min_tokens", "logprobs", "top_logprobs"}


JSON = {"content-type": "application/json"}
VALID = {"/v1/completions": b'{"model": "tiny", "prompt": "x", "max_tokens": 2}',
         "/v1/chat/completions": b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}'}


def _nest(depth: int) -> bytes:
    return b'{"model": "tiny", "prompt": "x", "n": ' + b"[" * depth + b"]" * depth + b"}"


# Bodies that once made a worker or the router answer 5xx, or that a lax parser coerces.
ADVERSARIAL = [
    b'{"model": "tiny", "prompt": "hi \\ud800 there", "max_tokens": 2}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
    b'{"model": "tiny", "prompt": "a\\u0000b", "stop": ["\\u0000"], "max_tokens": 2}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": 1e400}',
    b'{"model": "tiny", "prompt": "x", "temperature": 1e400, "max_tokens": 2}',
    b'{"model": "tiny", "prompt": "x", "temperature": -1e308, "max_tokens": 2}',
    b'{"model": "tiny", "prompt": "x", "top_p": NaN, "max_tokens": 2}',
    b'{"model": "tiny", "prompt": "x", "seed": 123456789012345678901234567890, "max_tokens": 2}',
    b'{"model": "tiny", "prompt": [99999999999999999999], "max_tokens": 2}',
    b'{"model": "tiny", "prompt": "x", "max_tokens": "16"}',
    b'{"model": "tiny", "prompt": "x", "n": "2"}',
    _nest(100_000), _nest(1_000), _nest(65), b"[" * 100_000,
]


def openapi_routes() -> dict[str, list[tuple[str, str]]]:
    """{"router"|"worker": [(method, path)]} from the apps' OpenAPI documents (built, not served)."""
    from pdserve.router.app import build_app as router_app
    from pdserve.router.config import RouterConfig
    from pdserve.worker.server.app import build_app as worker_app
    from pdserve.worker.server.config import ServerConfig

    apps = {"router": router_app(RouterConfig(decode_urls=("http://127.0.0.1:9",))),
            "worker": worker_app(ServerConfig(), MODEL, lambda: None)}
    return {name: sorted((m.upper(), path) for path, ops in app.openapi()["paths"].items() for m in ops)
            for name, app in apps.items()}


def body_strategies() -> dict[str, st.SearchStrategy]:
    from pdserve.protocol.requests import ChatCompletionRequest, CompletionRequest

    # Bound only what a *valid* request costs (choices x tokens); everything else stays wild.
    cost = {"n": st.integers(-1, 3), "max_tokens": st.none() | st.integers(-2, 12),
            "max_completion_tokens": st.none() | st.integers(-2, 12),
            "model": st.sampled_from([MODEL] * 6 + ["", "other-model"]) | st.text(max_size=8)}
    def both(schema: dict) -> st.SearchStrategy:
        runnable = {**schema, "properties": {k: v for k, v in schema["properties"].items() if k in RUNNABLE_FIELDS}}
        full, runs = from_schema(schema, cost), from_schema(runnable, cost)
        return st.integers(0, 2).flatmap(lambda k: full if k == 0 else runs)  # most bodies should run

    return {"/v1/completions": both(CompletionRequest.model_json_schema()),
            "/v1/chat/completions": both(ChatCompletionRequest.model_json_schema())}


@pytest.fixture(scope="module")
def stack(tiny_checkpoint, tmp_path_factory):
    config = StackConfig(prefill=1, decode=1, host="127.0.0.1", port=free_port(), device="cpu", kv_transfer="tcp",
                         worker_args=("--max-model-len", "128", "--kv-cache-memory", str(16 << 20)),
                         router_args=("--request-timeout", "60"))
    s = Stack(config, tiny_checkpoint("llama"), MODEL, tmp_path_factory.mktemp("fuzz-stack"))
    try:
        yield s.start_all()
    finally:
        s.stop_all()


def requests_strategy(routes: dict[str, list[tuple[str, str]]]):
    bodies = body_strategies()

    @st.composite
    def one(draw):
        target = draw(st.sampled_from(sorted(routes)))
        # The generation routes get most of the budget: they are where bodies matter.
        weighted = routes[target] + [r for r in routes[target] if r[1] in bodies] * 4
        method, path = draw(st.sampled_from(weighted))
        method = draw(st.sampled_from([method] * 4 + ["PUT", "DELETE", "GET", "POST"]))
        headers, content = {}, None
        if method == "POST":
            kind = draw(st.sampled_from(["schema"] * 6 + ["json", "bytes", "adversarial"]))
            if kind == "adversarial":
                content = draw(st.sampled_from(ADVERSARIAL))
            elif kind == "schema" and path in bodies:
                content = json.dumps(draw(bodies[path])).encode()
            elif kind == "bytes":
                content = draw(st.binary(max_size=64))
            else:
                content = json.dumps(draw(JSON_VALUES)).encode()
            headers["content-type"] = draw(st.sampled_from(["application/json"] * 6 + ["text/plain", ""]))
        return target, method, path, headers, content

    return one()


def check_response(r: httpx.Response, body: bytes) -> None:
    assert r.status_code < 500, body
    if r.status_code >= 400 and r.status_code != 405:
        error = json.loads(body)["error"]
        assert isinstance(error["message"], str) and error["type"], body
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line for line in body.decode().split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "data: [DONE]", body[-300:]


def test_fuzz_router_and_worker_endpoints(stack):
    urls = {"router": stack.url("router"), "worker": stack.url("decode-0")}
    http = httpx.Client(timeout=60)
    seen: dict[tuple[str, int], int] = {}  # (path, status) -> count

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    @given(requests_strategy(openapi_routes()))
    # Valid requests on both sides, whatever the generated ones turn out to be: the run must see
    # each generation route answer as well as refuse (the assertion below).
    @example(("router", "POST", "/v1/completions", JSON, VALID["/v1/completions"]))
    @example(("worker", "POST", "/v1/completions", JSON, VALID["/v1/completions"]))
    @example(("router", "POST", "/v1/chat/completions", JSON, VALID["/v1/chat/completions"]))
    @example(("worker", "POST", "/v1/chat/completions", JSON, VALID["/v1/chat/completions"]))
    def fuzz(request):
        target, method, path, headers, content = request
        with http.stream(method, urls[target] + path, headers=headers, content=content) as r:
            body = r.read()
        seen[(path, r.status_code)] = seen.get((path, r.status_code), 0) + 1
        check_response(r, body)

    try:
        fuzz()
    finally:
        http.close()
    print("fuzz (path, status) counts:", sorted(seen.items()))
    # The run reached both sides of validation: generated requests that ran, and refusals.
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert seen.get((path, 200)) and seen.get((path, 400)), seen
    for name in stack.children:
        assert stack.alive(name), f"{name} died:\n{stack.log(name)[-3000:]}"
    eventually(stack.no_leaks, 30, "no KV blocks left behind by the fuzz run")
    assert httpx.get(stack.url("router") + "/ready").status_code == 200
