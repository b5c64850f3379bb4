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
    assert p.continuation() == ([[5], [9]], [1], None) and not p.finished
    assert p.relay(DONE) == b"" and p.flush() == DONE


def test_an_aborted_choice_is_cut_with_everything_after_it():
    p = StreamProgress(2)
    assert p.relay(A + token_ids_event(0, [5]) + ABORT0 + B + token_ids_event(1, [9])) == A
    assert p.drained and p.continuation() == ([[5], []], [], None)  # B's id is not kept: its text was not sent


def test_the_payload_is_the_request_with_the_continuation():
    raw = json.dumps({"model": "m", "prompt": "hi", "n": 2, "stream": True}).encode()
    body = json.loads(continuation_payload(raw, [[1, 2], [3]], [1]))
    assert body["continuation"] == {"token_ids": [[1, 2], [3]], "finished": [1]}
    assert CompletionRequest.model_validate(body).continuation.token_ids == [[1, 2], [3]]


def test_progress_counts_the_text_the_client_has_where_offsets_continue():
    """Completions with logprobs: a continuation's `text_offset`s start at the length of the text
    relayed (not at what a fresh detokenizer releases for the ids at once); a hand-off's decode
    stream starts after the prefill's first token, which its first `text_offset` says."""
    def chunk(i: int, text: str, offsets: list[int] | None) -> bytes:
        lp = None if offsets is None else {"tokens": [], "token_logprobs": [], "text_offset": offsets}
        return b"data: " + json.dumps({"choices": [{"index": i, "text": text, "logprobs": lp}]}).encode() + b"\n\n"

    p = StreamProgress(2, text_len={0: 0, 1: 0})
    p.relay(chunk(0, "w1", [0]) + chunk(1, "ab", [0]) + token_ids_event(0, [5]) + chunk(0, "w2", [2]) +
            chunk(0, "!", []) + token_ids_event(0, [6]))
    assert p.continuation() == ([[5, 6], []], [], [5, 2])
    handed = StreamProgress.after(7, counts_text=True)
    assert handed.continuation()[2] == [None]  # nothing from the decode worker: its length is not known
    handed.relay(chunk(0, "w3", [3]) + token_ids_event(0, [8]))
    assert handed.continuation() == ([[7, 8]], [], [5])
    raw = json.dumps({"model": "m", "prompt": "hi", "n": 2, "stream": True}).encode()
    body = json.loads(continuation_payload(raw, [[1], [2]], [], [4, None]))
    assert CompletionRequest.model_validate(body).continuation.text_offset == [4, None]
