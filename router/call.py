"""One client request on its way through the router, and a prefill's KV waiting for its decode
worker: what the orchestrator and the hand-offs (router/handoff/) pass between them."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pdserve.protocol.contract import HEADER_REQUEST_ID
from pdserve.protocol.kv_transfer import PARAM as KV_TRANSFER_PARAMS
from pdserve.router.policies import RoutingRequest
from pdserve.router.upstream import Upstream
from pdserve.router.workers import Worker


@dataclass
class Call:
    """One client request on its way through."""

    route: str  # "chat" or "completions"
    body: dict  # the validated request (router/intake.py): its fields the client set, nothing else
    raw: bytes  # `body` as JSON: a JSON object (forwarded as-is to a worker serving it whole)
    request_id: str
    routing: RoutingRequest
    started: float
    prompt_tokens: int = 0  # counted with the arrival (exact with --tokenizer, else estimated)
    disaggregated: bool = False
    moved: bool = False  # served whole by the other role after its own pool took nothing (fallback.py)
    accepted: bool = False  # a worker took it (its first 2xx): counted as an arrival

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def include_usage(self) -> bool:
        return bool((self.body.get("stream_options") or {}).get("include_usage"))

    def headers(self) -> dict[str, str]:
        return {"content-type": "application/json", HEADER_REQUEST_ID: self.request_id}

    def decode_payload(self, kv_transfer_params: dict) -> bytes:
        """The client's request (as validated: `raw`, which carries no kv_transfer_params) with
        the prefill's params added: spliced into its JSON, not the body serialised again."""
        return self.raw[:-1] + f',"{KV_TRANSFER_PARAMS}":'.encode() + json.dumps(kv_transfer_params).encode() + b"}"


@dataclass
class PinnedKV:
    """A prefill's KV waiting for its decode worker. Once a decode worker may hold the params
    (`sent`), that worker reads or releases the pin; until then, giving up is the router's to
    report, or the blocks stay pinned until the TTL."""

    worker: Worker  # the prefill worker
    params: dict
    sent: bool = False

    def abandon(self, upstream: Upstream) -> None:
        """The router gives up on the hand-off: a pin no decode worker was sent is released."""
        if not self.sent:
            upstream.release_kv(self.worker, self.params)
            self.sent = True
