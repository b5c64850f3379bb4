"""A prefix another worker holds, for the worker chosen to serve a request whole.

The selection policy picks a worker for its load as well as its cache, so the one chosen may
lack a prefix that another worker of the pool caches (the router knows from the workers' KV
events, router/kv_index.py). With --kv-peer-prefix-min-tokens N, when the best other worker holds
at least N more leading prompt tokens than the chosen one, the router asks that peer for a
one-token prefill of the prefix that keeps its blocks pinned (what it asks of a prefill worker,
`do_remote_decode`) and hands the chosen worker the pin's params as `kv_transfer_params.prefix_from`
(protocol/kv_transfer.PrefixPull). The chosen worker decides: it pulls the blocks it lacks through
its KV transport if its estimate of the pull beats its estimate of recomputing them, else it
releases the pin (worker/kv/prefix_cost.py). The side channel's authentication, the chosen
worker's --kv-peer-allow and the pin's binding to the prefix's digest apply as for a hand-off.

Anything that goes wrong here (the peer answers an error, times out, or the index was stale and
its pin covers less) costs nothing but the attempt: the request goes out without the field and
the chosen worker computes the prefix itself. A pin nobody reads is freed at its TTL.
"""

from __future__ import annotations

import json
import logging
from typing import Sequence

import aiohttp

from pdserve.protocol.contract import PATHS
from pdserve.protocol.kv_transfer import PARAM, PREFIX_FROM, prefix_pull_params, remote_decode_request
from pdserve.router.call import Call
from pdserve.router.kv_index import KVIndex
from pdserve.router.metrics import RouterMetrics
from pdserve.router.upstream import UPSTREAM_ERRORS, Upstream
from pdserve.router.workers import Worker

log = logging.getLogger(__name__)

PIN_TIMEOUT_S = 10.0  # a one-token prefill of a cached prefix; longer means the peer is busy: recompute


class PeerPrefix:
    def __init__(self, index: KVIndex | None, upstream: Upstream, metrics: RouterMetrics, min_tokens: int):
        self.index, self.up, self.metrics, self.min_tokens = index, upstream, metrics, min_tokens

    @property
    def enabled(self) -> bool:
        return self.index is not None and self.min_tokens > 0

    async def payload(self, call: Call, chosen: Worker, pool: Sequence[Worker]) -> bytes | None:
        """The body to send `chosen` for the whole request: the client's request with a peer's
        pin of the prefix it lacks, or None (send the request as it is)."""
        pin = await self.pin_for(call, chosen, pool)
        if pin is None:
            return None
        return call.raw[:-1] + f',"{PARAM}":'.encode() + json.dumps(prefix_pull_params(pin)).encode() + b"}"

    async def prefill_payload(self, call: Call, chosen: Worker, pool: Sequence[Worker], body: dict) -> bytes | None:
        """The body to send the prefill worker `chosen`: its prefill request (`body`, whose
        kv_transfer_params ask for the hand-off) with a peer's pin of the prefix it lacks, or None."""
        pin = await self.pin_for(call, chosen, pool)
        if pin is None:
            return None
        return json.dumps({**body, PARAM: {**body[PARAM], PREFIX_FROM: pin}}).encode()

    async def pin_for(self, call: Call, chosen: Worker, pool: Sequence[Worker]) -> dict | None:
        """A pin, on the worker of `pool` that caches the longest prefix of the prompt, of what it
        holds beyond what `chosen` holds; None where that is under the threshold or the pin failed."""
        if not self.enabled or not call.single_sequence:
            return None
        await call.routing.tokenize_off_loop()
        tokens = call.routing.token_ids()
        if not tokens:
            return None
        others = [w for w in pool if w is not chosen and w.routable()]
        cached = self.index.cached_tokens(tokens, [chosen.url, *(w.url for w in others)])
        mine = cached.get(chosen.url, 0)
        best = max(others, key=lambda w: cached.get(w.url, 0), default=None)
        if best is None or cached.get(best.url, 0) - mine < self.min_tokens:
            return None
        # A whole-block prefix short of the prompt's end: the chosen worker computes the rest.
        size = self.index.block_size(best.url)
        held = min(cached[best.url], (len(tokens) - 1) // size * size)
        if held - mine < self.min_tokens:
            return None
        pin = await self._pin(call, best, tokens[:held])
        self.metrics.peer_prefix_pins.labels("pinned" if pin else "failed").inc()
        return pin

    async def _pin(self, call: Call, peer: Worker, prefix: list[int]) -> dict | None:
        body = {"model": call.model, "prompt": prefix, "max_tokens": 1, PARAM: remote_decode_request()}
        try:
            async with self.up.session.post(
                peer.url + PATHS["completions"], json=body, timeout=aiohttp.ClientTimeout(total=PIN_TIMEOUT_S)
            ) as r:
                if r.status != 200:
                    log.info("peer prefix pin on %r answered %d: the chosen worker recomputes", peer, r.status)
                    return None
                answer = await r.json()
        except (*UPSTREAM_ERRORS, ValueError) as e:
            log.info("peer prefix pin on %r failed (%r): the chosen worker recomputes", peer, e)
            return None
        pin = answer.get(PARAM) if isinstance(answer, dict) else None
        return pin if isinstance(pin, dict) else None
