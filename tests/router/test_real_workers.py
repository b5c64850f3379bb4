"""The router in front of real `pdserve worker` processes (tiny checkpoint, CPU, TCP KV transfer),
called with the real `openai` client: P/D output equals one worker's greedy output, streamed and
not; a client disconnect frees KV blocks on both workers; a killed prefill worker falls back
to local prefill on the decode worker. Every test runs against workers stepping synchronously
and against workers with --async-scheduling (their streamed hand-offs cut into 8-token chunks,
each launched before the one before is readable)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from pdserve.protocol.kv_transfer import prefill_request
from tests.router.test_failures import eventually

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
CHAT = [{"role": "user", "content": "Tell me about foxes and dogs."}]


ASYNC = ("--async-scheduling", "--kv-stream-chunk-tokens", "8", "--kv-stream-split", "even")


@pytest.fixture(scope="module", params=[(), ASYNC], ids=["sync", "async"])
def stack(request, module_launch, tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    prefill, decode = module_launch.real_pd_workers(ckpt, *request.param)
    router = module_launch.router("--prefill", prefill.url, "--decode", decode.url)
    return prefill, decode, router


def text_of(client, chat: bool, stream: bool) -> tuple[str, dict | None]:
    if chat:
        kw = dict(model="tiny", messages=CHAT, max_tokens=10, temperature=0)
        if stream:
            chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            usage = next((c.usage.model_dump() for c in chunks if c.usage), None)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), usage
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.usage.model_dump()
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    if stream:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        usage = next((c.usage.model_dump() for c in chunks if c.usage), None)
        return "".join(c.choices[0].text for c in chunks if c.choices), usage
    r = client.completions.create(**kw)
    return r.choices[0].text, r.usage.model_dump()


def no_leaks(*workers) -> bool:
    for w in workers:
        kv = w.kv()
        if kv["num_free_blocks"] != kv["num_total_blocks"] or kv["num_pinned_blocks"]:
            return False
    return True


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_pd_equals_single_worker_greedy(stack, chat, stream):
    prefill, decode, router = stack
    via_router = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    single = openai.OpenAI(base_url=decode.url + "/v1", api_key="x", max_retries=0)  # no kv params: local prefill
    got, got_usage = text_of(via_router, chat, stream)
    want, want_usage = text_of(single, chat, stream)
    assert got == want and got
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert got_usage[key] == want_usage[key]
    metrics = httpx.get(router.url + "/metrics").text
    assert 'disaggregated="yes"' in metrics
    eventually(lambda: no_leaks(prefill, decode))


def test_client_disconnect_frees_blocks_on_both_workers(stack):
    prefill, decode, router = stack
    body = {"model": "tiny", "prompt": PROMPT * 3, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 5:  # decoding on the decode worker: its blocks are in use
                assert decode.kv()["num_free_blocks"] < decode.kv()["num_total_blocks"]
                break
    eventually(lambda: no_leaks(prefill, decode), timeout_s=30)
    assert decode.kv()["num_running"] == 0


@pytest.mark.parametrize("route,body", [
    ("completions", {"prompt": PROMPT * 3}),
    ("chat/completions", {"messages": [{"role": "user", "content": PROMPT * 3}]}),
], ids=["completions", "chat"])
def test_a_client_gone_after_the_first_token_leaves_no_pin(stack, route, body):
    """The router streams the prefill's first token before it calls the decode worker: a client
    that leaves right then must not leave the prefill's KV pinned until the TTL (30 s here; the
    router releases it at once, since no decode worker has the params)."""
    prefill, decode, router = stack
    body = {"model": "tiny", "max_tokens": 500, "ignore_eos": True, "stream": True, **body}
    with httpx.stream("POST", f"{router.url}/v1/{route}", json=body, timeout=60) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))  # the first event, then hang up
    eventually(lambda: no_leaks(prefill, decode), timeout_s=10)


def test_kv_release_needs_the_transfer_token(stack):
    """POST /kv/release frees a pin only for a caller holding its params (the transfer token)."""
    prefill, _, _ = stack
    body = prefill_request({"model": "tiny", "prompt": PROMPT, "max_tokens": 50, "temperature": 0})
    params = httpx.post(prefill.url + "/v1/completions", json=body, timeout=60).json()["kv_transfer_params"]
    assert prefill.kv()["num_pinned_blocks"] > 0
    assert httpx.post(prefill.url + "/kv/release", json={**params, "transfer_token": "forged"}).status_code == 202
    assert httpx.post(prefill.url + "/kv/release", json={"remote_request_id": "x"}).status_code == 400
    time.sleep(1.0)  # two idle ticks of the engine loop: a forged release would have been applied
    assert prefill.kv()["num_pinned_blocks"] > 0
    assert httpx.post(prefill.url + "/kv/release", json=params).status_code == 202
    eventually(lambda: prefill.kv()["num_pinned_blocks"] == 0, timeout_s=5)


CTX = "context_length_exceeded"


@pytest.mark.parametrize("chat,budget,param,code", [
    (False, {"max_tokens": 10**6}, "max_tokens", CTX),
    (True, {"max_tokens": 10**6}, "max_tokens", CTX),
    (True, {"max_completion_tokens": 10**6}, "max_completion_tokens", CTX),
    (False, {"max_tokens": 4, "min_tokens": 8}, "min_tokens", None),
    (True, {"max_tokens": 4, "min_tokens": 8}, "min_tokens", None),
])
def test_what_the_decode_worker_would_refuse_pins_no_kv(stack, chat, budget, param, code):
    """The prefill leg carries the client's budget: a request the decode worker would refuse
    (context, min_tokens) is refused by the prefill worker before its KV is pinned (else the
    pin would wait for a decode that never comes, until its TTL), with the decode's error."""
    prefill, decode, router = stack
    route, body = ("chat/completions", {"messages": CHAT}) if chat else ("completions", {"prompt": PROMPT})
    body = {"model": "tiny", "temperature": 0, **body, **budget}
    direct = httpx.post(f"{prefill.url}/v1/{route}", json=prefill_request(body), timeout=60)  # the router's leg
    assert direct.status_code == 400, direct.text
    assert (direct.json()["error"]["param"], direct.json()["error"]["code"]) == (param, code)
    assert prefill.kv()["num_pinned_blocks"] == 0
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    create = client.chat.completions.create if chat else client.completions.create
    extra = {"min_tokens": body.pop("min_tokens")} if "min_tokens" in body else {}
    with pytest.raises(openai.BadRequestError) as e:
        create(**body, extra_body=extra)
    assert (e.value.body["param"], e.value.body["code"]) == (param, code)
    assert prefill.kv()["num_pinned_blocks"] == 0 and decode.kv()["num_running"] == 0


def test_killed_prefill_worker_falls_back_to_local_prefill(stack):
    prefill, decode, router = stack
    via_router = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    single = openai.OpenAI(base_url=decode.url + "/v1", api_key="x", max_retries=0)
    prefill.popen.kill()
    prefill.popen.wait()
    assert text_of(via_router, False, True)[0] == text_of(single, False, True)[0]
    eventually(lambda: httpx.get(router.url + "/ready").json()["prefill_workers"] == 0)
    assert text_of(via_router, True, False)[0] == text_of(single, True, False)[0]
