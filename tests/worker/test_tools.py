"""Tool calling: the parsers as units on crafted text (streamed in every split equals whole),
the tool_choice plan and templating, then the wiring through a real `pdserve worker` serving
the real default model (SmolLM2-135M-Instruct, greedy) with `--tool-call-parser hermes
--enable-auto-tool-choice`, called by the real `openai` client and by langchain-openai's
`bind_tools`.

A 135M model's choices are not ours to assert: the end-to-end tests force a call with a named
or `required` `tool_choice` (the reply opened at the prompt, the rest masked by the grammar
engine to the tool's schema, tool_parsers/plan.py) and check the protocol (tool_calls that
parse and satisfy the schema, streamed increments, finish_reason, tool results templated back).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from pdserve.protocol.errors import APIError
from pdserve.protocol.requests import ChatCompletionRequest
from pdserve.worker.server.chat import render_prompt
from pdserve.protocol.chat_render import ChatTemplates
from pdserve.worker.server.tool_parsers import PARSERS, get_parser
from pdserve.worker.server.tool_parsers.base import loads_lenient
from pdserve.worker.server.tool_parsers.plan import (StreamedCalls, ToolPlan, complete_message, plan_tools,
                                                     template_input)
from tests.worker.test_server_harness import WorkerProcess

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


# ---- parsers on crafted text -------------------------------------------------------------------

HERMES_CASES = [
    # (text, content, [(name, arguments)])
    ("just words", "just words", []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "",
     [("get_weather", {"city": "Paris"})]),
    ('Let me check.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", '
     '"arguments": {"x": [1, 2]}}</tool_call>', "Let me check.", [("a", {}), ("b", {"x": [1, 2]})]),
    ('<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"y": "}"}}]</tool_call>', "",
     [("a", {}), ("b", {"y": "}"})]),  # SmolLM2's list form
    ('<tool_call>{"name": "a", "arguments": "{\\"k\\": 1}"}</tool_call>', "", [("a", {"k": 1})]),
    ('<tool_call>{"name": "a", "arguments": {"k": 1}', "", [("a", {"k": 1})]),  # cut off: closed leniently
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),  # not a call: words as written
    ("a < b and <tool_ca", "a < b and <tool_ca", []),  # a held-back marker prefix comes out at the end
]


def _whole(parser, text):
    p = get_parser(parser).extract(text)
    return p.content, [(c.function.name, json.loads(c.function.arguments)) for c in p.calls]


def _streamed(parser, text, step):
    s = get_parser(parser).stream()
    content, calls = "", []
    for i in range(0, len(text), step):
        p = s.feed(text[i:i + step])
        content += p.content
        calls += p.calls
    p = s.finish()
    content += p.content
    calls += p.calls
    return content, [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_parser(text, content, calls):
    got_content, got_calls = _whole("hermes", text)
    assert got_calls == calls and got_content.strip() == content
    for step in (1, 2, 3, 7):  # streamed in any split: the same calls and the same content
        s_content, s_calls = _streamed("hermes", text, step)
        assert s_calls == calls and s_content.strip() == got_content.strip()


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"z": 2}}', "",
     [("a", {}), ("b", {"z": 2})]),
    ("The weather is fine.", "The weather is fine.", []),
    ('{"name": bad json', '{"name": bad json', []),  # looked like a call, was not
    ('  {"nothing": 1}', '  {"nothing": 1}', []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA_CASES)
def test_llama3_json_parser(text, content, calls):
    assert _whole("llama3_json", text) == (content, calls)
    for step in (1, 4):
        assert _streamed("llama3_json", text, step) == (content, calls)


def test_lenient_json_closes_only_missing_brackets():
    assert loads_lenient('{"a": {"b": [1, "]"') == {"a": {"b": [1, "]"]}}
    with pytest.raises(ValueError):
        loads_lenient('{"a": 1}}')


def test_forced_prefix_is_parsed_as_the_start_of_the_call():
    for name in PARSERS:
        parser = get_parser(name)
        plan = ToolPlan(parser, parser.forced_prefix("get_weather"), True, "get_weather", [WEATHER])
        tail = {"hermes": '{"city": "Oslo"}}\n</tool_call>', "openai": '{"city": "Oslo"}<|call|>'}.get(
            name, '{"city": "Oslo"}}')
        content, calls = complete_message(plan, tail)
        assert calls[0]["function"]["name"] == "get_weather"
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}


# ---- the tool_choice plan and templating ---------------------------------------------------------

def _request(**kw) -> ChatCompletionRequest:
    body = ChatCompletionRequest.model_validate({"messages": ASK, **kw})
    body.check_unsupported()
    return body


@pytest.mark.parametrize("kw,param", [
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),  # a choice without tools
    (dict(tools=[WEATHER, WEATHER]), "tools"),  # duplicate names
])
def test_bad_tool_requests_are_400(kw, param):
    with pytest.raises(APIError) as e:
        _request(**kw)
    assert e.value.status == 400 and e.value.param == param


def test_plan_follows_vllms_flag_rules():
    with pytest.raises(APIError, match="--enable-auto-tool-choice"):
        plan_tools(_request(tools=[WEATHER]), "hermes", auto_enabled=False)  # tools alone mean "auto"
    with pytest.raises(APIError, match="--tool-call-parser"):
        plan_tools(_request(tools=[WEATHER], tool_choice="required"), None, False)
    with pytest.raises(APIError) as e:
        plan_tools(_request(tools=[WEATHER], tool_choice="required", n=2), "hermes", False)
    assert e.value.param == "n"
    assert plan_tools(_request(tools=[WEATHER], tool_choice="none"), None, False).parser is None
    named = plan_tools(_request(tools=[WEATHER, TIME], tool_choice=NAMED), "hermes", False)
    assert named.required and [t["function"]["name"] for t in named.tools] == ["get_weather"]
    assert named.forced_prefix.endswith('"arguments": ')


def test_parallel_tool_calls_false_keeps_the_first_call():
    two = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call><tool_call>{"name": "get_time", ' \
          '"arguments": {}}</tool_call>'
    for parallel, names in ((True, ["get_weather", "get_time"]), (False, ["get_weather"])):
        plan = plan_tools(_request(tools=[WEATHER, TIME], parallel_tool_calls=parallel), "hermes", True)
        assert [c["function"]["name"] for c in complete_message(plan, two)[1]] == names
        streamed = StreamedCalls(plan)
        deltas = [d for ch in two for d in streamed.feed(ch, False)[1]] + streamed.feed("", True)[1]
        assert [d["function"]["name"] for d in deltas if "id" in d] == names


def test_forced_choices_carry_the_grammar_of_the_call():
    """What the grammar admits after the forced prefix (the call's JSON, then EOS: no closing
    tag) parses as the call, for every parser; the grammar is the tool's parameters (named) or
    one call object naming an offered tool with the parser's arguments key (required)."""
    for name in PARSERS:
        parser = get_parser(name)
        named = plan_tools(_request(tools=[WEATHER, TIME], tool_choice=NAMED), name, False)
        assert (named.grammar.kind, named.grammar.param) == ("json", "tool_choice")
        assert json.loads(named.grammar.value) == WEATHER["function"]["parameters"]
        assert complete_message(named, '{"city": "Oslo"}')[1][0]["function"]["name"] == "get_weather"
        if not parser.forces_any_tool:  # harmony names the tool in its header: named only (test_harmony.py)
            continue
        required = plan_tools(_request(tools=[WEATHER, TIME], tool_choice="required"), name, False)
        options = json.loads(required.grammar.value)["anyOf"]
        assert [o["properties"]["name"] for o in options] == [{"const": "get_weather"}, {"const": "get_time"}]
        assert all(o["required"] == ["name", parser.arguments_key] for o in options)
        _, calls = complete_message(required, json.dumps({"name": "get_time", parser.arguments_key: {}}))
        assert calls[0]["function"]["name"] == "get_time" and calls[0]["function"]["arguments"] == "{}"
    assert plan_tools(_request(tools=[WEATHER]), "hermes", True).grammar is None  # auto: the model decides


def test_a_missed_forced_call_is_an_error_not_content():
    plan = plan_tools(_request(tools=[WEATHER], tool_choice="required"), "hermes", False)
    with pytest.raises(APIError) as e:
        complete_message(plan, "I will not.")
    assert e.value.code == "tool_call_invalid"
    with pytest.raises(APIError, match="get_time"):  # a call of a tool that was not offered
        complete_message(plan, '{"name": "get_time", "arguments": {}}</tool_call>')


HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def test_tools_templated_for_a_template_that_knows_them():
    plan = plan_tools(_request(tools=[WEATHER]), "hermes", True)
    msgs, kwargs = template_input([dict(m) for m in HISTORY], plan, "{% for t in tools %}{% endfor %}", None)
    assert kwargs == {"tools": [WEATHER]}
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # transformers' convention
    assert msgs[2] == HISTORY[2]


def test_tools_and_history_rendered_for_smollm2s_template(default_model_dir):
    """SmolLM2's template ignores `tools`: the parser's format is rendered instead."""
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    assert "tools" not in tok.chat_template
    templates = ChatTemplates(tok, 2048, 1 << 20, 10.0, trust_requests=False)
    body = _request(messages=HISTORY, tools=[WEATHER])
    text = tok.decode(render_prompt(templates, body, plan_tools(body, "hermes", True), "hermes"))
    assert "<tools>" in text and '"get_weather"' in text  # the offered tool, in a system turn
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    forced = _request(messages=ASK, tools=[WEATHER], tool_choice=NAMED)
    text = tok.decode(render_prompt(templates, forced, plan_tools(forced, "hermes", True), "hermes"))
    assert text.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ')


# ---- through a real worker --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def worker(default_model_dir):
    with WorkerProcess(default_model_dir, "--served-model-name", "smol", "--max-model-len", "2048",
                       "--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--log-level", "warning") as w:
        yield w


@pytest.fixture(scope="module")
def client(worker):
    return openai.OpenAI(base_url=f"{worker.url}/v1", api_key="x", max_retries=0, timeout=120)


GREEDY = dict(model="smol", temperature=0, max_tokens=60)


def test_named_tool_choice_returns_tool_calls(client):
    r = client.chat.completions.create(messages=ASK, tools=[WEATHER, TIME], tool_choice=NAMED, **GREEDY)
    choice = r.choices[0]
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments), dict)
    assert choice.finish_reason in ("tool_calls", "length")


def test_streamed_tool_calls_have_openais_incremental_shape(client):
    whole = client.chat.completions.create(messages=ASK, tools=[WEATHER], tool_choice=NAMED, **GREEDY)
    chunks = list(client.chat.completions.create(messages=ASK, tools=[WEATHER], tool_choice=NAMED, stream=True,
                                                 **GREEDY))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather"
    assert rest and all(d.id is None and d.function.name is None and d.index == 0 for d in rest)
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert arguments == whole.choices[0].message.tool_calls[0].function.arguments
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (content.strip() or None) == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tools", [[WEATHER], [TIME, WEATHER]])
def test_required_always_gives_a_call_of_an_offered_tool(client, tools, stream):
    """The grammar makes the call: an offered tool, arguments with the schema's required keys."""
    kw = dict(messages=ASK, tools=tools, tool_choice="required", **GREEDY)
    if stream:
        deltas = [d for c in client.chat.completions.create(stream=True, **kw) if c.choices
                  for d in c.choices[0].delta.tool_calls or []]
        name, arguments = deltas[0].function.name, "".join(d.function.arguments or "" for d in deltas)
    else:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls"
        (call,) = r.choices[0].message.tool_calls
        name, arguments = call.function.name, call.function.arguments
    assert name in {t["function"]["name"] for t in tools}
    if name == "get_weather":
        assert isinstance(json.loads(arguments)["city"], str)


def test_auto_and_none_without_a_call_are_plain_content(client):
    plain = client.chat.completions.create(messages=ASK, **GREEDY)
    none = client.chat.completions.create(messages=ASK, tools=[WEATHER], tool_choice="none", **GREEDY)
    assert none.choices[0].message.content == plain.choices[0].message.content  # no tools in the prompt
    assert none.choices[0].message.tool_calls is None
    auto = client.chat.completions.create(messages=ASK, tools=[WEATHER], **GREEDY)
    msg = auto.choices[0].message
    if msg.tool_calls is None:  # the model answered in words: they come back whole
        assert msg.content and "<tool_call>" not in msg.content and auto.choices[0].finish_reason != "tool_calls"


def test_tool_results_in_history_are_accepted(client):
    r = client.chat.completions.create(messages=HISTORY, tools=[WEATHER], tool_choice="none", **GREEDY)
    assert r.choices[0].message.content and r.usage.prompt_tokens > 40


def test_bad_tool_requests_over_http(worker):
    url = f"{worker.url}/v1/chat/completions"
    bad = {"model": "smol", "messages": ASK, "tools": [{"type": "function", "function": {"name": "has space"}}]}
    r = httpx.post(url, json=bad, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tools")
    r = httpx.post(url, json={"model": "smol", "messages": ASK, "tool_choice": "sometimes"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tool_choice")


def test_langchain_bind_tools_round_trip(worker):
    """langchain builds the request and reads tool_calls; its ToolMessage goes back templated."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "18 C, sunny"

    llm = ChatOpenAI(model="smol", base_url=f"{worker.url}/v1", api_key="x", temperature=0, max_tokens=60,
                     max_retries=0)
    forced = llm.bind_tools([get_weather], tool_choice="get_weather")
    history = [HumanMessage("What is the weather in Paris?")]
    ai = forced.invoke(history)
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"], dict) and call["id"].startswith("call_")
    history += [ai, ToolMessage(get_weather.invoke({"city": "Paris"}), tool_call_id=call["id"])]
    final = llm.bind_tools([get_weather], tool_choice="none").invoke(history)
    assert isinstance(final.content, str) and final.content and not final.tool_calls
    streamed = list(forced.stream(history[:1]))  # langchain's own chunk merging of streamed calls
    merged = streamed[0]
    for chunk in streamed[1:]:
        merged += chunk
    assert [c["name"] for c in merged.tool_calls] == ["get_weather"]


def test_langchain_structured_output_by_function_calling(worker):
    """with_structured_output(method="function_calling") is a named tool_choice of the schema's
    tool: the grammar makes its arguments validate, so langchain hands back the pydantic object.
    strict=True sends additionalProperties: false; without it the schema admits any extra key,
    and this 135M model, greedy, keeps inventing keys until max_tokens."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int

    llm = ChatOpenAI(model="smol", base_url=f"{worker.url}/v1", api_key="x", temperature=0, max_tokens=60,
                     max_retries=0)
    person = llm.with_structured_output(Person, method="function_calling", strict=True).invoke("Alice is 30 years old.")
    assert isinstance(person, Person)
    raw = llm.with_structured_output(Person, method="function_calling", strict=True, include_raw=True).invoke(
        "Bob is 41.")
    assert raw["parsing_error"] is None and raw["raw"].tool_calls[0]["name"] == "Person"
