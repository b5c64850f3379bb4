"""The worker's OpenAI server with --async-scheduling answers exactly as without it: two real
`pdserve worker` processes over the same tiny checkpoint, the real `openai` client, the same
requests (completions and chat, streamed and not, n, seeds, logprobs, stop strings, concurrent
requests; stop token ids are covered by test_async_scheduling.py); everything but ids and
timestamps must be equal."""

from __future__ import annotations

import concurrent.futures
import re

import openai
import pytest

from tests.worker.test_server_harness import WorkerProcess

NAME = "tiny-llama"
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def clients(tiny_checkpoint):
    args = ("--served-model-name", NAME, "--max-model-len", "256", "--kv-cache-memory", str(32 << 20))
    with WorkerProcess(tiny_checkpoint("llama"), *args) as sync, \
            WorkerProcess(tiny_checkpoint("llama"), *args, "--async-scheduling") as asyn:
        assert "async scheduling on" in asyn.output() and "async scheduling on" not in sync.output()
        yield [openai.OpenAI(base_url=f"{w.url}/v1", api_key="unused", max_retries=0, timeout=120)
               for w in (sync, asyn)]


def _answer(r) -> dict:
    """A response without what differs between two servers (ids, timestamps, fingerprints)."""
    d = r.model_dump()
    for key in ("id", "created", "system_fingerprint"):
        d.pop(key, None)
    return d


def _both(clients, call) -> tuple:
    a, b = (call(c) for c in clients)
    return a, b


REQUESTS = {
    "greedy": lambda c: c.completions.create(model=NAME, prompt="Hello world", max_tokens=12, **GREEDY),
    "n-seeded": lambda c: c.completions.create(model=NAME, prompt="Seeded", max_tokens=10, n=3, temperature=1.0,
                                               seed=1234),
    "logprobs": lambda c: c.completions.create(model=NAME, prompt="Hello", max_tokens=6, logprobs=3, **GREEDY),
    "chat": lambda c: c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Tell me."}],
                                                max_tokens=9, logprobs=True, top_logprobs=2, **GREEDY),
    "echo-penalty": lambda c: c.completions.create(model=NAME, prompt="Again and again", max_tokens=8, echo=True,
                                                   presence_penalty=1.0, **GREEDY),
}


@pytest.mark.parametrize("name", list(REQUESTS))
def test_same_answers(clients, name):
    a, b = _both(clients, REQUESTS[name])
    assert _answer(a) == _answer(b)


def test_stop_strings(clients):
    sync, asyn = clients
    text = sync.completions.create(model=NAME, prompt="The list:", max_tokens=24, **GREEDY).choices[0].text
    stop = re.findall(r"\w{3,}", text[len(text) // 3:])[0]
    for c_kwargs in (dict(stop=[stop, "zzzz-never"]), dict(stop=stop, stream=True)):
        a, b = (c.completions.create(model=NAME, prompt="The list:", max_tokens=24, **GREEDY, **c_kwargs)
                for c in clients)
        if c_kwargs.get("stream"):
            a, b = ([_answer(x) for x in s] for s in (a, b))
            assert a == b and a[-1]["choices"][0]["finish_reason"] == "stop"
        else:
            assert _answer(a) == _answer(b) and a.choices[0].finish_reason == "stop"
            assert a.choices[0].text == text[: text.index(stop)]


def test_concurrent_streams(clients):
    prompts = [f"Story {i}: once" * (1 + i % 3) for i in range(6)]

    def run(c):
        def one(i):
            chunks = list(c.completions.create(model=NAME, prompt=prompts[i], max_tokens=6 + i, stream=True,
                                          stream_options={"include_usage": True}, temperature=0.8, seed=i,
                                          extra_body={"ignore_eos": True}))
            return "".join(x.choices[0].text for x in chunks if x.choices), [x.usage for x in chunks][-1]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            return list(pool.map(one, range(6)))

    a, b = _both(clients, run)
    assert a == b
    assert [u.completion_tokens for _, u in a] == [6 + i for i in range(6)]
