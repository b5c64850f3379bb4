"""The router's front door against a real router process: everything that must be refused
before a byte is streamed, and the OpenAI error shape of each refusal."""

from __future__ import annotations

import os

import httpx
import openai
import pytest

KEY = "sk-test-1"


@pytest.fixture(scope="module")
def stack(module_launch):
    worker = module_launch.fake_worker()
    env = dict(os.environ, PDSERVE_API_KEYS="sk-env-2, sk-env-3")
    router = module_launch.router("--decode", worker.url, "--api-key", KEY, "--max-body-bytes", "4096", env=env)
    return worker, router


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def post(router, path="/v1/completions", key=KEY, **kw):
    headers = kw.pop("headers", {})
    if key:
        headers["authorization"] = f"Bearer {key}"
    return httpx.post(router.url + path, headers=headers, timeout=10, **kw)


def test_missing_or_wrong_api_key_is_401(stack):
    _, router = stack
    body = {"model": "tiny", "prompt": "hi"}
    assert _error(post(router, key=None, json=body), 401)["type"] == "authentication_error"
    _error(post(router, key="sk-wrong", json=body), 401)
    _error(httpx.get(router.url + "/v1/models"), 401)


def test_keys_from_env_are_accepted(stack):
    _, router = stack
    r = post(router, key="sk-env-3", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_body_too_large_is_413_declared_and_chunked(stack):
    _, router = stack
    big = b'{"model": "tiny", "prompt": "' + b"x" * 5000 + b'"}'
    _error(post(router, content=big, headers={"content-type": "application/json"}), 413)

    def chunks():
        yield big[:3000]
        yield big[3000:]

    _error(post(router, content=chunks(), headers={"content-type": "application/json"}), 413)


@pytest.mark.parametrize("content,ctype,status,param", [
    (b"{not json", "application/json", 400, None),
    (b"[1, 2]", "application/json", 400, None),
    (b'{"prompt": "hi"}', "application/json", 400, "model"),
    (b'{"model": "tiny"}', "application/json", 400, "prompt"),
    (b'{"model": "tiny", "prompt": "x", "stream": "yes"}', "application/json", 400, "stream"),
    (b'{"model": "nope", "prompt": "hi"}', "application/json", 404, "model"),
    (b'{"model": "tiny", "prompt": "hi"}', "text/plain", 415, None),
])
def test_bad_requests_get_openai_errors(stack, content, ctype, status, param):
    _, router = stack
    err = _error(post(router, content=content, headers={"content-type": ctype}), status)
    assert err["param"] == param


def test_worker_4xx_passes_through_unchanged(stack):
    _, router = stack
    err = _error(post(router, json={"model": "tiny", "prompt": "hi", "max_tokens": -1}), 400)
    assert err["param"] == "max_tokens"


def test_client_kv_transfer_params_are_stripped(stack):
    worker, router = stack
    body = {"model": "tiny", "prompt": "strip me", "max_tokens": 2,
            "kv_transfer_params": {"remote_url": "http://evil:1", "request_id": "x"}}
    assert post(router, json=body).status_code == 200
    seen = [r for r in worker.requests() if r["body"].get("prompt") == "strip me"]
    assert seen and all("kv_transfer_params" not in r["body"] for r in seen)
    assert seen[0]["headers"].get("x-request-id")


def test_models_health_ready_metrics(stack):
    _, router = stack
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=KEY)
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert httpx.get(router.url + "/health").status_code == 200
    assert httpx.get(router.url + "/ready").json()["decode_workers"] == 1
    assert httpx.get(router.url + "/metrics").status_code == 401  # keyed router: only /health, /ready are public
    text = httpx.get(router.url + "/metrics", headers={"authorization": f"Bearer {KEY}"}).text
    for name in ("pdserve_router_requests_total", "pdserve_router_time_to_first_token_seconds",
                 "pdserve_router_e2e_latency_seconds", "pdserve_router_prefill_seconds",
                 "pdserve_router_handoff_seconds", "pdserve_router_upstream_errors_total",
                 "pdserve_router_inflight", "pdserve_router_retries_total"):
        assert name in text
    assert 'pdserve_router_requests_total{disaggregated="no",route="completions",status="401"}' in text


def test_unknown_route_is_openai_shaped(stack):
    _, router = stack
    _error(httpx.get(router.url + "/v1/nothing"), 404)


def test_bad_flags_name_the_flag(launch):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "pdserve.cli.main", "router", "--decode", "localhost:1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--decode" in r.stderr
    r = subprocess.run([sys.executable, "-m", "pdserve.cli.main", "router", "--decode", "http://a:1",
                        "--policy", "fastest"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--policy: unknown policy 'fastest'" in r.stderr and "round-robin" in r.stderr
    r = subprocess.run([sys.executable, "-m", "pdserve.cli.main", "router", "--decode", "http://a:1",
                        "--decode-policy", "fastest"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--decode-policy: unknown policy 'fastest'" in r.stderr
