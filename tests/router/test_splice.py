"""The P/D splice and hand-off shape as pure functions (the equality with a real worker is
tests/router/test_pd_equality.py)."""

from __future__ import annotations

import json

import pytest

from pdserve.protocol.kv_transfer import prefill_request
from pdserve.protocol.requests import ChatCompletionRequest, CompletionRequest
from pdserve.protocol.responses import ChatCompletionResponse, CompletionResponse
from pdserve.router.call import Call
from pdserve.router.policies import RoutingRequest
from pdserve.router.splice import closing_events, first_token_events, merge_unary
from pdserve.router.sse import event_json, token_events


@pytest.mark.parametrize("body, one", [
    ({"prompt": "hi"}, True),
    ({"prompt": [1, 2, 3]}, True),
    ({"prompt": ["hi"]}, True),
    ({"prompt": [[1, 2]]}, True),
    ({"messages": [{"role": "user", "content": "hi"}]}, True),
    ({"prompt": ["a", "b"]}, False),
    ({"prompt": [[1], [2]]}, False),
    ({"prompt": "hi", "n": 2}, False),
    ({"prompt": "hi", "n": 2, "best_of": 2}, False),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 3}, False),
    ({"prompt": "hi", "echo": True}, False),
])
def test_single_sequence(body, one):
    request = (ChatCompletionRequest if "messages" in body else CompletionRequest).model_validate(body)
    call = Call("completions", request, b"", "rid", RoutingRequest(request), 0.0)
    assert call.single_sequence is one


def test_prefill_request_keeps_min_tokens_for_the_first_token():
    out = prefill_request({"prompt": "hi", "max_tokens": 9, "min_tokens": 5, "stream": True,
                           "stream_options": {"include_usage": True}})
    assert out["max_tokens"] == out["min_tokens"] == 1 and out["stream"] is False and "stream_options" not in out
    assert prefill_request({"prompt": "hi", "min_tokens": 0})["min_tokens"] == 0


def _events(raw: bytes) -> list[dict]:
    return [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e and e != "data: [DONE]"]


def test_first_token_events_send_nothing_for_held_text():
    held = CompletionResponse(id="cmpl-x", choices=[{"text": "", "finish_reason": "length"}])
    assert first_token_events(held) == b""
    chat = ChatCompletionResponse(id="chatcmpl-x", choices=[{"message": {"content": ""}, "finish_reason": "length"}])
    assert [e["choices"][0]["delta"] for e in _events(first_token_events(chat))] == [
        {"role": "assistant", "content": ""}
    ]


def test_a_first_token_that_ends_the_request_is_one_chunk_with_its_stop_reason():
    done = CompletionResponse(id="cmpl-x", choices=[{"text": " P", "finish_reason": "stop", "stop_reason": "ar"}],
                              usage={"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4})
    events = _events(first_token_events(done, finished=True) + closing_events(done, include_usage=True))
    assert [e["choices"] for e in events] == [
        [{"index": 0, "text": " P", "logprobs": None, "finish_reason": "stop", "stop_reason": "ar"}], []]
    assert events[1]["usage"]["completion_tokens"] == 1


def test_merge_continues_text_offsets_after_the_first_token():
    lp = lambda toks, offs: {"tokens": toks, "token_logprobs": [-1.0] * len(toks),  # noqa: E731
                             "top_logprobs": [None] * len(toks), "text_offset": offs}
    first = CompletionResponse(id="a", choices=[{"text": "", "logprobs": lp(["\n"], [0])}])  # "\n" held back
    rest = CompletionResponse(id="a", choices=[{"text": "\nok", "logprobs": lp(["\n", "ok"], [0, 1])}])
    merged = merge_unary(first, rest).choices[0]
    assert merged.text == "\nok" and merged.logprobs["text_offset"] == [0, 1, 2]


@pytest.mark.parametrize("text", ["", " P"])
@pytest.mark.parametrize("logprobs", [None, {}, {"content": []}, {"tokens": [" P"], "token_logprobs": [-0.1]}])
@pytest.mark.parametrize("finished", [False, True])
@pytest.mark.parametrize("chat", [False, True])
def test_the_first_tokens_events_count_their_tokens_as_parsing_them_does(text, logprobs, finished, chat):
    """The router's own first-token events are not parsed back to find the stream's first two
    tokens (router/sse.py CountedEvents): their count is what parsing them would give."""
    finish = "stop" if finished else "length"
    if chat:
        answer = ChatCompletionResponse(id="chatcmpl-x", choices=[{"message": {"content": text}, "logprobs": logprobs,
                                                                   "finish_reason": finish}])
    else:
        answer = CompletionResponse(id="cmpl-x", choices=[{"text": text, "logprobs": logprobs,
                                                           "finish_reason": finish}])
    events = first_token_events(answer, finished=finished)
    assert token_events(events) == token_events(bytes(events))


@pytest.mark.parametrize("payload", [
    b'{"choices": [{"index": 0, "text": "h\\u00e9llo \\"x\\"", "logprobs": null}]}',
    '{"choices":[{"delta":{"content":"caf\u00e9 \u2603"}}],"usage":{"a":1.5e3}}'.encode(),
    b'[1, 2, {"a": true}]',
])
def test_an_events_json_is_what_json_loads_gives(payload):
    assert event_json(payload) == json.loads(payload)


@pytest.mark.parametrize("payload", [b"", b"nope", b'{"a": ', b"\xff{}"])
def test_an_event_that_is_not_json_is_a_value_error(payload):
    with pytest.raises(ValueError):
        event_json(payload)
