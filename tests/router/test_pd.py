"""P/D orchestration through a real router process, called with the real `openai` client.

The workers here are tests/router/fake_worker.py processes implementing the worker contract
(deterministic text), standing in until the real worker serves the P/D handshake; what is
checked is the router's part: the handshake it sends, the first-token splice, usage assembly,
and that P/D output equals one worker's output, streamed and not.
"""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.router.test_failures import eventually

PROMPT = "the quick brown fox jumps over the lazy dog"
CHAT = [{"role": "user", "content": "tell me a story about a fox"}]


@pytest.fixture(scope="module")
def stack(module_launch):
    prefill = module_launch.fake_worker()
    decode = module_launch.fake_worker()
    single = module_launch.fake_worker()
    router = module_launch.router("--prefill", prefill.url, "--decode", decode.url)
    return prefill, decode, single, router


def clients(stack):
    _, _, single, router = stack
    return (openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0),
            openai.OpenAI(base_url=single.url + "/v1", api_key="x", max_retries=0))


def run(client, chat: bool, stream: bool, **kw):
    """(text, finish_reason, usage, number of role deltas) of one request."""
    if chat:
        kw = dict(model="tiny", messages=CHAT, max_tokens=6, **kw)
        if not stream:
            r = client.chat.completions.create(**kw)
            return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.model_dump(), 1
        text, finish, usage, roles = "", None, None, 0
        for c in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
            if c.usage:
                usage = c.usage.model_dump()
            for ch in c.choices:
                roles += ch.delta.role is not None
                text += ch.delta.content or ""
                finish = ch.finish_reason or finish
        return text, finish, usage, roles
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, **kw)
    if not stream:
        r = client.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.model_dump(), 0
    text, finish, usage = "", None, None
    for c in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if c.usage:
            usage = c.usage.model_dump()
        for ch in c.choices:
            text += ch.text
            finish = ch.finish_reason or finish
    return text, finish, usage, 0


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_pd_output_equals_single_worker(stack, chat, stream):
    prefill, decode, _, _ = stack
    via_router, direct = clients(stack)
    n_prefill, n_decode = len(prefill.requests()), len(decode.requests())
    got = run(via_router, chat, stream)
    want = run(direct, chat, stream)
    assert got == want  # text, finish reason, whole-request usage, one role delta
    assert got[0] and got[2]["completion_tokens"] == 6
    # The handshake: prefill saw max_tokens=1, no stream, do_remote_decode; decode saw the
    # original request plus exactly the params the prefill worker returned.
    (p,) = prefill.requests()[n_prefill:]
    (d,) = decode.requests()[n_decode:]
    assert p["body"]["max_tokens"] == 1 and p["body"]["stream"] is False
    assert p["body"]["kv_transfer_params"] == {"do_remote_decode": True, "decode_budget": {"max_tokens": 6},
                                               "stream_kv": True}
    assert "stream_options" not in p["body"]
    assert d["body"]["max_tokens"] == 6 and d["body"].get("stream", False) == stream
    assert d["body"]["kv_transfer_params"]["remote_url"] == prefill.url
    assert p["headers"]["x-request-id"] == d["headers"]["x-request-id"]
    assert prefill.kv()["num_pinned_blocks"] == 0  # decode released the prefill's blocks


def test_max_completion_tokens_is_capped_too(stack):
    prefill, _, _, _ = stack
    via_router, direct = clients(stack)
    n = len(prefill.requests())
    assert run(via_router, True, False, max_completion_tokens=5) == run(direct, True, False, max_completion_tokens=5)
    assert prefill.requests()[n]["body"]["max_completion_tokens"] == 1


def test_the_priority_reaches_both_legs(stack):
    """vLLM's `priority` goes to the prefill and the decode worker alike (their
    --scheduling-policy priority orders by it)."""
    prefill, decode, _, router = stack
    n_p, n_d = len(prefill.requests()), len(decode.requests())
    r = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4,
                                                         "temperature": 0, "priority": -3}, timeout=30)
    assert r.status_code == 200
    assert prefill.requests()[n_p]["body"]["priority"] == -3 and decode.requests()[n_d]["body"]["priority"] == -3


@pytest.mark.parametrize("kw", [{"n": 2}, {"max_tokens": 1}], ids=["n>1", "max_tokens=1"])
def test_not_disaggregated(stack, kw):
    prefill, decode, _, _ = stack
    via_router, _ = clients(stack)
    n_prefill = len(prefill.requests())
    via_router.completions.create(model="tiny", prompt=PROMPT, **{"max_tokens": 4, **kw})
    assert len(prefill.requests()) == n_prefill
    assert "kv_transfer_params" not in decode.requests()[-1]["body"]


def test_first_token_that_ends_the_request_skips_decode(stack):
    prefill, decode, _, _ = stack
    via_router, direct = clients(stack)
    n_decode = len(decode.requests())
    for stream in (False, True):
        kw = dict(model="tiny", prompt="STOP1 now", max_tokens=5)
        if stream:
            chunks = list(via_router.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            r = via_router.completions.create(**kw)
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        want = direct.completions.create(**kw)
        assert (text, finish) == (want.choices[0].text, "stop")
    # The streamed hand-off opened the decode call at the prefill's first line; the answer
    # closed it (maybe before the decode worker read it): what the decode worker got it aborted
    # without generating (after-prefill never calls it: test_handoff.py).
    rids = [r["headers"]["x-request-id"] for r in decode.requests()[n_decode:]]
    assert len(rids) <= 2
    eventually(lambda: {e["rid"] for e in decode.events() if e["event"] == "d_abort"} >= set(rids))
    assert prefill.kv()["num_pinned_blocks"] == 0


def test_short_prompts_go_straight_to_decode(launch):
    prefill, decode = launch.fake_worker(), launch.fake_worker()
    router = launch.router("--prefill", prefill.url, "--decode", decode.url, "--pd-min-prompt-tokens", "20")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    client.completions.create(model="tiny", prompt="short", max_tokens=3)
    assert prefill.requests() == []
    client.completions.create(model="tiny", prompt="long " * 100, max_tokens=3)
    assert len(prefill.requests()) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_client_gone_while_the_prefill_finishes_leaves_no_pin(launch, stream):
    """A prefill that finishes after its client left still pins KV (this fake, like a worker
    whose engine finished just then, does not notice the hang-up), and only its answer names
    the pin: the router lets the call finish (up to 2 s) and releases the pin at once, rather
    than leave it to the prefill's TTL (60 s here). (A prefill that answers in one JSON; a
    streamed hand-off's prefill is aborted by the hang-up: test_handoff.py.)"""
    prefill = launch.fake_worker("--prefill-delay", "0.5", "--pin-ttl", "60", "--json-prefill")
    decode = launch.fake_worker()
    router = launch.router("--prefill", prefill.url, "--decode", decode.url)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "stream": stream}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(router.url + "/v1/completions", json=body, timeout=0.2)
    assert [r["body"]["kv_transfer_params"]["do_remote_decode"] for r in prefill.requests()] == [True]
    eventually(lambda: prefill.kv()["num_pinned_blocks"] == 0 and prefill.kv()["num_free_blocks"] == 100,
               timeout_s=5)
    assert decode.requests() == []  # the hand-off was given up, not passed on
