"""The generation routes' way past the middleware stack (router/hot_routes.py), against a real
router and fake worker: answers as before, CORS's `Vary: Origin` kept, and a browser's request
(with `Origin`) answered through the whole stack with its CORS headers."""

from __future__ import annotations

import http.client
import json

import httpx
import pytest
from starlette.responses import Response

from pdserve.protocol.response_headers import set_header


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


BAD = [  # (content type, body, status, error type, param): each refused before any worker is called
    ("application/json", b'{"model": "tiny", "prompt": "hi", "max_tokens": 3', 400, "invalid_request_error", None),
    ("text/plain", b'{"model": "tiny", "prompt": "hi"}', 415, "invalid_request_error", None),
    ("application/json", b'{"model": "nope", "prompt": "hi", "max_tokens": 3}', 404, "not_found_error", "model"),
    ("application/json", b'{"model": "tiny", "prompt": "hi", "max_tokens": -1}', 400, "invalid_request_error",
     "max_tokens"),
    ("application/json", b'[1, 2]', 400, "invalid_request_error", None),
]


def _post(conn: http.client.HTTPConnection, body: bytes, ctype: str, origin: bool = False) -> tuple:
    headers = {"content-type": ctype, "x-request-id": "req 1"}
    if origin:
        headers["origin"] = "https://app.example"
    conn.request("POST", "/v1/completions", body, headers)
    r = conn.getresponse()
    return r.status, dict(r.getheaders()), r.read()


def test_hot_answers_equal_the_full_stacks_on_one_kept_alive_connection(router):
    """Without `Origin` a generation route's answer takes the hot path (router/hot_routes.py);
    with one it takes FastAPI's stack and its CORS middleware. Same status, body and headers but
    CORS's, errors in OpenAI's shape, the connection kept alive through all of them."""
    host, port = router.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    ok = json.dumps({**BODY, "seed": 1}).encode()
    for ctype, body, status, kind, param in [("application/json", ok, 200, None, None), *BAD]:
        whole, stack = _post(conn, body, ctype), _post(conn, body, ctype, origin=True)
        assert whole[0] == stack[0] == status, body
        if status != 200:  # (an answer's id and creation time are its own)
            assert whole[2] == stack[2]
            error = json.loads(whole[2])["error"]
            assert (error["type"], error["param"]) == (kind, param) and error["message"], error
        cors = {k for k in stack[1] if k.startswith("access-control-")}
        assert {k: v for k, v in stack[1].items() if k not in cors and k != "date"} == \
               {k: v for k, v in whole[1].items() if k != "date"}
        assert whole[1]["x-request-id"] == "req 1" and whole[1]["vary"] == "Origin"
        assert int(whole[1]["content-length"]) == len(whole[2])
    conn.close()


@pytest.mark.parametrize("raw", [
    [(b"content-type", b"a/b")],
    [(b"vary", b"Accept"), (b"content-type", b"a/b")],
    [(b"vary", b"A"), (b"x", b"1"), (b"vary", b"B"), (b"vary", b"C")],
    [],
])
def test_set_header_does_what_starlettes_headers_do(raw):
    ours, theirs = Response(b""), Response(b"")
    ours.raw_headers, theirs.raw_headers = list(raw), list(raw)
    set_header(ours, b"vary", b"Origin")
    theirs.headers["vary"] = "Origin"
    assert ours.raw_headers == theirs.raw_headers
