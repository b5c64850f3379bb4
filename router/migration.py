"""Exact mid-stream migration: a stream whose decode worker is lost goes on on another worker.

    relay ◀── events, each output's closed by its token ids (protocol/continuation.py) ── worker A
      │ StreamProgress: whole outputs relayed, the ids of their tokens kept, the id events stripped
      ▼ A resets, ends without [DONE], stalls past --stream-idle-timeout, or ends it aborted (drained)
    Migration.move ── the client's request + {"continuation": {"token_ids": [...]}} ──▶ worker B
      (another decode worker; none left: a prefill worker, which runs the whole engine)
    relay ◀── B's events: the text after what A released, exactly

B prefills prompt + those ids and replays every piece of state they decide (output count,
penalties, min_tokens, grammar, the detokenizer's held-back tail); seeded sampling is keyed by
(seed, output position), so B draws what A would have drawn and the client's whole answer is one
uninterrupted worker's. At most --max-migrations moves per request; past them, or with no worker
that takes the continuation, the stream ends with the error event it always did.

What moves: streamed chat and completions requests, P/D or not, any n and prompt list (each
choice's ids are tracked; the ones that ended are not generated again), except completions' echo.
The router learns token ids only for them (it asks with `x-pdserve-token-ids`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Sequence

from pdserve.protocol.continuation import continuation_payload, group_end, strip_token_ids
from pdserve.protocol.contract import PATHS, ROLE_DECODE, ROLE_PREFILL
from pdserve.protocol.requests import CompletionRequest
from pdserve.router.call import Call
from pdserve.router.fallback import RoleFallback
from pdserve.router.metrics import RouterMetrics
from pdserve.router.sse import event_json
from pdserve.router.upstream import Limits
from pdserve.router.upstream_call import UpstreamCall
from pdserve.router.workers import Worker

log = logging.getLogger("pdserve.router")

_FINISHED = b'"finish_reason":"'  # a chunk that ends its choice (workers serialise compactly)
# A worker ends a stream aborted only when it gives up on it with the client still there: a
# drain's grace ran out (SIGTERM) or its engine stopped. The stream moves instead.
_ABORTED = b'"finish_reason":"abort"'


class WorkerDrained(Exception):
    """The worker ended the stream aborted (migration.py's `_ABORTED`)."""


@dataclass
class StreamProgress:
    """What the client has of one stream: per choice, the ids of the tokens whose text it was sent."""

    num_choices: int = 1  # prompts x n, indexed prompt * n + sample
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    ended: set[int] = field(default_factory=set)  # choices whose finish was relayed
    sent_any: bool = False  # an event reached the client (a chat stream's role chunk included)
    drained: bool = False  # the worker ended it aborted: what came before is relayed, the rest moves
    last_sent: float = 0.0  # when the last event went to the client
    # Completions with logprobs: per choice, the length of the text the client has, where a
    # continuation's `text_offset`s start (None: not counted; a choice missing: not known).
    text_len: dict[int, int] | None = None
    _pending: bytes = b""  # events of an output group not yet closed

    @classmethod
    def after(cls, first_token_id: int | None, counts_text: bool = False) -> "StreamProgress":
        """A hand-off's stream (one choice): the prefill's first token is out already (its text's
        length is learnt from the decode worker's first `text_offset`)."""
        text_len = {} if counts_text else None
        if first_token_id is None:
            return cls(text_len={0: 0} if counts_text else None)
        return cls(1, {0: [first_token_id]}, sent_any=True, last_sent=time.monotonic(), text_len=text_len)

    @property
    def finished(self) -> bool:
        """Every choice's finish is out: nothing is left to move."""
        return len(self.ended) >= self.num_choices

    def relay(self, block: bytes) -> bytes:
        """Whole events from the worker as the client gets them: only whole output groups (each
        closed by its token-id event, protocol/continuation.py), those events out, their ids kept.
        The rest waits for its group's end, or for the stream's (`flush`)."""
        self._pending += block
        end = group_end(self._pending)
        block, self._pending = self._pending[:end], self._pending[end:]
        if _ABORTED in block:  # the events before the abort go out; the abort and what follows do not
            self.drained = True
            cut = block.rfind(b"\n\n", 0, block.index(_ABORTED))
            block, self._pending = (block[:cut + 2] if cut >= 0 else b""), b""
        return self._sent(strip_token_ids(block, self.token_ids))

    def flush(self) -> bytes:
        """What follows the last group of a stream that ended whole (its usage, [DONE])."""
        rest, self._pending = self._pending, b""
        return self._sent(rest)

    def _sent(self, block: bytes) -> bytes:
        if block:
            self.sent_any = True
            self.last_sent = time.monotonic()
            if _FINISHED in block:
                self.ended.update(_finished_choices(block))
            if self.text_len is not None:
                _count_text(block, self.text_len)
        return block

    def moved(self) -> None:
        """A new worker's stream follows: nothing of the lost one's is pending."""
        self._pending, self.drained = b"", False

    def continuation(self) -> tuple[list[list[int]], list[int], list[int | None] | None]:
        """Each choice's token ids so far, the choices that ended, and (when counted) each
        choice's text length."""
        ids = [self.token_ids.get(i, []) for i in range(self.num_choices)]
        offsets = None if self.text_len is None else [self.text_len.get(i) for i in range(self.num_choices)]
        return ids, sorted(self.ended), offsets


def _finished_choices(block: bytes) -> list[int]:
    """The indexes of the choices a block's events finish (parsed: once per choice per stream)."""
    out = []
    for ev in block.split(b"\n\n"):
        if _FINISHED in ev and ev.startswith(b"data: {"):
            try:
                out += [c["index"] for c in event_json(ev[6:]).get("choices") or () if c.get("finish_reason")]
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
    return out


def _count_text(block: bytes, text_len: dict[int, int]) -> None:
    """Completions chunks' text, per choice, into `text_len`. A chunk with `text_offset`s says
    where its text starts (a hand-off's decode stream: after the prefill's first token)."""
    for ev in block.split(b"\n\n"):
        if not ev.startswith(b"data: {"):
            continue
        try:
            choices = event_json(ev[6:]).get("choices") or ()
            for c in choices:
                i, text = c["index"], c.get("text") or ""
                offsets = (c.get("logprobs") or {}).get("text_offset")
                if offsets:
                    text_len[i] = offsets[0] + len(text)
                elif i in text_len:
                    text_len[i] += len(text)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue


class Migration:
    def __init__(self, fallback: RoleFallback, metrics: RouterMetrics, max_migrations: int):
        self.fallback = fallback
        self.metrics = metrics
        self.max_migrations = max_migrations

    def allowed(self, call: Call) -> bool:
        """Whether the router tracks this request's tokens (and so may move it): streams, except
        completions' echo (the prompt is part of each choice's text)."""
        return self.max_migrations > 0 and call.stream and not getattr(call.request, "echo", False)

    @staticmethod
    def counts_text(call: Call) -> bool:
        """A continuation of it needs the client's text lengths: completions' `text_offset`s."""
        return isinstance(call.request, CompletionRequest) and call.request.logprobs is not None

    def progress(self, call: Call) -> StreamProgress:
        r = call.request
        prompts = len(r.prompts()) if isinstance(r, CompletionRequest) else 1
        num = prompts * r.n
        return StreamProgress(num, text_len={i: 0 for i in range(num)} if self.counts_text(call) else None)

    def pool(self, call: Call, lost: Sequence[Worker]) -> tuple[str, list[Worker]]:
        """Decode workers but the lost ones; none left: the prefill workers (aggregated fallback).
        Those of the lost workers' revision first: another revision may load other weights, and
        its tokens would not be the ones the lost worker would have drawn."""
        selector = self.fallback.selector
        gone = {w.url for w in lost}
        for role in (ROLE_DECODE, ROLE_PREFILL):
            for partners in (list(lost), None) if lost else (None,):
                workers = [w for w in selector.pool(role, call.model, partners=partners)
                           if w not in lost and w.url not in gone]
                if workers:
                    return role, workers
        return ROLE_DECODE, []

    async def move(self, call: Call, progress: StreamProgress, lost: Sequence[Worker], cause: str,
                   open_call, limits: Limits) -> UpstreamCall | None:
        """A call of the continuation on a worker not in `lost`, its 200 read; None when none took
        it. `open_call(role, pool)` makes the UpstreamCall (the orchestrator's, with its retries)."""
        role, pool = self.pool(call, lost)
        ids, ended, offsets = progress.continuation()
        # Nothing reached the client: the request is sent again as it came.
        payload = continuation_payload(call.raw, ids, ended, offsets) if progress.sent_any else call.raw
        up: UpstreamCall = open_call(role, pool)
        response = await up.open(PATHS[call.route], payload, call.headers(), limits)
        if response is None or response.status != 200:
            log.warning("stream %s could not move after its worker was %s (%s)", call.request_id, cause,
                        up.last_reason if response is None else f"answered {response.status}")
            up.close()
            return None
        self.metrics.migrations.labels(cause).inc()
        self.metrics.migration_reprefilled_tokens.inc(call.prompt_tokens + sum(len(t) for t in ids))
        log.info("stream %s moved to %r after its worker was %s (%d tokens continued)", call.request_id,
                 up.worker, cause, sum(len(t) for t in ids))
        return up


def first_token_id(params: dict | None) -> int | None:
    """The prefill's first token, from its answer's kv_transfer_params."""
    token = (params or {}).get("first_token_id")
    return token if isinstance(token, int) else None


def lost_cause(error: BaseException) -> str:
    if isinstance(error, WorkerDrained):
        return "drained"
    return "stalled" if isinstance(error, TimeoutError) else "lost"


def gap_since(progress: StreamProgress) -> float:
    return time.monotonic() - progress.last_sent if progress.last_sent else 0.0
