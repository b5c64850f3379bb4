"""protocol/continuation.py: the token-id events a worker closes each output with, and the
continuation the router sends; router/migration.py's StreamProgress on top of them."""

from __future__ import annotations

import json

import pytest

from pdserve.protocol.continuation import continuation_payload, group_end, strip_token_ids, token_ids_event
from pdserve.protocol.requests import CompletionRequest
from pdserve.router.migration import StreamProgress

A = b'data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n'
B = b'data: {"choices":[{"index":1,"text":"b","finish_reason":null}]}\n\n'
END1 = b'data: {"choices":[{"index":1,"text":"","finish_reason":"stop"}]}\n\n'
ABORT0 = b'data: {"choices":[{"index":0,"text":"","finish_reason":"abort"}]}\n\n'
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize("block,end", [
    (b"", 0), (A, 0), (A + token_ids_event(0, [5]), len(A) + len(token_ids_event(0, [5]))),
    (token_ids_event(0, []) + A, len(token_ids_event(0, []))),
    (A + token_ids_event(0, [5]) + B, len(A) + len(token_ids_event(0, [5]))),
])
def test_group_end_is_after_the_last_token_id_event(block, end):
    assert group_end(block) == end


def test_stripping_keeps_every_other_byte_and_collects_ids_per_choice():
    ids: dict[int, list[int]] = {}
    block = A + token_ids_event(0, [5, 6]) + B + token_ids_event(1, [7]) + token_ids_event(0, [])
    assert strip_token_ids(block, ids) == A + B and ids == {0: [5, 6], 1: [7]}
    assert strip_token_ids(A + DONE, ids) == A + DONE  # nothing to strip: the same bytes


def test_progress_relays_whole_groups_and_knows_what_ended():
    p = StreamProgress(2)
    assert p.relay(A + token_ids_event(0, [5]) + B) == A  # B's group is not closed yet
    assert p.relay(token_ids_event(1, [9]) + END1 + token_ids_event(1, [])) == B + END1
    assert p.continuation() == ([[5], [9]], [1]) and not p.finished
    assert p.relay(DONE) == b"" and p.flush() == DONE


def test_an_aborted_choice_is_cut_with_everything_after_it():
    p = StreamProgress(2)
    assert p.relay(A + token_ids_event(0, [5]) + ABORT0 + B + token_ids_event(1, [9])) == A
    assert p.drained and p.continuation() == ([[5], []], [])  # B's id is not kept: its text was not sent


def test_the_payload_is_the_request_with_the_continuation():
    raw = json.dumps({"model": "m", "prompt": "hi", "n": 2, "stream": True}).encode()
    body = json.loads(continuation_payload(raw, [[1, 2], [3]], [1]))
    assert body["continuation"] == {"token_ids": [[1, 2], [3]], "finished": [1]}
    assert CompletionRequest.model_validate(body).continuation.token_ids == [[1, 2], [3]]
