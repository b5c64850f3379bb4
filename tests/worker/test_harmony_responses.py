"""gpt-oss's reasoning in the Responses API (issue 46, item 4) and usage's reasoning_tokens, with
the real `openai` client against the scripted harmony worker of test_harmony.py (its engine
replays a harmony answer through the real detokenizer), directly and through a `pdserve router`.

- `reasoning` output item (a `reasoning_text` part) before the message or the function call;
  streamed as output_item.added, reasoning_text.delta..., reasoning_text.done, output_item.done,
  then the message's events; the streamed answer == the whole one.
- reasoning_tokens: the analysis body's tokens, the same in chat (completion_tokens_details)
  and Responses (output_tokens_details), streamed or not.
- An answer cut mid-channel by max_output_tokens returns what was generated, status incomplete.
- A reasoning item sent back as input becomes the assistant turn's reasoning_content.
- P/D: the decode worker parses its reply after the prefill's first token, so prefill + decode
  answers == one worker's, whole and streamed (the parser as a unit, every case of test_harmony).
"""

from __future__ import annotations

import json

import pytest

from pdserve.protocol.responses_api import to_chat
from pdserve.worker.server.tool_parsers import get_parser
from pdserve.worker.server.tool_parsers.plan import StreamedCalls, ToolPlan, complete_reply
from tests.worker.test_harmony import (ANALYSIS, ASK, CALL, CASES, FINAL, WEATHER, _tokens,  # noqa: F401
                                       harmony_tokenizer, harmony_tokenizer_dir, scripted)

REASONING = "User asks weather. Need tool."
ANSWER = "It is 18 C and sunny in Paris."
RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}
OPENING = ["response.created", "response.in_progress"]
REASONING_EVENTS = ["response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.done",
                    "response.output_item.done"]
MESSAGE_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
                  "response.output_text.done", "response.content_part.done", "response.output_item.done"]


def _thought_tokens(tokenizer) -> int:
    """What reasoning_tokens counts of ANALYSIS: `<|message|>` (the body opens) and the body's tokens."""
    return 1 + len(tokenizer.encode(REASONING, add_special_tokens=False))


def _squeezed(kinds: list[str]) -> list[str]:
    """Event kinds with runs of one delta kind collapsed to one."""
    return [k for j, k in enumerate(kinds) if not (k.endswith(".delta") and j and kinds[j - 1] == k)]


def _items(output) -> list[tuple]:
    out = []
    for o in output:
        if o.type == "reasoning":
            out.append(("reasoning", [c.text for c in o.content], o.summary))
        elif o.type == "message":
            out.append(("message", o.content[0].text))
        else:
            out.append((o.type, o.name, json.loads(o.arguments)))
    return out


def test_reasoning_item_before_the_message(scripted):
    engine, client = scripted
    engine.script = ANALYSIS + FINAL
    r = client.responses.create(model="gpt-oss", input=ASK[0]["content"], max_output_tokens=200)
    assert r.status == "completed" and r.incomplete_details is None
    assert _items(r.output) == [("reasoning", [REASONING], []), ("message", ANSWER)]
    assert r.output[0].id.startswith("rs_") and r.output[0].status == "completed"
    assert r.output_text == ANSWER
    thought = _thought_tokens(engine.tokenizer)
    assert r.usage.output_tokens_details.reasoning_tokens == thought < r.usage.output_tokens
    chat = client.chat.completions.create(model="gpt-oss", messages=ASK, max_tokens=200)
    assert chat.usage.completion_tokens_details.reasoning_tokens == thought
    assert chat.usage.completion_tokens == r.usage.output_tokens
    streamed = list(client.chat.completions.create(model="gpt-oss", messages=ASK, max_tokens=200, stream=True,
                                                   stream_options={"include_usage": True}))
    assert streamed[-1].usage.completion_tokens_details.reasoning_tokens == thought


def test_streamed_reasoning_events(scripted):
    engine, client = scripted
    engine.script = ANALYSIS + FINAL
    whole = client.responses.create(model="gpt-oss", input=ASK[0]["content"], max_output_tokens=200)
    events = list(client.responses.create(model="gpt-oss", input=ASK[0]["content"], max_output_tokens=200,
                                          stream=True))
    kinds = [e.type for e in events]
    assert _squeezed(kinds) == OPENING + REASONING_EVENTS + MESSAGE_EVENTS + ["response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert len(deltas) > 1 and "".join(e.delta for e in deltas) == REASONING  # streamed as it comes
    added, done = (e for e in events if e.type in ("response.output_item.added", "response.output_item.done")
                   and e.item.type == "reasoning")
    (text_done,) = [e for e in events if e.type == "response.reasoning_text.done"]
    assert added.item.status == "in_progress" and done.item.status == "completed"
    assert added.item.id == done.item.id == text_done.item_id == deltas[0].item_id
    assert (added.output_index, text_done.content_index, text_done.text) == (0, 0, REASONING)
    msg_added = [e for e in events if e.type == "response.output_item.added"][1]
    assert msg_added.item.type == "message" and msg_added.output_index == 1
    final = events[-1].response
    assert _items(final.output) == _items(whole.output)
    assert final.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens_details.reasoning_tokens


def test_reasoning_then_a_function_call(scripted):
    engine, client = scripted
    engine.script = ANALYSIS + CALL
    r = client.responses.create(model="gpt-oss", input=ASK[0]["content"], tools=[RESPONSES_WEATHER],
                                max_output_tokens=200)
    assert _items(r.output) == [("reasoning", [REASONING], []), ("function_call", "get_weather", {"city": "Paris"})]
    events = list(client.responses.create(model="gpt-oss", input=ASK[0]["content"], tools=[RESPONSES_WEATHER],
                                          max_output_tokens=200, stream=True))
    kinds = _squeezed([e.type for e in events])
    assert kinds[:6] == OPENING + REASONING_EVENTS
    assert _items(events[-1].response.output) == _items(r.output)


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_cut_mid_channel_is_incomplete_with_what_was_generated(scripted, stream):
    engine, client = scripted
    engine.script = ANALYSIS + FINAL
    tok = engine.tokenizer
    in_final = len(tok.encode(ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is 18",
                              add_special_tokens=False))
    for limit, want in [(5, None), (in_final, "It is 18")]:
        kw = dict(model="gpt-oss", input=ASK[0]["content"], max_output_tokens=limit)
        r = list(client.responses.create(**kw, stream=True))[-1].response if stream else client.responses.create(**kw)
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        kinds = [o.type for o in r.output]
        assert kinds == (["reasoning"] if want is None else ["reasoning", "message"]), limit
        assert REASONING.startswith(r.output[0].content[0].text) and r.output[0].content[0].text
        if want is not None:
            assert r.output_text == want and r.output[0].content[0].text == REASONING
        assert r.usage.output_tokens == limit


def test_through_the_router(scripted, tmp_path):
    """The router maps /v1/responses onto chat itself: the same reasoning items and usage."""
    import openai

    from tests.router.conftest import Launcher

    engine, client = scripted
    engine.script = ANALYSIS + FINAL
    launcher = Launcher(tmp_path)
    try:
        router = launcher.router("--decode", str(client.base_url).removesuffix("/v1/"))
        via = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=60)
        want = client.responses.create(model="gpt-oss", input=ASK[0]["content"], max_output_tokens=200)
        got = via.responses.create(model="gpt-oss", input=ASK[0]["content"], max_output_tokens=200)
        assert _items(got.output) == _items(want.output)
        assert got.usage.output_tokens_details.reasoning_tokens == _thought_tokens(engine.tokenizer)
        events = list(via.responses.create(model="gpt-oss", input=ASK[0]["content"], max_output_tokens=200,
                                           stream=True))
        assert _squeezed([e.type for e in events]) == OPENING + REASONING_EVENTS + MESSAGE_EVENTS + [
            "response.completed"]
        assert _items(events[-1].response.output) == _items(want.output)
    finally:
        launcher.stop_all()


def test_a_reasoning_item_sent_back_is_the_turns_reasoning_content():
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [],
                 "content": [{"type": "reasoning_text", "text": REASONING}]}
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    message = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": ANSWER}]}
    user = {"role": "user", "content": "And Oslo?"}
    chat = to_chat({"input": [ASK[0], reasoning, call, {"type": "function_call_output", "call_id": "call_1",
                                                        "output": "sunny"}, reasoning, message, user]})
    msgs = chat["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool", "assistant", "user"]
    assert msgs[1]["reasoning_content"] == REASONING and msgs[1]["tool_calls"][0]["id"] == "call_1"
    assert msgs[3] == {"role": "assistant", "content": ANSWER, "reasoning_content": REASONING}
    lone = to_chat({"input": [ASK[0], reasoning]})["messages"][1]  # reasoning that led to nothing
    assert lone == {"role": "assistant", "content": "", "reasoning_content": REASONING}


# ---- P/D: the decode worker's parser reads the prefill's first token first ------------------------

@pytest.mark.parametrize("text", [c[0] for c in CASES])
def test_a_pd_split_reply_parses_as_one_workers(text):
    """The prefill's answer (its first token, parsed alone) + the decode worker's (the rest, parsed
    after that token's text) == one worker's reply, whole and streamed: a harmony header the first
    token begins is read whole, and nothing the prefill returned comes twice."""
    plan = ToolPlan(get_parser("openai"), calls=False)  # no tools: what a router disaggregates
    first, *rest = _tokens(text)
    content, _, reasoning = complete_reply(plan, text)
    head, _, head_reasoning = complete_reply(plan, first)
    assert head_reasoning is None  # a reply opens in a header: the first token is never reasoning
    tail, _, tail_reasoning = complete_reply(plan, "".join(rest), handed=first)
    assert (head + tail, tail_reasoning) == (content, reasoning)
    told_later = StreamedCalls(plan)  # a streamed hand-off: the engine tells the first token's text
    told_later.prime(first)
    for streamed in (StreamedCalls(plan, first), told_later):
        got, thought = [], []
        for k, tok in enumerate(rest or [""]):
            got.append(streamed.feed(tok, k == max(len(rest), 1) - 1)[0])
            thought.append(streamed.reasoning)
        assert (head + "".join(got), "".join(thought) or None) == (content, reasoning)
