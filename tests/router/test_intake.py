"""What the router sends workers is what it validated (router/intake.py, issue 44): the model's
fields as the client set them, never an unknown field or the client's kv_transfer_params; and a
request over a limit (protocol/request_limits.py) is a 400 naming the field and the flag."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.protocol.errors import APIError
from pdserve.protocol.request_limits import RequestLimits
from pdserve.router.intake import intake

LIMITS = RequestLimits()
CHAT = [{"role": "user", "content": "hi"}]


def take(body: dict, route: str = "chat", limits: RequestLimits = LIMITS):
    return intake(json.dumps(body).encode(), route, limits)


def test_unknown_fields_and_client_kv_params_and_continuation_are_not_forwarded():
    got = take({"model": "tiny", "messages": [{"role": "tool", "content": "4", "tool_call_id": "c1"}],
                "max_tokens": None, "seed": 7, "x": [[]] * 1000, "nested": {"y": 1},
                "kv_transfer_params": {"do_remote_decode": True}, "continuation": {"token_ids": [[1, 2]]}})
    assert json.loads(got.raw) == got.request.model_dump(exclude_unset=True) == {
        "model": "tiny", "max_tokens": None, "seed": 7,  # as set: an explicit null stays, defaults stay unset
        "messages": [{"role": "tool", "content": "4", "tool_call_id": "c1"}]}  # a message's extras reach the template
    assert (got.route, got.model, got.responses) == ("chat", "tiny", None)


def test_a_responses_request_becomes_the_chat_request_it_means():
    got = take({"model": "tiny", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 5, "top_k": 3,
                "metadata": {"a": "b"}, "junk": [1] * 100}, "responses")
    assert got.route == "chat" and got.request.model_dump(exclude_unset=True) == {
        "model": "tiny", "top_k": 3, "max_completion_tokens": 5,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}
    assert got.responses == {"model": "tiny", "instructions": "Be brief.", "max_output_tokens": 5}


def test_token_ids_forward_as_given():
    ids = list(range(50_000))
    got = take({"model": "tiny", "prompt": ids, "max_tokens": 2}, "completions")
    assert got.request.prompt == ids and json.loads(got.raw)["prompt"] == ids


@pytest.mark.parametrize("route,body,param,flag", [
    ("completions", {"prompt": [1] * 11}, "prompt", "--max-request-prompt-tokens"),
    ("completions", {"prompt": [[1] * 6, [2] * 6]}, "prompt", "--max-request-prompt-tokens"),
    ("completions", {"prompt": ["a"] * 3, "n": 2}, "n", "--max-request-sequences"),
    ("completions", {"prompt": ["a"] * 5}, "prompt", "--max-request-sequences"),
    ("chat", {"messages": CHAT, "n": 5}, "n", "--max-request-sequences"),
    ("chat", {"messages": CHAT, "stop": ["a", "b", "c"]}, "stop", "--max-stop-strings"),
    ("completions", {"prompt": "p", "stop": "x" * 21}, "stop", "--max-stop-chars"),
    ("responses", {"input": [{"role": "user", "content": "x"}] * 4}, "input", "--max-input-items"),
])
def test_limits_are_400s_naming_the_field_and_the_flag(route, body, param, flag):
    small = RequestLimits(max_request_prompt_tokens=10, max_request_sequences=4, max_stop_strings=2,
                          max_stop_chars=20, max_input_items=3)
    with pytest.raises(APIError) as e:
        take({"model": "tiny", **body}, route, small)
    assert e.value.status == 400 and e.value.param == param and flag in e.value.message
    # Under the default limits, the same request is taken.
    assert take({"model": "tiny", **body}, route).model == "tiny"


def test_a_body_of_more_values_than_the_prompt_bound_allows_is_refused_before_parsing():
    small = RequestLimits(max_request_prompt_tokens=1000)
    raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "x": [' + \
        b",".join([b"[]"] * (small.body_values + 1)) + b"]}"
    with pytest.raises(APIError) as e:
        intake(raw, "chat", small)
    assert e.value.code == "too_many_values"


_SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.floats(0, 2), st.text(max_size=5))
_FIELD = {  # a field of either endpoint (some take only some kinds: pydantic's 400s are skipped)
    "n": st.integers(1, 2), "stream": st.booleans(), "temperature": _SCALAR, "top_k": _SCALAR, "seed": _SCALAR,
    "stop": st.one_of(_SCALAR, st.lists(st.text(max_size=3), max_size=2)), "logit_bias": st.dictionaries(
        st.sampled_from(["1", "2"]), st.floats(-1, 1), max_size=1), "stream_options": st.fixed_dictionaries(
        {"include_usage": st.booleans()}), "user": _SCALAR, "priority": st.integers(-2, 2), "unknown": _SCALAR,
    "max_tokens": st.one_of(st.none(), st.integers(1, 9)), "chat_template_kwargs": st.dictionaries(
        st.sampled_from(["a"]), _SCALAR, max_size=1), "prompt": st.one_of(st.text(min_size=1, max_size=5), st.lists(
            st.integers(0, 9), min_size=1, max_size=3), st.lists(st.lists(st.integers(0, 9), min_size=1), min_size=1,
                                                                 max_size=2)),
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(route=st.sampled_from(["chat", "completions"]), body=st.fixed_dictionaries({}, optional=_FIELD))
def test_a_request_is_forwarded_as_sent_only_when_it_is_what_was_validated(route, body):
    """The shortcut past the dump (`_dumps_as_given`) never forwards a body the dump would have
    changed: whatever was sent, what goes on is the validated fields' JSON."""
    body = {"model": "tiny", **body}
    if route == "chat":
        body.pop("prompt", None)
        body["messages"] = CHAT
    elif "prompt" not in body:
        body["prompt"] = "hi"
    try:
        got = take(body, route)
    except APIError:
        return  # refused as the worker would refuse it
    assert json.loads(got.raw) == got.request.model_dump(exclude_unset=True)
    if got.fields is not None:
        assert got.fields == got.request.model_dump(exclude_unset=True)
