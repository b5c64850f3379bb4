"""Issue 44's chat rows against one real `pdserve worker` (tiny checkpoint, CPU), run with
`--trust-request-chat-template` so a client's template is rendered: malformed tool-call history
and tools are 400s naming the param (never the worker's 500); a client's template is used, and
a pathological one is a bounded 400 while /health answers and RSS stays put; oversized template
variables are refused; a 64 KiB X-Request-Id is cut in every chunk's id. The router-side rows
(refusal by default, no ejection, the id via the router) are tests/router/test_chat_hardening.py."""

from __future__ import annotations

import json

import httpx
import pytest

from pdserve.protocol.contract import MAX_REQUEST_ID_CHARS
from tests.liveness import Liveness
from tests.worker.test_server_harness import WorkerProcess

USER = {"role": "user", "content": "What is the weather in Paris?"}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}

# A past assistant message's `tool_calls` (messages.1), each malformed: the param its 400 names.
BAD_TOOL_CALLS = {
    "list of int": ([1], "messages.1.tool_calls.0"),
    "string": ("abc", "messages.1.tool_calls"),
    "object": ({"a": 1}, "messages.1.tool_calls"),
    "list of list": ([[1]], "messages.1.tool_calls.0"),
    "null entry": ([None], "messages.1.tool_calls.0"),
    "no function": ([{"id": "call_1", "type": "function"}], "messages.1.tool_calls.0.function"),
    "function a string": ([{"function": "get_weather"}], "messages.1.tool_calls.0.function"),
    "no name": ([{"function": {"arguments": "{}"}}], "messages.1.tool_calls.0.function.name"),
    "name not a string": ([{"function": {"name": 7, "arguments": "{}"}}], "messages.1.tool_calls.0.function.name"),
    "arguments a number": ([{"function": {"name": "f", "arguments": 5}}], "messages.1.tool_calls.0.function.arguments"),
    "arguments a list": ([{"function": {"name": "f", "arguments": [1]}}], "messages.1.tool_calls.0.function.arguments"),
    "arguments not JSON": ([{"function": {"name": "f", "arguments": "{city: Paris"}}],
                           "messages.1.tool_calls.0.function.arguments"),
    "arguments JSON but no object": ([{"function": {"name": "f", "arguments": "[1, 2]"}}],
                                     "messages.1.tool_calls.0.function.arguments"),
    "arguments nested past the parser": ([{"function": {"name": "f", "arguments": "[" * 100_000 + "]" * 100_000}}],
                                         "messages.1.tool_calls.0.function.arguments"),
    "type not function": ([{"type": "code", "function": {"name": "f", "arguments": "{}"}}],
                          "messages.1.tool_calls.0.type"),
}
# Other malformed history and tools around them.
BAD_CHAT_SHAPES = {
    "message a number": ({"messages": [USER, 1]}, "messages.1"),
    "tool_call_id a list": ({"messages": [USER, {**TOOL_RESULT, "tool_call_id": [1]}]}, "messages.1.tool_call_id"),
    "name a number": ({"messages": [{**USER, "name": 5}]}, "messages.0.name"),
    "content part not text": ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                              "messages.0.content.0"),
    "tools a number": ({"messages": [USER], "tools": [1]}, "tools.0"),
    "tool without function": ({"messages": [USER], "tools": [{"type": "function"}]}, "tools.0.function"),
    "tool parameters a string": ({"messages": [USER], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": "x"}}]}, "tools.0.function.parameters"),
}
# The Responses API's history: a function_call item becomes a chat tool call.
BAD_RESPONSES_ITEMS = {
    "arguments not JSON": (
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"},
        "input.1.arguments",
    ),
    "arguments a list": (
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[]"},
        "input.1.arguments",
    ),
    "arguments an object": ({"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}, "input.1"),
    "no name": ({"type": "function_call", "call_id": "c", "arguments": "{}"}, "input.1"),
}

# Templates a client could send; with the flag on each must end as a 400, quickly and small.
PATHOLOGICAL_TEMPLATES = {
    "one huge string": "{{ 'x' * 10**9 }}",
    "a huge integer": "{{ 10 ** (10 ** 8) }}",
    "a huge range": "{% for i in range(10**9) %}{% endfor %}",
    "nested loops": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "doubling in a namespace": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                               "{% endfor %}{{ ns.s }}",
    "padding": "{{ 'x'.ljust(10**9) }}",
    "format width": "{{ '%1000000000s' % 'x' }}",
    "replace blow-up": "{{ ('x' * 1000).replace('x', 'y' * 1000)|replace('y', 'z' * 1000) }}",
    "output in a loop": "{% for i in range(99999) %}{% for j in range(99999) %}{{ 'abcdefgh' * 100 }}{% endfor %}"
                        "{% endfor %}",
    "a macro's output": "{% macro m() %}{% for i in range(99999) %}{{ 'a' * 1000 }}{% endfor %}{% endmacro %}"
                        "{% for i in range(99999) %}{% set x = m() %}{% endfor %}",
}
# What each may answer: over its time bound, or over the size any prompt of this model could have.
BOUNDED = ("chat_template_timeout", "chat_template_too_large")
TIMEOUT_S = 2.0
ID_CHARS = MAX_REQUEST_ID_CHARS - 28  # --max-request-id-chars, not the default: the flag is what cuts


@pytest.fixture(scope="module")
def worker(tiny_checkpoint):
    with WorkerProcess(tiny_checkpoint("llama"), "--served-model-name", "tiny", "--max-model-len", "256",
                       "--kv-cache-memory", str(8 << 20), "--trust-request-chat-template",
                       "--chat-template-timeout", str(TIMEOUT_S), "--max-request-id-chars", str(ID_CHARS),
                       "--log-level", "warning") as w:
        yield w


def chat(worker, body: dict, headers: dict | None = None, timeout: float = 60) -> httpx.Response:
    return httpx.post(worker.url + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, **body},
                      headers=headers, timeout=timeout)


def assert_400(r: httpx.Response, param: str, code: str | None = None) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


def assert_serves(worker) -> None:
    assert httpx.get(worker.url + "/health", timeout=5).status_code == 200
    assert chat(worker, {"messages": [USER]}).status_code == 200


@pytest.mark.parametrize("tool_calls,param", BAD_TOOL_CALLS.values(), ids=list(BAD_TOOL_CALLS))
def test_malformed_tool_call_history_is_400_naming_it(worker, tool_calls, param):
    for stream in (False, True):
        r = chat(worker, {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": tool_calls},
                                       TOOL_RESULT], "tools": [WEATHER], "tool_choice": "none", "stream": stream})
        assert_400(r, param)


@pytest.mark.parametrize("body,param", BAD_CHAT_SHAPES.values(), ids=list(BAD_CHAT_SHAPES))
def test_malformed_history_and_tools_are_400_naming_them(worker, body, param):
    assert_400(chat(worker, body), param)


@pytest.mark.parametrize("item,param", BAD_RESPONSES_ITEMS.values(), ids=list(BAD_RESPONSES_ITEMS))
def test_malformed_responses_function_calls_are_400_naming_them(worker, item, param):
    r = httpx.post(worker.url + "/v1/responses", json={"model": "tiny", "max_output_tokens": 2, "input": [
        {"type": "message", "role": "user", "content": "hi"}, item,
        {"type": "function_call_output", "call_id": "c", "output": "ok"}]}, timeout=60)
    assert_400(r, param)


def test_the_worker_still_serves_after_malformed_history(worker):
    assert_serves(worker)
    assert "Traceback" not in worker.output()


def test_a_trusted_client_template_is_rendered(worker):
    template = "{% for m in messages %}<<{{ m['role'] }}|{{ m['content'] }}|{{ flavour }}>>{% endfor %}"
    kwargs = {"flavour": "salty"}
    for body in ({"chat_template": template, "chat_template_kwargs": kwargs},
                 {"chat_template_kwargs": {**kwargs, "chat_template": template}}):
        r = httpx.post(worker.url + "/tokenize", json={"model": "tiny", "messages": [USER], **body}, timeout=60)
        assert r.status_code == 200, r.text
        text = httpx.post(worker.url + "/detokenize", json={"model": "tiny", "tokens": r.json()["tokens"]},
                          timeout=60).json()["prompt"]
        assert text == f"<<user|{USER['content']}|salty>>"
        assert chat(worker, {"messages": [USER], **body}).status_code == 200


def test_pathological_templates_are_bounded_400s(worker):
    """Sent as the issue sent them, in chat_template_kwargs (where transformers took a template)."""
    with Liveness({"worker": worker.url}, {"worker": worker.proc.pid}) as live:
        for name, template in PATHOLOGICAL_TEMPLATES.items():
            r = chat(worker, {"messages": [USER], "chat_template_kwargs": {"chat_template": template}})
            assert r.status_code == 400, (name, r.text)
            error = r.json()["error"]
            assert error["param"] == "chat_template_kwargs.chat_template" and error["code"] in BOUNDED, (name, error)
    live.assert_ok(rss_growth_mib=100)
    assert_serves(worker)


def test_template_variables_are_bounded(worker):
    r = chat(worker, {"messages": [USER], "chat_template_kwargs": {"notes": "x" * (100 * 1024)}})
    assert_400(r, "chat_template_kwargs")
    r = chat(worker, {"messages": [USER], "chat_template_kwargs": {"add_generation_prompt": False}})
    assert_400(r, "chat_template_kwargs")
    r = chat(worker, {"messages": [USER], "chat_template": "{{ x }}" * 10_000})
    assert_400(r, "chat_template")
    assert chat(worker, {"messages": [USER], "chat_template_kwargs": {"enable_thinking": False}}).status_code == 200


def test_a_64_kib_request_id_is_cut_in_every_chunk(worker):
    """Cut to --max-request-id-chars (this worker's: the router's test checks the default)."""
    rid = "r" * (64 * 1024)
    bound = len("chatcmpl-") + ID_CHARS
    r = chat(worker, {"messages": [USER]}, headers={"x-request-id": rid})
    assert r.status_code == 200 and len(r.json()["id"]) <= bound
    assert r.json()["id"] == "chatcmpl-" + rid[:ID_CHARS]  # the id's start still correlates
    with httpx.stream("POST", worker.url + "/v1/chat/completions", headers={"x-request-id": rid}, timeout=60,
                      json={"model": "tiny", "max_tokens": 4, "stream": True, "messages": [USER]}) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: {")]
    assert len(events) >= 2
    assert all(len(json.loads(e)["id"]) <= bound for e in events)
