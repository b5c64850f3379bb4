"""The router's Responses API, `/v1/models/{id}` and tool fields, in front of real `pdserve
worker` processes (tiny checkpoint, CPU, TCP KV transfer), called with the real `openai`
client. The router maps /v1/responses onto chat itself, so a Responses request takes the P/D
path (prefill worker, KV hand-off, decode worker) and must answer what one worker answers."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field


pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
GREEDY = dict(model="tiny", temperature=0, max_output_tokens=10)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
# Responses' flat function tool, its arguments bounded so a random model's forced call closes.
CITY_TOOL = {"type": "function", "name": "get_city", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    legs: int = Field(ge=0, le=8)


@pytest.fixture(scope="module")
def stack(module_launch, tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    prefill, decode = module_launch.real_pd_workers(ckpt, "--tool-call-parser", "hermes", "--enable-auto-tool-choice")
    # Every prompt is worth disaggregating: the Responses requests below take the P/D path.
    router = module_launch.router("--prefill", prefill.url, "--decode", decode.url,
                                  "--pd-min-prompt-tokens", "1")
    return prefill, decode, router


def _clients(stack):
    _, decode, router = stack
    return (openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=120),
            openai.OpenAI(base_url=decode.url + "/v1", api_key="x", max_retries=0, timeout=120))


def _pd_requests(router) -> float:
    """How many requests the router has disaggregated so far (its own counter)."""
    total = 0.0
    for line in httpx.get(router.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("pdserve_router_requests_total{") and 'disaggregated="yes"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_responses_through_pd_equal_one_worker(stack):
    via_router, single = _clients(stack)
    before = _pd_requests(stack[2])
    got = via_router.responses.create(input=PROMPT, instructions="Be brief.", **GREEDY)
    want = single.responses.create(input=PROMPT, instructions="Be brief.", **GREEDY)
    assert _pd_requests(stack[2]) == before + 1  # it really went prefill → decode
    assert got.output_text == want.output_text and got.output_text
    assert got.status == want.status and got.usage.output_tokens == want.usage.output_tokens
    assert got.usage.input_tokens == want.usage.input_tokens


def test_streamed_responses_through_pd(stack):
    via_router, single = _clients(stack)
    want = single.responses.create(input=PROMPT, **GREEDY)
    events = list(via_router.responses.create(input=PROMPT, stream=True, **GREEDY))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == want.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == want.usage.output_tokens


def test_responses_errors_are_the_routers_own(stack):
    router = stack[2]
    r = httpx.post(router.url + "/v1/responses", json={"model": "tiny", "input": "x", "previous_response_id": "r"},
                   timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    r = httpx.post(router.url + "/v1/responses", json={"model": "nope", "input": "x"}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_model_by_id_on_the_router(stack):
    via_router, _ = _clients(stack)
    card = via_router.models.retrieve("tiny")
    assert card.id == "tiny" and card.owned_by == "pdserve"
    with pytest.raises(openai.NotFoundError) as e:
        via_router.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


def test_tool_requests_pass_through_and_are_not_disaggregated(stack):
    """Tools go to one decode worker whole (its parser reads the whole reply); the router
    refuses malformed tool fields itself, and answers whatever the worker answers."""
    via_router, single = _clients(stack)
    router = stack[2]
    r = httpx.post(router.url + "/v1/chat/completions", timeout=10, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    kw = dict(model="tiny", messages=[{"role": "user", "content": PROMPT}], tools=[WEATHER], temperature=0,
              max_tokens=8, extra_body={"ignore_eos": True})
    before = _pd_requests(router)
    got = via_router.chat.completions.create(**kw)
    want = single.chat.completions.create(**kw)
    assert _pd_requests(router) == before
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.choices[0].message.tool_calls == want.choices[0].message.tool_calls  # gibberish: none


def test_responses_parse_through_pd_equals_one_worker(stack):
    """text_format rides the P/D path (the grammar constrains the prefill's first token and the
    decode worker's rest) and parses into the same object one worker gives."""
    via_router, single = _clients(stack)
    kw = dict(model="tiny", input=PROMPT, text_format=Pet, max_output_tokens=80, temperature=0)
    before = _pd_requests(stack[2])
    got = via_router.responses.parse(**kw)
    assert _pd_requests(stack[2]) == before + 1
    want = single.responses.parse(**kw)
    assert isinstance(got.output_parsed, Pet) and got.output_parsed == want.output_parsed
    assert got.output_text == want.output_text


def test_responses_function_tools_through_the_router(stack):
    via_router, single = _clients(stack)
    kw = dict(model="tiny", input=PROMPT, tools=[CITY_TOOL], tool_choice="required", max_output_tokens=40,
              temperature=0)
    got = via_router.responses.create(**kw)
    want = single.responses.create(**kw)
    (call,) = [o for o in got.output if o.type == "function_call"]
    assert call.name == "get_city" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    assert [(o.name, o.arguments) for o in want.output if o.type == "function_call"] == [(call.name, call.arguments)]
    events = list(via_router.responses.create(**kw, stream=True))
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert (done.name, done.arguments) == (call.name, call.arguments)
