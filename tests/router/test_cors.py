"""CORS through a real router process: a browser's preflight (`OPTIONS` with `Origin` and
`Access-Control-Request-*`, no API key) is answered, and answers carry
`Access-Control-Allow-Origin`, with vLLM's defaults (every origin) and with a restricted
`--allowed-origins` list. The caller of the simple request is the real `openai` client, sending
the `Origin` a browser would."""

from __future__ import annotations

import httpx
import openai
import pytest

KEY = "sk-cors"
APP = "https://app.example"
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


@pytest.fixture(scope="module")
def worker(module_launch):
    return module_launch.fake_worker()


@pytest.fixture(scope="module")
def open_router(module_launch, worker):
    return module_launch.router("--decode", worker.url, "--api-key", KEY)


@pytest.fixture(scope="module")
def strict_router(module_launch, worker):
    return module_launch.router("--decode", worker.url, "--api-key", KEY, "--allowed-origins", f'["{APP}"]',
                                "--allowed-methods", '["GET", "POST"]', "--allowed-headers",
                                '["Authorization", "Content-Type"]', "--allow-credentials")


def _preflight(router, origin: str) -> httpx.Response:
    return httpx.options(router.url + "/v1/chat/completions", headers={"Origin": origin, **PREFLIGHT}, timeout=10)


def _chat(router, origin: str):
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=KEY, max_retries=0, timeout=30,
                           default_headers={"Origin": origin})
    return client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_preflight_is_answered_without_a_key_by_default(open_router):
    r = _preflight(open_router, "https://anywhere.example")
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-headers"] == "authorization,content-type"  # ["*"]: what was asked
    assert "access-control-allow-credentials" not in r.headers


def test_answers_carry_the_allow_origin_header(open_router):
    raw = _chat(open_router, "https://anywhere.example")
    assert raw.http_response.status_code == 200 and raw.parse().choices[0].message.content
    assert raw.headers["access-control-allow-origin"] == "*"
    # An error too (here a missing key): a browser app can read why it failed.
    r = httpx.get(open_router.url + "/v1/models", headers={"Origin": "https://anywhere.example"}, timeout=10)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"


def test_a_restricted_origin_list(strict_router):
    r = _preflight(strict_router, APP)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == APP
    assert r.headers["access-control-allow-credentials"] == "true"
    assert set(r.headers["access-control-allow-methods"].replace(" ", "").split(",")) == {"GET", "POST"}
    raw = _chat(strict_router, APP)
    assert raw.http_response.status_code == 200 and raw.headers["access-control-allow-origin"] == APP
    # Another origin: the preflight fails and no answer grants it access.
    r = _preflight(strict_router, "https://evil.example")
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    raw = _chat(strict_router, "https://evil.example")
    assert raw.http_response.status_code == 200  # CORS is the browser's to enforce: the server only withholds
    assert "access-control-allow-origin" not in raw.headers
    # A method not listed is refused at the preflight.
    r = httpx.options(strict_router.url + "/v1/models", timeout=10,
                      headers={"Origin": APP, "Access-Control-Request-Method": "DELETE"})
    assert r.status_code == 400
