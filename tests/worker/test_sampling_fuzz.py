"""Every sampling and request field at extreme and malformed values, through a real worker
(issue 44, item 7): the answer is a 2xx or a 4xx in OpenAI's error shape, never a 5xx; the
engine never dies (its `/health` would turn 503); and `/health` answers within 1 s throughout.

The values are the ones that broke engines before, not random floats: a temperature below
vLLM's epsilon (1e-40: `logits / T` overflowed, the multinomial raised), token ids at and past
the vocabulary in `stop_token_ids` / `logit_bias` / `allowed_token_ids` / prompt ids (with
`min_tokens` > 0, so the sampler masks the stop ids: an id outside the logits raised there),
int64 and uint64 edges, NaN and infinity (Python's JSON reads `NaN` and `Infinity`), wrong types.
Each request draws a handful of fields, so combinations (min_tokens with stop ids, n with
logprobs, penalties with logit_bias) are tried, not only one field at a time.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.liveness import Liveness
from tests.worker.test_server_harness import WorkerProcess

pytestmark = pytest.mark.slow

MODEL = "tiny"
MAX_EXAMPLES = 150
VOCAB = 49152  # the tiny checkpoint's tokenizer (SmolLM2's); the model's logits are as wide

_BIG_INTS = [2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**64 + 1, -(2**63), -(2**63) - 1, 10**30]
INTS = st.sampled_from([0, 1, -1, 2, 5, 20, 21, 128, 129, 1000, VOCAB - 1, VOCAB, VOCAB + 1, 10**9, *_BIG_INTS])
FLOATS = st.sampled_from([0.0, -0.0, 1e-40, 1e-300, 5e-6, 1e-5, 0.5, 1.0, 2.0, 2.0000001, 100.0, 1e4, 1e308,
                          -1e-40, -0.5, -2.0, -1e308, float("nan"), float("inf"), float("-inf")])
TOKEN_IDS = st.sampled_from([0, 1, 2, 100, VOCAB - 1, VOCAB, VOCAB + 1, 10**9, -1, -(2**63), 2**64])
WRONG = st.sampled_from(["1", "", "x" * 300, True, None, [], {}, [1, "a"], {"a": 1}, [[1]], 1.5])


def numbers(ints: bool) -> st.SearchStrategy:
    return st.one_of(INTS if ints else st.one_of(FLOATS, INTS), WRONG)


def token_lists() -> st.SearchStrategy:
    return st.one_of(st.lists(TOKEN_IDS, max_size=4), WRONG)


def logit_bias() -> st.SearchStrategy:
    keys = st.one_of(TOKEN_IDS.map(str), st.sampled_from(["x", "", "1.5", " 7", "٣"]))
    return st.one_of(st.dictionaries(keys, st.one_of(FLOATS, WRONG), max_size=3), WRONG)


def stops() -> st.SearchStrategy:
    texts = st.sampled_from(["", "\n", "the", "a" * 300, "\x00", "\U0001F600", "END"])
    return st.one_of(texts, st.lists(texts, max_size=5), WRONG)


# Every field the worker reads that decides what the engine computes.
FIELDS: dict[str, st.SearchStrategy] = {
    "temperature": numbers(False), "top_p": numbers(False), "top_k": numbers(True), "min_p": numbers(False),
    "seed": numbers(True), "n": numbers(True), "max_tokens": numbers(True), "min_tokens": numbers(True),
    "presence_penalty": numbers(False), "frequency_penalty": numbers(False),
    "repetition_penalty": numbers(False), "logit_bias": logit_bias(), "stop_token_ids": token_lists(),
    "allowed_token_ids": token_lists(), "bad_words": stops(), "stop": stops(),
    "ignore_eos": st.one_of(st.booleans(), WRONG), "include_stop_str_in_output": st.one_of(st.booleans(), WRONG),
    "skip_special_tokens": st.one_of(st.booleans(), WRONG), "stream": st.one_of(st.booleans(), WRONG),
    "stream_options": st.one_of(st.just({"include_usage": True}), WRONG), "user": st.one_of(st.just("u"), WRONG),
    "max_completion_tokens": numbers(True), "truncate_prompt_tokens": numbers(True),
}
COMPLETION_FIELDS = {"logprobs": numbers(True), "echo": st.one_of(st.booleans(), WRONG),
                     "prompt_logprobs": numbers(True), "best_of": numbers(True)}
CHAT_FIELDS = {"logprobs": st.one_of(st.booleans(), WRONG), "top_logprobs": numbers(True)}
PROMPTS = st.one_of(st.sampled_from(["Hello", "", " ", "a" * 2000]), st.lists(TOKEN_IDS, min_size=1, max_size=4),
                    st.lists(st.lists(TOKEN_IDS, min_size=1, max_size=3), min_size=1, max_size=3), WRONG)


@st.composite
def requests(draw) -> tuple[str, dict]:
    chat = draw(st.booleans())
    fields = {**FIELDS, **(CHAT_FIELDS if chat else COMPLETION_FIELDS)}
    names = draw(st.lists(st.sampled_from(sorted(fields)), max_size=6, unique=True))
    body = {"model": MODEL, "max_tokens": draw(st.integers(1, 6))}  # a valid request stays cheap...
    if chat:
        body["messages"] = [{"role": "user", "content": draw(st.sampled_from(["Hi", "", "x" * 500]))}]
    else:
        body["prompt"] = draw(PROMPTS)
    # ...min_tokens > 0 most of the time: only then does the sampler mask the stop ids.
    body["min_tokens"] = draw(st.sampled_from([0, 1, 1, 2]))
    for name in names:
        body[name] = draw(fields[name])
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


@pytest.fixture(scope="module")
def worker(tiny_checkpoint):
    with WorkerProcess(tiny_checkpoint("llama"), "--served-model-name", MODEL, "--max-model-len", "128",
                       "--log-level", "warning") as w:
        yield w


def check(status: int, body: bytes, stream: bool) -> None:
    assert status < 500, body[:2000]
    if status >= 400:
        error = json.loads(body)["error"]
        assert isinstance(error["message"], str) and error["message"] and error["type"], body[:2000]
        assert "Traceback" not in error["message"], body[:2000]
    elif stream:
        events = [line for line in body.decode().split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "data: [DONE]", body[-500:]


def test_extreme_and_malformed_fields_never_kill_or_stall_the_worker(worker):
    seen: dict[int, int] = {}
    with httpx.Client(timeout=60) as http, Liveness({"worker": worker.url}, {"worker": worker.proc.pid}) as live:
        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
                  phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
        @given(requests())
        def fuzz(request):
            path, body = request
            content = json.dumps(body).encode()  # NaN and Infinity as Python's JSON writes them
            with http.stream("POST", worker.url + path, content=content,
                             headers={"content-type": "application/json"}) as r:
                raw = r.read()
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            check(r.status_code, raw, body.get("stream") is True)

        fuzz()
    print("status counts:", sorted(seen.items()))
    live.assert_ok()
    assert worker.proc.poll() is None, worker.output()[-3000:]
    # Both sides of validation were reached, and the engine still serves.
    assert seen.get(200) and seen.get(400), seen
    ok = httpx.post(worker.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("stop", [["x"] * 33, ["y" * 2049, "z" * 2048]], ids=["33 strings", "4097 chars"])
def test_stop_strings_past_the_default_caps_are_400s(worker, stop):
    """--max-stop-strings (32) and --max-stop-chars (4,096): the issue's 26,000 x 300 characters
    never reach the matcher of a worker left at its defaults."""
    r = httpx.post(worker.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2,
                                                          "stop": stop})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
