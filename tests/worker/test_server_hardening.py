"""Issue 15 against a real `pdserve worker` (tiny checkpoint, CPU): input no tokenizer accepts
(lone surrogates), nesting that would exhaust the parser, string-typed numbers: 400, never 5xx;
NUL bytes are ordinary text; slow clients are cut off (headers: connection closed; body: 408)
while others are served, and a client leaving mid-body is no server error."""

from __future__ import annotations

import socket

import httpx
import pytest

from tests.router.test_hardening import BAD_BODIES, BAD_CHAT, assert_cut_off, slowloris_while_served
from tests.worker.test_server_harness import WorkerProcess


@pytest.fixture(scope="module")
def worker(tiny_checkpoint):
    with WorkerProcess(tiny_checkpoint("llama"), "--served-model-name", "tiny", "--max-model-len", "128",
                       "--kv-cache-memory", str(8 << 20), "--header-timeout", "1", "--body-timeout", "1") as w:
        yield w


@pytest.mark.parametrize("path,body", [("/v1/completions", b) for b in BAD_BODIES.values()]
                         + [("/v1/chat/completions", b) for b in BAD_CHAT.values()],
                         ids=list(BAD_BODIES) + list(BAD_CHAT))
def test_bad_input_is_400(worker, path, body):
    r = httpx.post(worker.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_nul_bytes_and_astral_characters_are_just_text(worker):
    for path, body in (("/v1/completions", {"model": "tiny", "prompt": "a\u0000b \U0001F600", "max_tokens": 2,
                                            "stop": ["\u0000"]}),
                       ("/v1/chat/completions", {"model": "tiny", "max_tokens": 2,
                                                 "messages": [{"role": "user", "content": "\u0000\U0001F600"}]})):
        r = httpx.post(worker.url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text


def test_slow_clients_are_cut_off_and_others_served(worker):
    headers, bodies, served = slowloris_while_served(worker.url, 40)
    assert served == 200
    assert_cut_off(headers, bodies, 40)


def test_client_leaving_mid_body_is_not_a_server_error(worker):
    for _ in range(5):
        s = socket.create_connection((worker.url.removeprefix("http://").split(":")[0],
                                      int(worker.url.rsplit(":", 1)[1])))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 1000\r\n\r\n{\"prompt\": ")
        s.close()
    r = httpx.post(worker.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200
    assert "unhandled error" not in worker.output() and "Traceback" not in worker.output()
