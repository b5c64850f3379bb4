"""Every client error, over raw HTTP against a real `pdserve worker`: OpenAI's error shape, the
right status, the offending `param`, and nothing streamed or leaked."""

from __future__ import annotations

import httpx
import pytest

from tests.worker.test_server_harness import WorkerProcess

KEY = "sk-errors"
NAME = "tiny"
MAX_LEN = 64
LIMIT = 4096
AUTH = {"Authorization": f"Bearer {KEY}"}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def worker(tiny_checkpoint):
    with WorkerProcess(tiny_checkpoint("llama"), "--served-model-name", NAME, "--max-model-len", str(MAX_LEN),
                       "--api-key", KEY, "--max-request-bytes", str(LIMIT), "--kv-cache-memory", str(8 << 20)) as w:
        yield w


@pytest.fixture(scope="module")
def http(worker):
    with httpx.Client(base_url=worker.url, timeout=60) as c:
        yield c


def _check(r: httpx.Response, status: int, param=None, code=None, says=()):
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    for s in says:
        assert s in err["message"], err
    return err


# (path, body, status, param, code, words the message must contain)
# OpenAI's and vLLM's opening words: LiteLLM maps a 400 to its ContextWindowExceededError on them.
CTX = "This model's maximum context length is 64 tokens"

CASES = [
    (CMPL, {"prompt": "x", "temperature": 5}, 400, "temperature", None, ("temperature",)),
    (CMPL, {"prompt": "x", "temperature": "hot"}, 400, "temperature", None, ()),
    (CMPL, {"prompt": "x", "top_p": 0}, 400, "top_p", None, ()),
    (CMPL, {"prompt": "x", "top_k": -5}, 400, "top_k", None, ()),
    (CMPL, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None, ()),
    (CMPL, {"prompt": "x", "n": 0}, 400, "n", None, ()),
    (CMPL, {"prompt": "x", "logprobs": 50}, 400, "logprobs", None, ()),
    (CMPL, {"prompt": "x", "stop": [""]}, 400, "stop", None, ()),
    (CMPL, {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty", None, ("[-2, 2]",)),
    (CMPL, {"prompt": "x", "frequency_penalty": -3}, 400, "frequency_penalty", None, ()),
    (CMPL, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty", None, ()),
    (CMPL, {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias", None, ("[-100, 100]",)),
    (CMPL, {"prompt": "x", "logit_bias": {"five": 1}}, 400, "logit_bias", None, ("five",)),
    (CMPL, {"prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias", None, ("99999999",)),
    (CMPL, {"prompt": "x", "echo": True, "logprobs": 21}, 400, "logprobs", None, ()),
    (CMPL, {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", None, ()),
    (CMPL, {"max_tokens": 3}, 400, "prompt", None, ()),
    (CMPL, {"prompt": ""}, 400, "prompt", None, ("token",)),
    (CMPL, {"prompt": [1, 2, 10**9]}, 400, "prompt", None, ("1000000000",)),
    (CMPL, {"prompt": list(range(3, 103))}, 400, "prompt", "context_length_exceeded", (CTX, "100")),
    (CMPL, {"prompt": list(range(3, 33)), "max_tokens": 40}, 400, "max_tokens", "context_length_exceeded",
     (CTX, "70", "30", "40")),
    (CMPL, {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found", ("gpt-4", NAME)),
    (CMPL, {"prompt": "x", "stream": True, "temperature": -1}, 400, "temperature", None, ()),
    # Refused by the engine itself, still before the first byte of the stream.
    (CMPL, {"prompt": "x", "stream": True, "kv_transfer_params": {"first_token_id": 5}}, 400,
     "kv_transfer_params", None, ("kv_transfer_params",)),
    (CHAT, {}, 400, "messages", None, ()),
    (CHAT, {"messages": []}, 400, "messages", None, ()),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role", None, ()),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages.0.content.0", None, ("image_url",)),
    (CHAT, {"messages": [MSGS[0], {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}]},
     400, "messages.1.content.1", None, ("'text', a string",)),
    (CHAT, {"messages": MSGS, "top_logprobs": 2}, 400, "top_logprobs", None, ()),
    (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs", None,
     ("top_logprobs must be",)),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 0}, 400, "max_completion_tokens", None, ()),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function"}]}, 400, "tools.0.function", None, ()),
    # Tools without --enable-auto-tool-choice (this worker has none): "auto" is refused, naming the flag.
    (CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice", None,
     ("--enable-auto-tool-choice",)),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 80}]}, 400, "messages", "context_length_exceeded",
     (CTX,)),
    (CHAT, {"messages": MSGS, "model": "other", "stream": True}, 404, "model", "model_not_found", ()),
]


@pytest.mark.parametrize(
    "path,body,status,param,code,says", CASES, ids=[f"{c[0]}:{sorted(c[1])}-{c[3]}" for c in CASES]
)
def test_bad_request_values(http, path, body, status, param, code, says):
    _check(http.post(path, json=body, headers=AUTH), status, param, code, says)


@pytest.mark.parametrize("raw", [b'{"prompt": "x",', b"[1, 2]", b"", b"\xff\xfe"])
def test_malformed_json(http, raw):
    err = _check(http.post(CMPL, content=raw, headers={**AUTH, "content-type": "application/json"}), 400)
    assert "JSON" in err["message"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_api_key_required(http, headers):
    for path, body in ((CMPL, {"prompt": "x"}), (CHAT, {"messages": MSGS})):
        _check(http.post(path, json=body, headers=headers), 401, code="invalid_api_key")
    for path in ("/v1/models", "/metrics", "/debug/kv"):  # only /health is public on a keyed worker
        _check(http.get(path, headers=headers), 401, code="invalid_api_key")
    assert http.get("/health").status_code == 200  # probes carry no key


def test_body_too_large(http):
    big = {"prompt": "x" * (LIMIT + 10)}
    _check(http.post(CMPL, json=big, headers=AUTH), 413, code="request_too_large")

    def chunked():  # no Content-Length: the limit must hold while reading
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 1024
        yield b'"}'

    _check(http.post(CMPL, content=chunked(), headers={**AUTH, "content-type": "application/json"}), 413,
           code="request_too_large")


def test_unknown_route_and_method(http):
    _check(http.get("/v1/nope", headers=AUTH), 404)
    _check(http.get(CMPL, headers=AUTH), 405)


def test_errors_leak_nothing_and_server_stays_healthy(http):
    for path, body, *_ in CASES:
        http.post(path, json=body, headers=AUTH)
    kv = http.get("/debug/kv", headers=AUTH).json()
    assert kv["num_free_blocks"] == kv["num_total_blocks"] and kv["num_running"] == kv["num_waiting"] == 0
    r = http.post(CMPL, json={"prompt": "still fine", "max_tokens": 2}, headers=AUTH)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
