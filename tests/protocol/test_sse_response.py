"""An `SSEResponse` is the Starlette streaming response it stands for: the same status and
headers, whichever way it was made (its own headers made once, or Starlette's init for extra ones)."""

from __future__ import annotations

from starlette.responses import StreamingResponse

from pdserve.protocol.sse import HEADERS, SSEResponse


async def _events():
    yield b"data: {}\n\n"


def test_its_headers_are_starlettes_and_its_own():
    made = SSEResponse(_events())
    assert made.raw_headers == StreamingResponse(_events(), headers=HEADERS,
                                                 media_type="text/event-stream").raw_headers
    assert (made.status_code, made.background, made.media_type) == (200, None, "text/event-stream")
    made.raw_headers.append((b"x-request-id", b"1"))  # set per response: never shared with the next
    assert SSEResponse(_events()).raw_headers == StreamingResponse(
        _events(), headers=HEADERS, media_type="text/event-stream").raw_headers


def test_extra_headers_and_other_iterables_take_starlettes_init():
    extra = SSEResponse(_events(), headers={"X-Extra": "1"})
    assert extra.raw_headers == StreamingResponse(_events(), headers={**HEADERS, "X-Extra": "1"},
                                                  media_type="text/event-stream").raw_headers

    class Iterable:
        def __aiter__(self):
            return _events()

    assert SSEResponse(Iterable()).raw_headers == SSEResponse(_events()).raw_headers


def test_a_subclass_with_its_own_media_type_keeps_it():
    class NDJSON(SSEResponse):
        media_type = "application/x-ndjson"

    assert NDJSON(_events()).raw_headers == StreamingResponse(_events(), headers=HEADERS,
                                                              media_type="application/x-ndjson").raw_headers
