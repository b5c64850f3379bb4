"""A stream continued on another worker (exact mid-stream migration, router/migration.py).

Two pdserve extensions, both between the router and a worker only (the router strips a client's):

1. `continuation` in a request body: the output token ids each choice already produced on a
   worker that was lost. The worker prefills prompt + those ids and sets each choice's state as
   if it had generated them (output count, penalties, min_tokens progress, grammar, detokenizer
   and its held-back stop tail), then samples on from there; seeded sampling is keyed by (seed,
   output position), so it draws what the lost worker would have. Their text is never sent
   again: the continuation's first text continues the text already out.

       {"continuation": {"token_ids": [[ids of choice 0], [ids of choice 1], ...], "finished": [1]}}

   `finished`: the choices whose finish the client has: not generated again. `text_offset`
   (completions with `logprobs` only): per choice, the length of the text the client has, where
   the continuation's `text_offset`s start (null: the worker's own count, the length of the text
   its detokenizer releases for the ids at once, which can differ from what the lost worker
   released output by output: a token that decodes to nothing drops the space a word-level or
   SentencePiece decoder puts before the next word).

2. The header `x-pdserve-token-ids: 1` on a streamed request: after the events of each engine
   output (one write), the worker sends one comment event naming that output's new token ids
   (none, for an output without tokens):

       data: {...a chunk, unchanged...}\n\n
       data: {...the next chunk of the same output...}\n\n
       : token_ids 0 17,4051,11\n\n

   The comment closes the group: a reader that relays events only up to the last such comment
   (`group_end`) has relayed an output's events all or none, and knows the ids of exactly the
   tokens whose text it relayed, even if the connection breaks between two of them. A comment is
   ignored by any SSE client, but the router removes these events anyway (`strip_token_ids`), so
   the client's bytes are the worker's ordinary stream.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

PARAM = "continuation"
HEADER_TOKEN_IDS = "x-pdserve-token-ids"
_PREFIX = b": token_ids "


class Continuation(BaseModel):
    """`token_ids[i]`: choice i's output so far (choice index = prompt * n + sample)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    token_ids: list[list[int]] = Field(min_length=1)
    finished: list[int] = []  # choices that ended already: not generated again (their ids count in usage)
    text_offset: list[int | None] | None = None  # per choice: the client's text length (completions' logprobs)


def token_ids_event(index: int, ids: list[int]) -> bytes:
    return _PREFIX + f"{index} {','.join(map(str, ids))}\n\n".encode()


def group_end(block: bytes) -> int:
    """Where the last complete output group of `block` (whole events) ends: 0 if none has."""
    at = block.rfind(b"\n\n" + _PREFIX)
    start = at + 2 if at >= 0 else (0 if block.startswith(_PREFIX) else -1)
    return 0 if start < 0 else block.index(b"\n\n", start) + 2


def strip_token_ids(block: bytes, into: dict[int, list[int]]) -> bytes:
    """`block` (whole events) without its token-id events, their ids appended to `into[choice]`.
    Other events pass through as the same bytes."""
    if _PREFIX not in block:
        return block
    out = []
    for ev in block.split(b"\n\n")[:-1]:
        while ev.startswith(_PREFIX):
            line, _, ev = ev.partition(b"\n")
            index, _, ids = line[len(_PREFIX):].partition(b" ")
            if ids:
                into.setdefault(int(index), []).extend(int(t) for t in ids.split(b","))
        if ev:
            out.append(ev + b"\n\n")
    return b"".join(out)


def continuation_payload(raw: bytes, token_ids: list[list[int]], finished: list[int] = (),
                         text_offset: list[int | None] | None = None) -> bytes:
    """The request's JSON object `raw` with the continuation spliced in (not re-serialised)."""
    ids = ",".join("[" + ",".join(map(str, t)) + "]" for t in token_ids)
    ended = ",".join(map(str, finished))
    offsets = "" if text_offset is None else \
        ',"text_offset":[' + ",".join("null" if o is None else str(o) for o in text_offset) + "]"
    return raw[:-1] + f',"{PARAM}":{{"token_ids":[{ids}],"finished":[{ended}]{offsets}}}}}'.encode()
