"""The worker's OpenAI API driven by the real `openai` client against a real `pdserve worker`
process serving the tiny random Llama checkpoint (its text is gibberish; shapes and
consistency are what is checked)."""

from __future__ import annotations

import json
import os
import re

import httpx
import openai
import pytest

from tests.net import free_port
from tests.worker.test_server_harness import WorkerProcess

KEY = "sk-test-key"
NAME = "tiny-llama"
MAX_LEN = 256
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def worker(tiny_checkpoint):
    with WorkerProcess(tiny_checkpoint("llama"), "--served-model-name", NAME, "--max-model-len", str(MAX_LEN),
                       "--api-key", KEY, "--kv-cache-memory", str(32 << 20), "--kv-pin-ttl", "600",
                       # A KV side channel, so this one worker can play both P/D halves.
                       "--kv-transfer", "tcp", "--kv-host", "127.0.0.1", "--kv-port", str(free_port()),
                       "--kv-peer-allow", "127.0.0.1") as w:
        yield w


@pytest.fixture(scope="module")
def client(worker):
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def _messages(text="Tell me about Paris."):
    return [{"role": "user", "content": text}]


def test_completion_non_stream(client, worker):
    r = client.completions.create(model=NAME, prompt="Hello world", max_tokens=8, **GREEDY)
    assert r.object == "text_completion" and r.model == NAME and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert r.usage.prompt_tokens == 2 and r.usage.completion_tokens == 8 and r.usage.total_tokens == 10


def test_completion_stream_equals_non_stream(client):
    full = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=12, **GREEDY)
    chunks = list(client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_non_stream_and_stream_agree(client):
    full = client.chat.completions.create(model=NAME, messages=_messages(), max_tokens=10, **GREEDY)
    msg = full.choices[0].message
    assert full.object == "chat.completion" and msg.role == "assistant" and msg.content
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model=NAME, messages=_messages(), max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_stream_wire_format(worker):
    body = {"model": NAME, "messages": _messages(), "max_tokens": 4, "stream": True, "temperature": 0}
    r = httpx.post(
        f"{worker.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    data = [json.loads(e[6:]) for e in events[:-1]]
    assert data[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert data[-1]["choices"][0]["delta"] == {} and data[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert len({d["id"] for d in data}) == 1 and all(d["object"] == "chat.completion.chunk" for d in data)


def test_n_choices_and_multiple_prompts(client):
    r = client.completions.create(model=NAME, prompt=["First prompt", "Second one here"], n=2, max_tokens=5,
                                  temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 20 and r.usage.prompt_tokens == 2 + 3
    chunks = list(client.chat.completions.create(model=NAME, messages=_messages(), n=3, max_tokens=4, stream=True,
                                                 temperature=1.0, seed=1, extra_body={"ignore_eos": True}))
    for i in range(3):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"


def test_seed_reproduces_sampling(client):
    a, b = (client.completions.create(model=NAME, prompt="Seeded", max_tokens=10, temperature=1.0, seed=1234)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text


def test_completion_logprobs(client):
    r = client.completions.create(model=NAME, prompt="Hello", max_tokens=6, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the best


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=NAME, messages=_messages(), max_tokens=5, logprobs=True,
                                       top_logprobs=2, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for tok in content:
        assert len(tok.top_logprobs) == 2 and tok.logprob == pytest.approx(tok.top_logprobs[0].logprob, abs=1e-4)
        assert bytes(tok.bytes).decode("utf-8", "replace") == tok.token


def test_stop_string_truncates(client):
    text = client.completions.create(model=NAME, prompt="The list:", max_tokens=24, **GREEDY).choices[0].text
    words = re.findall(r"\w{3,}", text[len(text) // 3:])
    assert words, text
    stop = words[0]
    expected = text[: text.index(stop)]
    r = client.completions.create(model=NAME, prompt="The list:", max_tokens=24, stop=[stop, "zzzz-never"], **GREEDY)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=NAME, prompt="The list:", max_tokens=24, stop=stop, stream=True,
                                              **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_prefill_then_decode_handshake(client, worker):
    """The P/D contract on one worker: a prefill answer carries kv_transfer_params and the first
    token's text; the decode request returns only the rest, with usage for the whole request."""
    plain = client.completions.create(model=NAME, prompt="Disaggregate me", max_tokens=8, **GREEDY)
    pre = client.completions.create(model=NAME, prompt="Disaggregate me", max_tokens=1, temperature=0,
                                    extra_body={"ignore_eos": True, "kv_transfer_params": {"do_remote_decode": True}})
    kv = pre.model_extra["kv_transfer_params"]
    assert kv["first_token_id"] >= 0 and pre.usage.completion_tokens == 1
    assert httpx.get(f"{worker.url}/debug/kv", headers=worker.headers).json()["num_pinned_blocks"] >= 1
    dec = client.completions.create(model=NAME, prompt="Disaggregate me", max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True, "kv_transfer_params": kv})
    assert pre.choices[0].text + dec.choices[0].text == plain.choices[0].text
    assert dec.usage.completion_tokens == 8 and dec.usage.prompt_tokens == plain.usage.prompt_tokens
    chunks = list(client.chat.completions.create(model=NAME, messages=_messages(), max_tokens=6, stream=True, **GREEDY))
    chat_plain = "".join(c.choices[0].delta.content or "" for c in chunks)
    pre = client.chat.completions.create(
        model=NAME,
        messages=_messages(),
        max_tokens=1,
        temperature=0,
        extra_body={"ignore_eos": True, "kv_transfer_params": {"do_remote_decode": True}},
    )
    chunks = list(client.chat.completions.create(
        model=NAME, messages=_messages(), max_tokens=6, stream=True, temperature=0,
        extra_body={"ignore_eos": True, "kv_transfer_params": pre.model_extra["kv_transfer_params"]}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert pre.choices[0].message.content + "".join(c.choices[0].delta.content or "" for c in chunks) == chat_plain


def test_models_health_and_metrics(client, worker, tiny_checkpoint):
    (card,) = client.models.list().data
    assert card.id == NAME and card.model_extra["max_model_len"] == MAX_LEN
    assert card.model_extra["root"] == os.path.abspath(tiny_checkpoint("llama"))  # vLLM's: what was loaded
    assert httpx.get(f"{worker.url}/health").status_code == 200
    client.completions.create(model=NAME, prompt="count me", max_tokens=3, **GREEDY)
    text = httpx.get(f"{worker.url}/metrics", headers=worker.headers).text
    label = f'model_name="{NAME}"'
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count"):
        assert re.search(rf"^{re.escape(name)}\{{{label}\}} ", text, re.M), name

    def value(pattern):
        return float(re.search(rf"^{pattern} (\S+)$", text, re.M).group(1))

    assert value(r'vllm:request_success_total\{finished_reason="length",' + label + r"\}") >= 1
    assert value(r"vllm:generation_tokens_total\{" + label + r"\}") >= 3
    assert value(r"vllm:time_to_first_token_seconds_count\{" + label + r"\}") >= 1
    kv = httpx.get(f"{worker.url}/debug/kv", headers=worker.headers).json()
    assert 0 <= kv["num_free_blocks"] <= kv["num_total_blocks"] and kv["num_total_blocks"] > 0


def test_x_request_id_names_the_response_and_may_repeat(client):
    # A router sends one id to prefill and decode; clients may reuse ids. Both must work.
    headers = {"X-Request-Id": "router-abc"}
    a = client.completions.create(model=NAME, prompt="Hello", max_tokens=2, extra_headers=headers, **GREEDY)
    b = client.completions.create(model=NAME, prompt="Hello", max_tokens=2, extra_headers=headers, **GREEDY)
    assert a.id == b.id == "cmpl-router-abc"  # vLLM's shape: {prefix}-{X-Request-Id}
