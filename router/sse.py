"""Server-sent events passed through from a worker.

Upstream bytes are forwarded in whole events (split on the blank line), so a failure can never
leave half an event on the wire before our error event. Only the decode worker's first event
of a chat stream is parsed (its role chunk is dropped: the router already sent one).
"""

from __future__ import annotations

import json

# The C scanner `json.loads` ends in, called without the Python around it (the encoding sniffed
# from the bytes, the decoder's wrapper): the relay parses the first events of every stream, and
# with migration every event of a completions stream.
_SCAN = json.JSONDecoder().scan_once


def event_json(payload: bytes):
    """The JSON value an event's payload (after `data: `) opens with: what `json.loads` gives for
    one well-formed value; ValueError if it is not one (trailing bytes after it are not looked at)."""
    try:
        return _SCAN(payload.decode(), 0)[0]
    except StopIteration:  # (the scanner's way of saying no value starts here)
        raise ValueError("no JSON value") from None


class EventFramer:
    """Feed raw bytes, get back the longest prefix made of complete events."""

    def __init__(self) -> None:
        self._pending = b""
        self.done = False  # saw `data: [DONE]`

    def feed(self, data: bytes) -> bytes:
        buf = self._pending + data if self._pending else data
        cut = buf.rfind(b"\n\n")
        if cut < 0:
            self._pending = buf
            return b""
        out, self._pending = buf[:cut + 2], buf[cut + 2:]
        if b"data: [DONE]" in out:
            self.done = True
        return out


def split_first_event(block: bytes) -> tuple[bytes, bytes]:
    cut = block.find(b"\n\n")
    return block[:cut + 2], block[cut + 2:]


def drop_role_chunk(event: bytes) -> bytes:
    """A decode worker's chat stream opens with {"delta": {"role": ..., "content": ""}}: drop it."""
    if not event.startswith(b"data: {"):
        return event
    try:
        chunk = event_json(event[6:])
        delta = chunk["choices"][0]["delta"]
    except (ValueError, KeyError, IndexError, TypeError):
        return event
    if "role" not in delta:
        return event
    if not delta.get("content") and not delta.get("tool_calls") and chunk["choices"][0].get("finish_reason") is None:
        return b""
    del delta["role"]
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


class CountedEvents(bytes):
    """Events the router wrote itself (a prefill's first token: router/splice.py), with how many
    of them carry a generated token as `token_events` counts them: not parsed back."""

    tokens: int

    def __new__(cls, events: bytes, tokens: int) -> "CountedEvents":
        self = super().__new__(cls, events)
        self.tokens = tokens
        return self


def token_events(block: bytes, most: int = 2) -> int:
    """How many of `block`'s events carry a generated token (text, a tool call, reasoning or
    logprobs; not a role chunk, a finish-only chunk, usage, an error or [DONE]), counting at most
    `most`. Parses JSON, so the router calls it only for a stream's first few events (and never
    for its own `CountedEvents`)."""
    if isinstance(block, CountedEvents):
        return min(block.tokens, most)
    n = 0
    for event in block.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            continue
        try:
            choices = event_json(event[6:]).get("choices") or ()
        except (ValueError, AttributeError):
            continue
        if any(_carries_token(c) for c in choices if isinstance(c, dict)):
            n += 1
            if n >= most:
                break
    return n


def _carries_token(choice: dict) -> bool:
    if choice.get("text") or choice.get("logprobs"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and any(delta.get(k) for k in ("content", "tool_calls", "reasoning_content"))
