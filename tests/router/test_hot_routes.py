"""The generation routes' way past the middleware stack (router/hot_routes.py), against a real
router and fake worker: answers as before, CORS's `Vary: Origin` kept, and a browser's request
(with `Origin`) answered through the whole stack with its CORS headers."""

from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def router(module_launch):
    worker = module_launch.fake_worker("--model", "tiny")
    return module_launch.router("--decode", worker.url)


BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0}


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_without_origin_keeps_cors_vary_and_a_request_id(router, stream):
    r = httpx.post(router.url + "/v1/completions", json={**BODY, "stream": stream}, timeout=30)
    assert r.status_code == 200
    assert r.headers["vary"] == "Origin"
    assert len(r.headers["x-request-id"]) == 32
    assert "access-control-allow-origin" not in r.headers
    assert ("data: [DONE]" in r.text) if stream else r.json()["choices"][0]["text"]


def test_a_browsers_request_gets_the_cors_headers(router):
    r = httpx.post(router.url + "/v1/completions", json=BODY, headers={"Origin": "https://app.example"}, timeout=30)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "*"


def test_errors_on_the_hot_path_are_openai_errors(router):
    r = httpx.post(router.url + "/v1/chat/completions", json={"model": "tiny"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert r.headers["vary"] == "Origin"


def test_generated_request_ids_differ(router):
    ids = {httpx.post(router.url + "/v1/completions", json=BODY, timeout=30).headers["x-request-id"] for _ in range(3)}
    assert len(ids) == 3
