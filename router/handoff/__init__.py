"""The hand-off: how a prefill's KV reaches a decode worker, from the prefill's answer to the
client's response. Two implementations, chosen by what the prefill worker answered:

    after_prefill.py  a whole answer (application/json): the decode call gets its final params
    streamed.py       a streamed answer (application/x-ndjson, `--pd-handoff streamed`): the
                      decode call opens at its first line, while the prefill still runs

Both use the orchestrator only through `Orchestration`, its public interface: the orchestrator
(router/orchestrator.py) depends on the hand-offs, never the other way round.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import AsyncGenerator, Generic, Protocol, Sequence, TypeVar

from starlette.responses import Response

from pdserve.protocol.contract import ROLE_DECODE
from pdserve.protocol.errors import APIError
from pdserve.protocol.sse import SSEResponse
from pdserve.protocol.yield_from import Events
from pdserve.router.http1 import UpstreamResponse
from pdserve.router.call import Call, PinnedKV
from pdserve.router.metrics import RouterMetrics
from pdserve.router.selection import Selector
from pdserve.router.splice import Answer
from pdserve.router.upstream import Limits, Upstream
from pdserve.router.upstream_call import UpstreamCall
from pdserve.router.workers import Worker

# How long a hand-off's decode call outlives a client that left: a worker reads a request within
# milliseconds unless its event loop is stalled; the pin's TTL is the backstop past that.
HANDOFF_GRACE_S = 2.0


class Closable(Protocol):
    def close(self) -> None: ...


class Orchestration(Protocol):
    """What a hand-off uses of the orchestrator: the calls to workers and the client's response."""

    up: Upstream
    metrics: RouterMetrics
    selector: Selector
    stream_limits: Limits

    def unary_limits(self, call: Call) -> Limits: ...

    def upstream_call(self, phase: str, role: str, call: Call, pool: Sequence[Worker]) -> UpstreamCall: ...

    def no_decode(self, up: UpstreamCall) -> APIError: ...

    async def read_answer(self, up: UpstreamCall, response: UpstreamResponse | None) -> bytes: ...

    async def direct(self, call: Call, pool: list[Worker], role: str = ROLE_DECODE) -> Response: ...

    def whole_elsewhere(self, call: Call, role: str, up: UpstreamCall) -> tuple[str, list[Worker]] | None: ...

    def finished_by_prefill(self, call: Call, answer: Answer) -> Response: ...

    def merged(self, call: Call, prefill: Answer, content: bytes) -> Response: ...

    def observe_ttft(self, call: Call) -> None: ...

    def decode_events(self, call: Call, up: UpstreamCall, response: UpstreamResponse | None,
                      since: float, first_token_id: int | None = None) -> AsyncGenerator: ...

    def stream_response(self, call: Call, events: Events, held: Closable | None = None,
                        pin: PinnedKV | None = None) -> SSEResponse: ...


P = TypeVar("P")


class Handoff(ABC, Generic[P]):
    """Takes a request from its prefill's answer (of kind P) to the client's response."""

    def __init__(self, orchestration: Orchestration):
        self.o = orchestration

    @abstractmethod
    async def run(self, call: Call, prefill: P) -> Response:
        """Serve `call` given its prefill's answer: decode, splice, or a fallback."""
