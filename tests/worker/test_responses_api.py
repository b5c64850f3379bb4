"""The Responses API (`POST /v1/responses`) and `GET /v1/models/{id}` on a real `pdserve worker`
(tiny random Llama checkpoint), driven by the real `openai` client: the answer is the chat
answer of the same request, streamed or not, in Responses' shape and event sequence.

Structured output (`text.format`, `responses.parse(text_format=...)`) and function tools go
through chat's machinery: a random model writes garbage, so a parsed object that validates and
a `function_call` whose arguments fit the tool's schema show the grammar engine and the
tool-call parser at work (tool_choice "required" forces the call, tool_parsers/plan.py).
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.worker.test_server_harness import WorkerProcess

NAME = "tiny-llama"
GREEDY = dict(model=NAME, temperature=0, extra_body={"ignore_eos": True})
INSTRUCTIONS = "You answer briefly."
EVENTS = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
# Bounded fields, so a random model's constrained output always closes within the token limit.
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": CITY,
           "strict": True}
CLOCK = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {},
                                                               "additionalProperties": False}}


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    legs: int = Field(ge=0, le=8)
    tags: list[Literal["small", "loud"]] = Field(max_length=2)


@pytest.fixture(scope="module")
def worker(tiny_checkpoint):
    with WorkerProcess(tiny_checkpoint("llama"), "--served-model-name", NAME, "--max-model-len", "512",
                       "--kv-cache-memory", str(32 << 20), "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                       "--log-level", "warning") as w:
        yield w


@pytest.fixture(scope="module")
def client(worker):
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="x", max_retries=0, timeout=120)


def _chat_text(client, text: str, max_tokens: int) -> tuple[str, object]:
    r = client.chat.completions.create(messages=[{"role": "system", "content": INSTRUCTIONS},
                                                 {"role": "user", "content": text}], max_tokens=max_tokens, **GREEDY)
    return r.choices[0].message.content, r.usage


def test_responses_equals_chat(client):
    want, usage = _chat_text(client, "Tell me about Paris.", 9)
    r = client.responses.create(input="Tell me about Paris.", instructions=INSTRUCTIONS, max_output_tokens=9, **GREEDY)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == NAME
    assert r.output_text == want and want
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # it hit the limit
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert r.usage.total_tokens == usage.total_tokens


def test_message_items_and_text_parts(client):
    want, _ = _chat_text(client, "Hello there", 5)
    r = client.responses.create(input=[{"role": "system", "content": INSTRUCTIONS},
                                       {"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}],
                                max_output_tokens=5, **GREEDY)
    assert r.output_text == want


def test_streamed_events(client):
    whole = client.responses.create(input="Count to ten.", max_output_tokens=8, **GREEDY)
    events = list(client.responses.create(input="Count to ten.", max_output_tokens=8, stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:4] == EVENTS and kinds[-4:] == CLOSING + ["response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 8
    assert events[0].response.status == "in_progress"


def test_unsupported_fields_are_400(worker, client):
    url = f"{worker.url}/v1/responses"
    for body, param in [({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
                        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
                        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "web_search"}}, "tool_choice"),
                        ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input.0"),
                        ({"input": [{"type": "function_call", "name": "f"}]}, "input.0"),
                        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
                        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "p"}}},
                         "text.format.schema"),
                        ({}, "input")]:
        r = httpx.post(url, json={"model": NAME, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="other", input="x")


def test_model_by_id(client, worker):
    card = client.models.retrieve(NAME)
    assert card.id == NAME and card.object == "model" and card.max_model_len == 512
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


# ---- structured output and function tools ---------------------------------------------------------

def test_parse_text_format_returns_the_object(client):
    r = client.responses.parse(model=NAME, input="Describe a pet.", text_format=Pet, max_output_tokens=120,
                               temperature=0)
    assert r.status == "completed"
    assert isinstance(r.output_parsed, Pet)
    jsonschema.validate(json.loads(r.output_text), Pet.model_json_schema())
    # The same constraint as chat's response_format: the same text.
    chat = client.chat.completions.parse(model=NAME, messages=[{"role": "user", "content": "Describe a pet."}],
                                         response_format=Pet, max_tokens=120, temperature=0)
    assert r.output_text == chat.choices[0].message.content


def test_json_schema_format_streamed_equals_whole(client):
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
    whole = client.responses.create(model=NAME, input="Pick a city.", text=fmt, max_output_tokens=60, temperature=0)
    jsonschema.validate(json.loads(whole.output_text), CITY)
    events = list(client.responses.create(model=NAME, input="Pick a city.", text=fmt, max_output_tokens=60,
                                          temperature=0, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.text.format.type == "json_schema"


def test_required_tool_choice_returns_a_function_call(client):
    r = client.responses.create(model=NAME, input="What is the weather in Paris?", tools=[WEATHER, CLOCK],
                                tool_choice="required", max_output_tokens=60, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed"
    assert calls[0].name in ("get_weather", "get_time") and calls[0].call_id and calls[0].id.startswith("fc_")
    args = json.loads(calls[0].arguments)
    if calls[0].name == "get_weather":
        jsonschema.validate(args, CITY)
    assert r.tools[0].name == "get_weather" and r.tool_choice == "required"
    # Named: that tool, arguments fitting its schema.
    r = client.responses.create(model=NAME, input="Weather?", tools=[WEATHER, CLOCK],
                                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
                                temperature=0)
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), CITY)


def test_streamed_function_call_events(client):
    kw = dict(model=NAME, input="Weather?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
              max_output_tokens=60, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert added and kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.done")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (want,) = [o for o in whole.output if o.type == "function_call"]
    assert deltas == done.arguments == want.arguments and done.name == "get_weather"
    (got,) = [o for o in events[-1].response.output if o.type == "function_call"]
    assert events[-1].type == "response.completed" and (got.name, got.arguments) == (want.name, want.arguments)


def test_function_call_output_items_are_the_chat_tool_turns(client):
    """A call and its result sent back as Responses items prompt exactly as chat's assistant
    tool_calls and tool message do: the same greedy answer."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    r = client.responses.create(model=NAME, tools=[WEATHER], tool_choice="none", max_output_tokens=8,
                                temperature=0, extra_body={"ignore_eos": True}, input=[
                                    {"role": "user", "content": "Weather in Paris?"}, call,
                                    {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}])
    chat = client.chat.completions.create(
        model=NAME, tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}],
        tool_choice="none", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}, messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}])
    assert r.output_text == chat.choices[0].message.content and r.output_text
    assert r.usage.input_tokens == chat.usage.prompt_tokens
