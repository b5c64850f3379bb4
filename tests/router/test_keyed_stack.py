"""Keyed workers behind a keyed router (issue 15, item 3), real processes: two `pdserve worker`s
(tiny checkpoint, CPU, TCP KV transfer, a KV secret, --api-key) and `pdserve router` with a
client key and the workers' key. P/D works (the decode worker pulls the prefill's KV: bytes
moved, no local-prefill fallback); an unkeyed client reaches nothing but /health (and the
router's /ready); a client holding only the router's key cannot hand a worker KV params."""

from __future__ import annotations

import os

import httpx
import openai
import pytest

from tests.helpers.metrics import metric
from tests.router.test_failures import eventually

pytestmark = pytest.mark.slow

CLIENT_KEY = "sk-client-of-the-router"
WORKER_KEY = "sk-router-to-workers"
CLIENT_AUTH, WORKER_AUTH = ({"authorization": f"Bearer {key}"} for key in (CLIENT_KEY, WORKER_KEY))
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


@pytest.fixture(scope="module")
def stack(module_launch, tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    env = {**os.environ, "PDSERVE_KV_SECRET": "keyed-stack-kv-secret-0123456789"}
    prefill, decode = module_launch.real_pd_workers(ckpt, "--api-key", WORKER_KEY, "--max-model-len", "256", env=env)
    router = module_launch.router("--prefill", prefill.url, "--decode", decode.url,
                                  "--api-key", CLIENT_KEY, "--worker-api-key", WORKER_KEY)
    auth = {"authorization": f"Bearer {CLIENT_KEY}"}
    eventually(lambda: httpx.get(router.url + "/v1/models", headers=auth).json()["data"], timeout_s=30)
    return prefill, decode, router


def test_pd_works_with_keyed_workers_behind_a_keyed_router(stack):
    prefill, decode, router = stack
    moved = metric(decode.url, "pdserve_kv_transfer_bytes_total", headers=WORKER_AUTH)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=CLIENT_KEY, max_retries=0)
    for stream in (False, True):
        kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        if stream:
            text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
        else:
            text = client.completions.create(**kw).choices[0].text
        assert text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=4)
    assert chat.choices[0].message.content is not None
    assert metric(router.url, "pdserve_router_requests_total", headers=CLIENT_AUTH, disaggregated="yes") >= 3
    assert metric(decode.url, "pdserve_kv_transfer_bytes_total", headers=WORKER_AUTH) > moved  # pulled, not recomputed
    assert metric(decode.url, "pdserve_kv_local_prefill_fallbacks_total", headers=WORKER_AUTH) == 0
    for w in (prefill, decode):
        eventually(lambda: httpx.get(w.url + "/debug/kv", headers={"authorization": f"Bearer {WORKER_KEY}"})
                   .json()["num_pinned_blocks"] == 0)


@pytest.mark.parametrize("key", [None, "wrong", CLIENT_KEY], ids=["no-key", "wrong-key", "router-key"])
def test_a_client_without_the_worker_key_reaches_only_health(stack, key):
    prefill, decode, router = stack
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2,
            "kv_transfer_params": {"do_remote_decode": True}}
    for w in (prefill, decode):
        assert httpx.get(w.url + "/health").status_code == 200
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                             ("GET", "/metrics"), ("GET", "/debug/kv"), ("POST", "/kv/release")):
            r = httpx.request(method, w.url + path, headers=headers, json=body, timeout=10)
            assert r.status_code == 401, (w.url, path, r.text)
    if key != CLIENT_KEY:
        assert httpx.get(router.url + "/health").status_code == 200
        assert httpx.get(router.url + "/ready").status_code == 200
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/metrics"),
                             ("GET", "/debug/workers")):
            assert httpx.request(method, router.url + path, headers=headers, json=body).status_code == 401
