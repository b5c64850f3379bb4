"""gpt-oss's harmony chat and outputs (issue 46, item 4): `--reasoning-parser openai_gptoss` and
`--tool-call-parser openai`.

- The parser as a unit on crafted harmony text: whole == streamed in every split (one character
  at a time, and two pieces split at every position), cut short at every token boundary (what
  was generated survives).
- The detokenizer keeps the special tokens when asked (the chat layer asks, for these parsers).
- A harmony-style chat template renders system/developer/tools/`reasoning_effort` through the
  bounded sandbox, from chat_template_kwargs and from the top-level field.
- The server end to end with the real `openai` client: an in-process worker whose engine
  replays a scripted harmony answer through the real detokenizer (random weights write no
  harmony), reasoning + content + tool calls, streamed and not, and an answer cut by max_tokens.
- A real `pdserve worker` on a tiny gpt-oss whose tokenizer has harmony's tokens: a named
  tool_choice forces the call's header and the grammar its arguments.
- A tokenizer without harmony's tokens: exit 2 naming the flag.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import openai
import pytest

from pdserve.protocol.errors import APIError
from pdserve.protocol.requests import ChatCompletionRequest
from pdserve.worker.server.tool_parsers import get_parser
from pdserve.worker.server.tool_parsers.plan import ToolPlan, complete_reply, plan_tools
from tests.net import free_port

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

ANALYSIS = "<|channel|>analysis<|message|>User asks weather. Need tool.<|end|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris"}<|call|>')
FINAL = "<|start|>assistant<|channel|>final<|message|>It is 18 C and sunny in Paris.<|return|>"

# (text, reasoning, content, [(name, arguments)])
CASES = [
    (ANALYSIS + FINAL, "User asks weather. Need tool.", "It is 18 C and sunny in Paris.", []),
    (ANALYSIS + CALL, "User asks weather. Need tool.", "", [("get_weather", {"city": "Paris"})]),
    # the recipient in the role line, a preamble on commentary (content), two calls
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_time<|channel|>commentary "
     "json<|message|>{}<|call|>" + CALL, "", "Checking.", [("get_time", {}), ("get_weather", {"city": "Paris"})]),
    ("<|channel|>final<|message|>a <| b |> c<|return|>", "", "a <| b |> c", []),  # marker-like words stay
    ("no harmony at all", "", "no harmony at all", []),  # a model that ignores the format: its words
    # cut by max_tokens: the open analysis returns what it has; a call with closable JSON is a call
    ("<|channel|>analysis<|message|>half a thou", "half a thou", "", []),
    (ANALYSIS + '<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>{"city": "Par"',
     "User asks weather. Need tool.", "", [("get_weather", {"city": "Par"})]),
    (ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.f<|message|>not json<|call|>",
     "User asks weather. Need tool.", "not json", []),  # not a call after all: its words
]


def _result(parsed):
    return parsed.reasoning, parsed.content, [(c.function.name, json.loads(c.function.arguments))
                                              for c in parsed.calls]


def _streamed(pieces, calls=True):
    s = get_parser("openai").stream(calls)
    out = None
    for p in pieces:
        got = s.feed(p)
        out = got if out is None else (out.__iadd__(got))
    out += s.finish()
    return _result(out)


@pytest.mark.parametrize("text,reasoning,content,calls", CASES)
def test_harmony_parser_whole_and_streamed_in_every_split(text, reasoning, content, calls):
    assert _result(get_parser("openai").extract(text)) == (reasoning, content, calls)
    assert _streamed(list(text)) == (reasoning, content, calls)  # one character at a time
    for i in range(len(text) + 1):  # two pieces, split at every position
        assert _streamed([text[:i], text[i:]]) == (reasoning, content, calls), i


def _tokens(text: str) -> list[str]:
    """The text as a tokenizer would cut it: each special token whole, other text by character."""
    return [t for part in re.split(r"(<\|[a-z]+\|>)", text) if part
            for t in ([part] if re.fullmatch(r"<\|[a-z]+\|>", part) else list(part))]


def test_an_answer_cut_at_any_token_keeps_what_was_generated():
    text = ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Let me see. <|end|>" + FINAL
    full_reasoning, full_content, _ = _result(get_parser("openai").extract(text))
    toks = _tokens(text)
    for k in range(len(toks) + 1):
        reasoning, content, _ = _result(get_parser("openai").extract("".join(toks[:k])))
        assert full_reasoning.startswith(reasoning) and full_content.startswith(content), k
        assert "<|" not in reasoning + content


def test_without_tools_a_call_is_content_and_reasoning_stays_reasoning():
    plan = ToolPlan(get_parser("openai"), calls=False)
    content, calls, reasoning = complete_reply(plan, ANALYSIS + CALL)
    assert (content, calls, reasoning) == ('{"city": "Paris"}', None, "User asks weather. Need tool.")


def _request(**kw) -> ChatCompletionRequest:
    body = ChatCompletionRequest.model_validate({"messages": ASK, **kw})
    body.check_unsupported()
    return body


def test_forced_calls_open_the_harmony_header():
    named = plan_tools(_request(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                    "function": {"name": "get_weather"}}),
                       "openai", False)
    assert named.forced_prefix == "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    content, calls, _ = complete_reply(named, '{"city": "Oslo"}')  # what the grammar admits, then EOS
    assert calls[0]["function"]["name"] == "get_weather" and json.loads(calls[0]["function"]["arguments"]) == {
        "city": "Oslo"}
    one = plan_tools(_request(tools=[WEATHER], tool_choice="required"), "openai", False)
    assert one.forced_prefix == named.forced_prefix  # required over one tool: that tool's call
    with pytest.raises(APIError) as e:  # over several: the header names the tool, no grammar spans it
        plan_tools(_request(tools=[WEATHER, TIME], tool_choice="required"), "openai", False)
    assert e.value.param == "tool_choice"


# ---- a tokenizer and template with harmony's tokens ------------------------------------------------

HARMONY_SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]

# gpt-oss's template, reduced to what it renders from a request: the system message with the
# reasoning effort, the developer message (a system/developer turn's instructions and the tools),
# the turns, the generation prompt.
HARMONY_TEMPLATE = """\
{%- set reasoning_effort = reasoning_effort | default("medium") -%}
<|start|>system<|message|>You are ChatGPT.
Reasoning: {{ reasoning_effort }}

# Valid channels: analysis, commentary, final.<|end|>
{%- if messages[0].role in ("system", "developer") or tools -%}
<|start|>developer<|message|>
{%- if messages[0].role in ("system", "developer") %}# Instructions

{{ messages[0].content }}{% endif -%}
{%- if tools %}# Tools

namespace functions {
{% for t in tools %}// {{ t.function.description }}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{% endfor %}}{% endif %}<|end|>
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == "user" -%}<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == "assistant" -%}
{%- if m.tool_calls -%}{%- for c in m.tool_calls -%}<|start|>assistant to=functions.{{ c.function.name }}\
<|channel|>commentary json<|message|>{{ c.function.arguments | tojson }}<|call|>{%- endfor -%}
{%- else -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{%- endif -%}
{%- elif m.role == "tool" -%}<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>\
{{ m.content | tojson }}<|end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"""


@pytest.fixture(scope="module")
def harmony_tokenizer_dir(tmp_path_factory, default_model_dir):
    """SmolLM2's BPE tokenizer with harmony's special tokens added and the template above;
    `<|return|>` its EOS (gpt-oss's generation config also ends on `<|call|>`)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    tok.add_special_tokens({"additional_special_tokens": HARMONY_SPECIALS})
    tok.eos_token = "<|return|>"
    tok.chat_template = HARMONY_TEMPLATE
    out = tmp_path_factory.mktemp("harmony-tok")
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def harmony_tokenizer(harmony_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(harmony_tokenizer_dir)


def test_detokenizer_keeps_special_tokens_when_asked(harmony_tokenizer):
    from pdserve.worker.engine.detokenizer import IncrementalDetokenizer

    text = ANALYSIS + FINAL
    ids = harmony_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) < len(text) // 3  # the markers are single tokens
    kept = IncrementalDetokenizer(harmony_tokenizer, [1], skip_special_tokens=False)
    assert "".join(kept.update([t])[0] for t in ids) + kept.flush() == text
    skipped = IncrementalDetokenizer(harmony_tokenizer, [1])
    assert "<|" not in "".join(skipped.update([t])[0] for t in ids) + skipped.flush()


def test_harmony_template_renders_developer_tools_and_reasoning_effort(harmony_tokenizer):
    from pdserve.protocol.chat_render import ChatTemplates
    from pdserve.worker.server.chat import render_prompt

    templates = ChatTemplates(harmony_tokenizer, 2048, 1 << 20, 10.0, trust_requests=False)
    messages = [{"role": "developer", "content": "Answer briefly."}, *ASK]

    def render(**kw):
        body = _request(messages=messages, **kw)
        plan = plan_tools(body, "openai", True)
        return harmony_tokenizer.decode(render_prompt(templates, body, plan, "openai"))

    text = render(tools=[WEATHER], chat_template_kwargs={"reasoning_effort": "high"})
    assert "Reasoning: high" in text and "# Instructions\n\nAnswer briefly." in text
    assert 'type get_weather = (_: {"type": "object"' in text
    assert text.endswith("<|start|>user<|message|>What is the weather in Paris?<|end|><|start|>assistant")
    assert "Reasoning: low" in render(reasoning_effort="low")  # OpenAI's top-level field
    assert "Reasoning: high" in render(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"})
    assert "Reasoning: medium" in render()
    with pytest.raises(Exception):
        _request(reasoning_effort="extreme")


# ---- the server, end to end, with a scripted engine ---------------------------------------------------

class ScriptedEngine:
    """Replays `script` (harmony text, tokenized) one token per output through the real
    detokenizer with the request's skip_special_tokens; stops at EOS or `<|call|>` as gpt-oss
    does (finish "stop"), or at max_tokens ("length")."""

    max_model_len = 2048

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.script = ""
        self.seen_params = []
        self.stops = {tokenizer.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")}

    async def start(self):
        pass

    async def shutdown(self):
        pass

    def metrics_collectors(self):
        return []

    def stats(self):
        return None

    def abort(self, rid):
        pass

    async def generate(self, rid, prompt, params, kv_transfer_params=None):
        from pdserve.worker.engine.detokenizer import IncrementalDetokenizer
        from pdserve.worker.request.outputs import RequestOutput

        self.seen_params.append(params)
        ids = self.tokenizer.encode(self.script, add_special_tokens=False)
        detok = IncrementalDetokenizer(self.tokenizer, prompt, params.stop_strings,
                                       skip_special_tokens=params.skip_special_tokens)
        for n, t in enumerate(ids[:params.max_tokens], 1):
            done = t in self.stops or n == params.max_tokens
            text = detok.update([t])[0] + (detok.flush() if done else "")
            reason = ("stop" if t in self.stops else "length") if done else None
            yield RequestOutput(rid, [t], text=text, finished=done, finish_reason=reason,
                                num_prompt_tokens=len(prompt), num_output_tokens=n)
            await asyncio.sleep(0)
            if done:
                return


@pytest.fixture(scope="module")
def scripted(harmony_tokenizer):
    import uvicorn

    from pdserve.worker.server.app import build_app
    from pdserve.worker.server.config import ServerConfig

    engine = ScriptedEngine(harmony_tokenizer)
    port = free_port()
    config = ServerConfig(host="127.0.0.1", port=port, tool_call_parser="openai", reasoning_parser="openai_gptoss",
                          enable_auto_tool_choice=True)
    server = uvicorn.Server(uvicorn.Config(build_app(config, "gpt-oss", lambda: engine), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30)
    # /health answers 200 only once the engine is built (the app builds it off the event loop).
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the scripted worker never became healthy"
        time.sleep(0.05)
    try:
        yield engine, client
    finally:
        server.should_exit = True
        thread.join(10)


def _stream(client, **kw):
    chunks = list(client.chat.completions.create(model="gpt-oss", messages=ASK, stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls = [d for d in deltas for d in d.tool_calls or []]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return reasoning, content, calls, finish, deltas


def test_reasoning_and_content_with_the_openai_client(scripted):
    engine, client = scripted
    engine.script = ANALYSIS + FINAL
    r = client.chat.completions.create(model="gpt-oss", messages=ASK, max_tokens=200)
    msg = r.choices[0].message
    assert msg.reasoning_content == "User asks weather. Need tool."
    assert msg.content == "It is 18 C and sunny in Paris." and not msg.tool_calls
    assert r.choices[0].finish_reason == "stop"
    assert engine.seen_params[-1].skip_special_tokens is False
    reasoning, content, calls, finish, deltas = _stream(client, max_tokens=200)
    assert (reasoning, content, calls, finish) == (msg.reasoning_content, msg.content, [], ["stop"])
    assert sum(bool(getattr(d, "reasoning_content", None)) for d in deltas) > 1  # streamed as it comes


def test_tool_calls_with_the_openai_client(scripted):
    engine, client = scripted
    engine.script = ANALYSIS + CALL
    r = client.chat.completions.create(model="gpt-oss", messages=ASK, tools=[WEATHER], max_tokens=200)
    choice = r.choices[0]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_") and choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "User asks weather. Need tool." and not choice.message.content
    reasoning, content, calls, finish, _ = _stream(client, tools=[WEATHER], max_tokens=200)
    assert reasoning == choice.message.reasoning_content and content == "" and finish == ["tool_calls"]
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    assert "".join(c.function.arguments or "" for c in calls) == call.function.arguments


def test_an_answer_cut_mid_channel_returns_what_was_generated(scripted):
    engine, client = scripted
    engine.script = ANALYSIS + FINAL
    ids = engine.tokenizer.encode(engine.script, add_special_tokens=False)
    cut = len(engine.tokenizer.encode(ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is 18",
                                      add_special_tokens=False))
    assert cut < len(ids)
    r = client.chat.completions.create(model="gpt-oss", messages=ASK, max_tokens=cut)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length"
    assert msg.reasoning_content == "User asks weather. Need tool." and msg.content == "It is 18"
    reasoning, content, _, finish, _ = _stream(client, max_tokens=cut)
    assert (reasoning, content, finish) == (msg.reasoning_content, msg.content, ["length"])
    mid_thought = client.chat.completions.create(model="gpt-oss", messages=ASK, max_tokens=5)
    assert mid_thought.choices[0].finish_reason == "length"
    assert "User asks weather. Need tool.".startswith(mid_thought.choices[0].message.reasoning_content)
    assert mid_thought.choices[0].message.content == ""


# ---- start-up ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags,flag", [(["--reasoning-parser", "openai_gptoss"], "--reasoning-parser"),
                                        (["--tool-call-parser", "openai"], "--tool-call-parser")])
def test_a_tokenizer_without_harmony_tokens_exits_2_naming_the_flag(tmp_path, flags, flag, capsys):
    from pdserve.cli.main import main
    from tests.checkpoints import write_word_tokenizer

    write_word_tokenizer(tmp_path)
    assert main(["worker", "--model", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert flag in err and "<|channel|>" in err and "Traceback" not in err


def test_an_unknown_reasoning_parser_is_refused():
    from pdserve.protocol.flags import ConfigError
    from pdserve.worker.server.config import ServerConfig

    with pytest.raises(ConfigError, match="--reasoning-parser"):
        ServerConfig(reasoning_parser="deepseek_r1")


# ---- a real worker: tiny gpt-oss, harmony tokenizer, a forced call ----------------------------------------

@pytest.fixture(scope="module")
def gpt_oss_worker(tmp_path_factory, harmony_tokenizer_dir, harmony_tokenizer):
    from tests.checkpoints import write_checkpoint
    from tests.worker.test_server_harness import WorkerProcess

    eos = [harmony_tokenizer.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")]
    ckpt = write_checkpoint(tmp_path_factory.mktemp("gpt-oss-harmony"), "gpt-oss", harmony_tokenizer_dir,
                            eos_token_id=eos)
    with WorkerProcess(ckpt, "--served-model-name", "gpt-oss", "--max-model-len", "512", "--tool-call-parser",
                       "openai", "--reasoning-parser", "openai_gptoss", "--enable-auto-tool-choice",
                       "--log-level", "warning") as w:
        yield w


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_through_a_real_gpt_oss_worker(gpt_oss_worker, stream):
    """The prompt ends in the forced header (special tokens tokenized as such), the grammar
    writes the arguments, the detokenizer keeps the markers, the parser makes the call."""
    client = openai.OpenAI(base_url=f"{gpt_oss_worker.url}/v1", api_key="x", max_retries=0, timeout=120)
    # Random weights would write a string forever: an enum makes the grammar end the call.
    weather = json.loads(json.dumps(WEATHER))
    weather["function"]["parameters"]["properties"]["city"]["enum"] = ["Paris", "Oslo"]
    kw = dict(model="gpt-oss", messages=ASK, tools=[weather, TIME], temperature=0, max_tokens=40,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        _, content, calls, finish, _ = _stream(
            client, **{k: v for k, v in kw.items() if k not in ("model", "messages")}
        )
        name, arguments = calls[0].function.name, "".join(c.function.arguments or "" for c in calls)
    else:
        r = client.chat.completions.create(**kw)
        (call,) = r.choices[0].message.tool_calls
        name, arguments, content, finish = call.function.name, call.function.arguments, r.choices[0].message.content, [
            r.choices[0].finish_reason]
    assert name == "get_weather" and json.loads(arguments)["city"] in ("Paris", "Oslo")
    assert finish == ["tool_calls"] and not content
