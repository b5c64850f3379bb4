"""The wire shapes both sides share: the one error table, and responses/chunks that leave out
what OpenAI leaves out and keep what a worker adds."""

from __future__ import annotations

import json

import pytest

from pdserve.protocol.errors import APIError, UpstreamError, error_type
from pdserve.protocol.responses import (ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse, CompletionChoice,
                                        CompletionResponse, Delta, Usage)


@pytest.mark.parametrize("status,type_", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (413, "invalid_request_error"), (415, "invalid_request_error"),
    (429, "rate_limit_error"), (500, "internal_server_error"), (502, "upstream_error"),
    (503, "service_unavailable"), (504, "timeout_error"), (418, "invalid_request_error"),
    (507, "internal_server_error"),
])
def test_error_table(status, type_):
    assert error_type(status) == type_
    body = json.loads(APIError(status, "m", "p", "c").response().body)
    assert body == {"error": {"message": "m", "type": type_, "param": "p", "code": "c"}}


def test_sse_error_event_then_done():
    events = APIError(502, "gone", code="upstream_failed").sse_event().split(b"\n\n")
    assert json.loads(events[0][6:])["error"]["code"] == "upstream_failed" and events[1] == b"data: [DONE]"


@pytest.mark.parametrize("content,passed_through", [
    (b'{"error": {"message": "bad", "type": "x", "param": null, "code": null}}', True),
    (b"<html>oops</html>", False),
    (b'{"detail": "no"}', False),
])
def test_upstream_error_passes_openai_shaped_bodies_through(content, passed_through):
    r = UpstreamError(400, content).response()
    assert r.status_code == 400 and (r.body == content) is passed_through
    assert set(json.loads(r.body)["error"]) == {"message", "type", "param", "code"}


def test_chunks_leave_out_unset_optional_keys():
    role = json.loads(ChatCompletionChunk(id="c", choices=[ChatChunkChoice(delta=Delta(role="assistant", content=""))])
                      .sse()[6:])
    assert role["choices"][0] == {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}
    assert "usage" not in role
    last = json.loads(ChatCompletionChunk(id="c", choices=[ChatChunkChoice(delta=Delta(), finish_reason="stop",
                                                                             stop_reason="\n")]).sse()[6:])
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["stop_reason"] == "\n"


def test_responses_keep_a_workers_extra_fields_and_drop_absent_kv_params():
    raw = {"id": "x", "object": "text_completion", "created": 1, "model": "m", "system_fingerprint": "fp",
           "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                        "prompt_logprobs": [None, {"7": {"logprob": -1.5, "rank": 2, "decoded_token": "a"}}]}],
           "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    assert json.loads(CompletionResponse.model_validate(raw).model_dump_json()) == raw
    chat = ChatCompletionResponse.model_validate({"id": "x", "choices": [{"message": {"content": "a"}}],
                                                  "kv_transfer_params": {"k": 1}})
    chat.kv_transfer_params = None
    assert "kv_transfer_params" not in json.loads(chat.model_dump_json())
    usage = Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3)
    assert "prompt_tokens_details" not in usage.model_dump()
    assert CompletionChoice().model_dump()["finish_reason"] is None
