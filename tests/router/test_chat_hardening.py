"""Issue 44's chat rows through the router, in front of a real prefill and decode worker (tiny
checkpoint, CPU, TCP KV transfer, default flags): malformed tool-call history is refused by the
router itself (a 400 naming it) and, sent to the workers directly, by them; a client's chat
template is refused by default, by the worker the router passes it to; none of it counts
against a worker, so after many such requests a request is still served P/D and every worker is
routable; a 64 KiB X-Request-Id comes back cut, in the header and in every chunk."""

from __future__ import annotations

import json

import httpx
import pytest

from pdserve.protocol.contract import MAX_REQUEST_ID_CHARS
from tests.router.test_failures import eventually
from tests.worker.test_chat_hardening import BAD_TOOL_CALLS, TOOL_RESULT, USER, WEATHER

LONG_USER = {"role": "user", "content": "Tell me about foxes and dogs. " * 8}  # long enough to go P/D
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def stack(module_launch, tiny_checkpoint):
    prefill, decode = module_launch.real_pd_workers(tiny_checkpoint("llama"), "--max-model-len", "256",
                                                    "--kv-cache-memory", str(8 << 20))
    router = module_launch.router("--prefill", prefill.url, "--decode", decode.url)
    eventually(lambda: httpx.get(router.url + "/ready").status_code == 200, timeout_s=30)
    return prefill, decode, router


def chat(url: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 4, **body},
                      headers=headers, timeout=60)


def disaggregated(router) -> float:
    text = httpx.get(router.url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve_router_requests_total{") and 'disaggregated="yes"' in line)


def assert_workers_healthy_and_pd(router) -> None:
    workers = httpx.get(router.url + "/debug/workers", timeout=5).json()
    assert len(workers) == 2 and all(w["routable"] and w["consecutive_failures"] == 0 for w in workers), workers
    before = disaggregated(router)
    for stream in (False, True):
        assert chat(router.url, {"messages": [LONG_USER], "stream": stream}).status_code == 200
    assert disaggregated(router) == before + 2  # served P/D, both


@pytest.mark.parametrize("tool_calls,param", BAD_TOOL_CALLS.values(), ids=list(BAD_TOOL_CALLS))
def test_malformed_tool_call_history_is_400_from_router_and_workers(stack, tool_calls, param):
    prefill, decode, router = stack
    body = {"messages": [USER, {"role": "assistant", "tool_calls": tool_calls}, TOOL_RESULT], "tools": [WEATHER],
            "tool_choice": "none"}
    for url in (router.url, prefill.url, decode.url):
        for stream in (False, True):
            r = chat(url, {**body, "stream": stream})
            assert r.status_code == 400, (url, r.text)
            assert r.json()["error"]["param"] == param


def test_client_templates_are_refused_by_default(stack):
    prefill, decode, router = stack
    for body, param in (({"chat_template": TEMPLATE}, "chat_template"),
                        ({"chat_template_kwargs": {"chat_template": TEMPLATE}}, "chat_template_kwargs.chat_template")):
        for url in (router.url, decode.url):  # via the router (its worker refuses it) and directly
            for stream in (False, True):
                r = chat(url, {"messages": [LONG_USER], "stream": stream, **body})
                assert r.status_code == 400, (url, r.text)
                error = r.json()["error"]
                assert error["param"] == param and error["code"] == "untrusted_chat_template", error
                assert "--trust-request-chat-template" in error["message"]


def test_refused_requests_never_eject_a_worker(stack):
    """The router ejects a worker after 3 failures in a row: dozens of refused requests later,
    every worker is still routable and serves P/D."""
    _, _, router = stack
    for _ in range(4):
        for tool_calls, _param in BAD_TOOL_CALLS.values():
            body = {"messages": [USER, {"role": "assistant", "tool_calls": tool_calls}, TOOL_RESULT]}
            assert chat(router.url, body).status_code == 400
        assert chat(router.url, {"messages": [LONG_USER], "chat_template": TEMPLATE}).status_code == 400
    assert_workers_healthy_and_pd(router)


def test_a_64_kib_request_id_comes_back_cut(stack):
    _, _, router = stack
    rid = "r" * (64 * 1024)
    cut, bound = rid[:MAX_REQUEST_ID_CHARS], len("chatcmpl-") + MAX_REQUEST_ID_CHARS
    before = disaggregated(router)
    r = chat(router.url, {"messages": [LONG_USER]}, headers={"x-request-id": rid})
    assert r.status_code == 200 and r.headers["x-request-id"] == cut
    assert r.json()["id"] == "chatcmpl-" + cut
    with httpx.stream("POST", router.url + "/v1/chat/completions", headers={"x-request-id": rid}, timeout=60,
                      json={"model": "tiny", "max_tokens": 6, "stream": True, "messages": [LONG_USER]}) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == cut
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: {")]
    assert len(events) >= 2 and all(len(json.loads(e)["id"]) <= bound for e in events)
    # The first token's chunk comes from the prefill worker, the rest from the decode worker: both
    # were sent the cut id and name the response alike.
    assert {json.loads(e)["id"] for e in events} == {"chatcmpl-" + cut}
    assert disaggregated(router) == before + 2
    r = chat(router.url, {"messages": [USER], "tool_calls": 1, "n": "x"}, headers={"x-request-id": rid})
    assert r.status_code == 400 and r.headers["x-request-id"] == cut  # an error answer too
