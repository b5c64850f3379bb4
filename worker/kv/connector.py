"""KVConnector: the worker-side half of P/D transfer; it moves bytes and owns no request.

The scheduler-side half (`connector_scheduler.KVConnectorScheduler`) decides; each step this
half gets its orders as `KVConnectorMetadata` and reports back as `KVConnectorOutput`:

  apply(meta)          the orders: prefill side, make, advance, finish, cancel or release pins
                       in the pin table; decode side, start this step's pulls (NIXL READ or TCP)
                       into blocks the scheduler allocated, on a thread pool so engine steps go
                       on meanwhile, send the releases of pins nobody will read, stop aborted pulls
  get_finished()       pulls that landed or failed; pinned requests the decode side released
                       (or that expired), whose blocks the scheduler may now free
  wait_for_loads(t)    nothing to compute until a pull lands: block briefly rather than spin
  endpoint()           the plain facts the scheduler half works from (endpoint.py)

Prefill side: the side channel serves reads, progress and releases (and NIXL notifications)
from the pin table on its own thread.

Security (docs/security.md): the side channel listens where HTTP does unless --kv-host says
otherwise, and with --kv-secret every message is authenticated both ways and names the worker
it is for (engine id, advertised host and port: a signed message is good there only);
`describe` gives only the layout, and NIXL agent metadata travels only in the reply to a lease
(a live transfer token for the reader's own prompt). Decode side: every peer host and port is
checked against --kv-peer-allow (default: nobody), and pulls run in a pool bounded per peer.
"""

from __future__ import annotations

import ipaddress
import logging
import multiprocessing
import os
import secrets
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import replace

import torch

from pdserve.protocol.flags import ConfigError
from pdserve.protocol.kv_layout import KVLayout
from pdserve.protocol.kv_transfer import KVTransferParams
from pdserve.worker.config.engine import EngineConfig
from pdserve.worker.kv import side_channel
from pdserve.worker.kv import registry
from pdserve.worker.kv.auth import SideChannelAuth
from pdserve.worker.kv.block_runs import check_indices
from pdserve.worker.kv.connector_meta import KVConnectorMetadata, KVConnectorOutput, KVPin
from pdserve.worker.kv.endpoint import KVEndpoint, allowed_peer
from pdserve.worker.kv.layer_clock import ClockWatch
from pdserve.worker.kv.messages import LeaseRequest, ProgressRequest, ReleaseRequest
from pdserve.worker.kv.metrics import KVMetrics
from pdserve.worker.kv.prefix_cost import PrefixPullCost
from pdserve.worker.kv.peer_policy import PeerPolicy
from pdserve.worker.kv.shared_clocks import ClockRing
from pdserve.worker.kv.tcp_receiver_process import ReceiverProcess
from pdserve.worker.kv.pins import LEASE_S, NotReady, PinTable
from pdserve.worker.kv.prompt_binding import bind_token
from pdserve.worker.kv.pull_pool import PullPool
from pdserve.worker.kv.rank_aggregator import RankAggregator
from pdserve.worker.kv.tp_transfer import TPRank, pull_shards, remote_tp_size
from pdserve.worker.kv.transport import KVTransport

PULL_THREADS = 16  # all peers together; --kv-max-pulls-per-peer bounds each one

_PULLED_BYTES_KEPT = 4096
log = logging.getLogger(__name__)


class KVConnector:
    def __init__(self, config: EngineConfig, cache: torch.Tensor, engine_id: str, layout: KVLayout,
                 tp: TPRank | None = None, link=None, report=None):
        """Tensor parallelism (tp_link.py): every rank has a connector over its cache shard. `tp`:
        this rank; `link`: rank 0's pipes to the other ranks; `report`: rank >= 1's way back."""
        self.engine_id = engine_id
        # Of the whole model (all ranks' heads): peers of different TP sizes compare equal and
        # map heads (tp_transfer.py).
        self.layout = layout
        self.tp = tp or TPRank(0, 1, cache.shape[4])
        self.link, self._report = link, report
        self.cache = cache  # [num_blocks, layers, 2, block_size, this rank's kv heads, head_dim]
        self.transport = config.kv_transfer or registry.default()  # its name (registry.py)
        registry.check(self.transport)
        self.num_blocks = cache.shape[0]
        # TCP senders and receivers in processes of their own map the cache (tcp_sender_process.py,
        # tcp_receiver_process.py): on the CPU its storage moves to shared memory here, before any
        # transport registers its address.
        tcp_io = config.kv_tcp_io
        if tcp_io == "process" and multiprocessing.current_process().daemon:
            # A tensor-parallel follower rank is a daemonic process, which may not start children.
            log.warning("--kv-tcp-io process: rank %d's TCP data connections run as threads (a tensor-parallel "
                        "follower cannot start a process)", self.tp.rank)
            tcp_io = "thread"
        self.tcp_senders = tcp_io if config.role != "decode" else "thread"
        self.clock_ring = ClockRing(cache.shape[1], cache.device) if self.tcp_senders == "process" else None
        if tcp_io == "process" and cache.device.type == "cpu":
            _check_shm(cache.numel() * cache.element_size())
            cache.share_memory_()
        self.blocks = cache.view(torch.uint8).view(self.num_blocks, -1)  # [num_blocks, block_bytes]
        self.block_bytes = self.blocks.shape[1]
        self.pins = PinTable(config.kv_pin_ttl)
        self.metrics = KVMetrics(PrefixPullCost(config.kv_prefix_pull_bandwidth * 1e9))
        self.policy = PeerPolicy(config.kv_peer_allow)
        if config.role != "prefill" and self.tp.rank == 0:  # this worker may act as decode (said once)
            if self.policy.empty:  # only `both` gets here: a decode worker without peers refuses to start
                log.error("this worker (role %s, --kv-transfer %s) may decode for a prefill worker but "
                          "--kv-peer-allow is empty: it pulls from no one, so every P/D request it gets is "
                          "prefilled here again (counted in pdserve_kv_local_prefill_fallbacks_total). Name "
                          "the prefill workers' addresses and KV ports in --kv-peer-allow", config.role,
                          config.kv_transfer)
            elif any_port := self.policy.any_port():
                log.warning("--kv-peer-allow %s allows every port of those hosts: params naming such a host may "
                            "make this worker connect to any of its ports; add the prefill KV ports "
                            "(e.g. %s:5600-5607)", " ".join(any_port), any_port[0])
        self.auth = SideChannelAuth(config.kv_secret)
        self.tcp_receiver = ReceiverProcess(self.blocks, self.auth) \
            if tcp_io == "process" and config.role != "prefill" else None
        self.port = config.kv_port + self.tp.rank  # a TP prefill worker serves rank r's shard on kv_port + r
        self.timeout = config.kv_pull_timeout
        # Listen where HTTP listens unless told otherwise; advertise an address peers can use.
        self.bind_host = config.kv_host or config.kv_bind_host or "127.0.0.1"
        advertised = config.kv_host or os.environ.get("POD_IP")
        if advertised is None:
            advertised = "127.0.0.1" if _is_wildcard(self.bind_host) else self.bind_host
        self.host = advertised
        # This worker's transport, and the base one every prefill worker serves besides its own
        # (the decode side reads with it params of a transport it lacks).
        agent = f"pdserve-{engine_id}" + (f"-r{self.tp.rank}" if self.tp.size > 1 else "")
        self.kv: KVTransport = registry.transport_class(self.transport).start(agent, cache, self.block_bytes)
        self.base: KVTransport = self.kv if self.transport == registry.BASE else \
            registry.transport_class(registry.BASE).start(agent, cache, self.block_bytes)
        self.server: side_channel.SideChannelServer | None = None
        self.pool = PullPool(PULL_THREADS, config.kv_max_pulls_per_peer, cooldown_s=min(10.0, self.timeout))
        self._loading: dict[str, Future] = {}  # request id -> its pull (step thread only)
        # request id -> bytes its landed pull moved, until the engine reports it (step thread
        # only); bounded: an aborted request's entry is never read.
        self.pulled_bytes: dict[str, int] = {}
        self._first_tokens: dict[str, int] = {}  # streamed pulls: the prefill's first token (pull threads write)
        self._stopping: set[str] = set()  # streamed pulls whose request was aborted (stop between chunks)
        self._landing: set[str] = set()  # streamed pulls whose prefill runs its last step (or ended)
        # Rank 0 of a TP worker (step thread only): the followers' parts of pulls and pins.
        self.ranks = RankAggregator(self.tp.size - 1) if link is not None else None
        # Pulls over several remote shards (either side tensor-parallel): reads keep the remote
        # pins, released here once the whole pull is over.
        self._release_after: dict[str, KVTransferParams] = {}
        if link is not None:
            link.send(("init", engine_id, layout))

    # -- prefill side -------------------------------------------------------------------------

    def start_server(self) -> None:
        handlers = {"describe": self._describe, "lease": self._lease, "release": self._release,
                    "progress": self._progress}
        for transport in {id(t): t for t in (self.base, self.kv)}.values():
            handlers.update(transport.serve(self))
        self.server = side_channel.SideChannelServer(self.bind_host, self.port, handlers, self.auth, tick=self._tick,
                                                     identity=side_channel.destination(self.engine_id, self.host,
                                                                                       self.port))
        self.pins.on_change = self.server.wake  # a reader waiting for a chunk hears of it at once
        self._clock_watch = ClockWatch(self.server.wake)  # ... or for a layer of a running step
        self.server.start()
        log.info("KV side channel on %s:%d (advertised as %s), transport %s, %s", self.bind_host, self.port,
                 self.host, self.transport, "authenticated" if self.auth.enabled else "UNAUTHENTICATED")
        if not self.auth.enabled:
            log.warning("KV side channel without --kv-secret: any host that reaches %s:%d can ask it for pinned "
                        "blocks with a transfer token; set --kv-secret (or PDSERVE_KV_SECRET) on every worker",
                        self.bind_host, self.port)

    active = True  # KV moves: see null_connector.NullKVConnector

    def collectors(self) -> list:
        """Prometheus collectors of KV transfer, for the process's registry."""
        return [self.metrics]

    def observe_decode_waits(self, admitted_s: float | None, landed_s: float | None) -> None:
        self.metrics.observe_decode_waits(admitted_s, landed_s)

    def health(self) -> str | None:
        """None while the side channel serves; else why not (the worker's /health turns 503)."""
        if self.server is not None and not self.server.healthy:
            return "the KV side channel thread has stopped"
        return None

    def endpoint(self) -> KVEndpoint:
        """What the scheduler half may know of this side (it never calls this object)."""
        return KVEndpoint(self.engine_id, self.host, self.port, self.layout, self.transport, self.tp.size,
                          self.num_blocks, self.pins.ttl, self.server is not None, self.policy, self.metrics,
                          self.block_bytes * self.tp.size)

    def pin(self, request_id: str, block_ids: list[int], num_prompt_tokens: int, first_token_id: int,
            prompt_digest: str) -> KVTransferParams:
        """Pin blocks without a scheduler (benchmarks, tests): what a finished prefill's pin order does."""
        token = bind_token(secrets.token_urlsafe(24), prompt_digest)
        self.apply(KVConnectorMetadata(pins=[KVPin(request_id, list(block_ids), token, prompt_digest)]))
        return self.endpoint().params(request_id, block_ids, num_prompt_tokens, token, first_token_id)

    def _describe(self, body):
        # Layout only: a transport's metadata would let the asker READ/WRITE the whole cache (see _lease).
        return {"engine_id": self.engine_id, "kv_layout": str(self.layout), "block_bytes": self.block_bytes,
                "transport": self.transport}, []

    def _lease(self, body):
        if not self.kv.leases:
            self.kv.metadata()  # refuses: this worker's readers use `read`
        req = LeaseRequest.from_body(body)
        ids = self.pins.lease(req.request_id, req.token, LEASE_S, req.prompt_digest, req.waits_for)
        reply = {"engine_id": self.engine_id, "prompt_digest": req.prompt_digest, "tp_rank": self.tp.rank,
                 "block_ids": [ids[i] for i in check_indices(req.indices, len(ids))]}
        if req.want_metadata:
            reply[self.transport] = self.kv.metadata()
        return reply, []

    def _progress(self, body):
        """A streamed pin's progress (pins.NotReady defers the reply until it changes)."""
        req = ProgressRequest.from_body(body)
        rid, digest = req.request_id, req.prompt_digest
        have = -1 if req.deadline else req.have  # past the deadline: what there is
        if req.lease and not self.kv.leases:
            self.kv.metadata()  # refuses: this worker's readers use `read`
        try:
            state = self.pins.progress(rid, req.token, digest, have, LEASE_S if req.lease else 0.0,
                                       last_seen=req.last_seen, layers=req.layers)
        except NotReady as e:
            if e.clock is not None:  # waits for a running step's next layer, not for a pin change
                self._clock_watch.watch(e.clock, e.layer)
            raise
        reply = {"engine_id": self.engine_id, "prompt_digest": digest, "tp_rank": self.tp.rank, **state}
        if "block_ids" in state and req.want_metadata:  # leased: as `lease` gives it
            reply[self.transport] = self.kv.metadata()
        return reply, []

    def _release(self, body):
        req = ReleaseRequest.from_body(body)
        return {"released": self.pins.release(req.request_id, req.token)}, []

    def _tick(self) -> None:
        """Side-channel thread, every poll: the transport's own releases; on rank >= 1, pins that are gone."""
        self.kv.tick(self._released)
        if self._report is not None:
            for rid, _, _ in self.pins.collect():
                self._report(("unpinned", self.tp.rank, rid))

    def _released(self, request_id: str, token: str, nbytes: int) -> None:
        """A release the transport carried (a reader's notification once its READ landed)."""
        if self.pins.release(request_id, token):
            self.metrics.bytes.labels("send", self.transport).inc(nbytes)

    # -- decode side: the step's orders and what came of them (step thread) ---------------------

    def apply(self, meta: KVConnectorMetadata) -> None:
        """Step thread: carry out the scheduler half's orders (connector_meta.py): the pin table's
        changes, then this step's pulls (on a thread pool, so steps go on meanwhile), the releases
        of pins nobody will read, and stops of aborted pulls. Under tensor parallelism every rank
        gets the same orders: it mirrors the pins and pulls its own heads into the same blocks."""
        if not meta:
            return
        if self.link is not None:
            # Releases of remote pins reach every remote rank from here. New pins are acknowledged.
            self.link.send(("orders", replace(meta, releases=[])), ack=bool(meta.pins))
            for load in meta.loads:
                self.ranks.pull_started(load.request_id)
        self._apply_pin_orders(meta)
        for load in meta.loads:
            if self._tp_pull(load.params):
                self._release_after[load.request_id] = load.params
            self._loading[load.request_id] = self.pool.submit(
                _peer(load.params), self._pull, load.params, load.indices, load.dst_blocks, load.prompt_digest,
                load.request_id)
        for params in meta.releases:
            self.pool.submit(_peer(params), self._release_quietly, params)
        self._stopping.update(rid for rid in meta.cancels if rid in self._loading)

    def apply_follower(self, meta: KVConnectorMetadata) -> None:
        """Rank >= 1: rank 0's orders, on this rank's shard (a follower's pulls report back)."""
        self._apply_pin_orders(meta)
        self.start_follower_loads(meta.loads)
        self._stopping.update(meta.cancels)

    def _apply_pin_orders(self, meta: KVConnectorMetadata) -> None:
        for p in meta.pins:
            if p.ready is None:
                self.pins.add(p.request_id, p.block_ids, p.prompt_digest, token=p.token)
            else:
                self.pins.add_streamed(p.request_id, p.block_ids, p.prompt_digest, p.ready, token=p.token)
        for rid, ready in meta.advances:  # a step ended with this many leading blocks written
            self.pins.advance(rid, ready)
        for rid in meta.last_steps:
            self.pins.last_step(rid)
        for rid, first_token_id in meta.finishes:
            self.pins.finish(rid, first_token_id)  # a pin released meanwhile stays released
        for rid in meta.cancelled_pins:
            self.pins.cancel(rid)
        for rid, token in meta.unpins:  # freed, as a reader's release would free it, by get_finished
            self.pins.release(rid, token)

    def computing(self, orders: list[tuple[str, int]], clock) -> None:
        """Step thread, before launching a step that computes streamed prefills: (request, blocks
        it completes) each, written layer by layer as `clock` tells (a layered TCP stream read
        sends them so). Not under tensor parallelism: its pulls read whole blocks per rank."""
        if self.link is None and self.tp.size == 1:
            for rid, upto in orders:
                self.pins.computing(rid, upto, clock)

    def get_finished(self) -> KVConnectorOutput:
        out = KVConnectorOutput()
        for rid, block_ids, expired in self.pins.collect():
            if expired:
                log.warning("KV pin of %s expired after %.0fs without a release; freeing %d blocks",
                            rid, self.pins.ttl, len(block_ids))
            if self.ranks is None:
                out.finished_sending.append(rid)
            else:
                self.ranks.pin_gone_here(rid)
        if self.ranks is not None:
            for msg in self.link.reports():
                self.ranks.report(msg)
            out.finished_sending.extend(self.ranks.sent())
        for rid, fut in list(self._loading.items()):
            if not fut.done() or (self.ranks is not None and self.ranks.followers_pulling(rid)):
                continue
            del self._loading[rid]
            follower_error = self.ranks.finish_pull(rid) if self.ranks is not None else None
            self._stopping.discard(rid)
            if rid in self._first_tokens:
                out.first_tokens[rid] = self._first_tokens.pop(rid)
            error = fut.exception() or follower_error
            if error is None:
                out.finished_recving.append(rid)
                if isinstance(fut.result(), int):  # the bytes it moved, for the request's trace
                    self.pulled_bytes[rid] = fut.result()
                    if len(self.pulled_bytes) > _PULLED_BYTES_KEPT:
                        del self.pulled_bytes[next(iter(self.pulled_bytes))]
            else:
                log.warning("KV pull for %s failed: %s", rid, error)
                out.failed_recving.append(rid)
                if isinstance(error, PullStopped):
                    out.stopped_recving.append(rid)
            params = self._release_after.pop(rid, None)
            if params is not None:  # every rank has read (or given up): free every prefill rank's pin
                self.pool.submit(_peer(params), self._release_quietly, params)
        return out

    def start_follower_loads(self, loads: list) -> None:
        """Rank >= 1: rank 0's pulls of this step, for this rank's heads; each reports when done."""
        for load in loads:
            fut = self.pool.submit(_peer(load.params), self._pull, load.params, load.indices, load.dst_blocks,
                                   load.prompt_digest, load.request_id)
            fut.add_done_callback(lambda f, rid=load.request_id: self._follower_pulled(rid, f))

    def _follower_pulled(self, rid: str, fut: Future) -> None:
        self._first_tokens.pop(rid, None)  # rank 0 hands the first token on
        self._stopping.discard(rid)
        self._report(("pulled", self.tp.rank, rid, None if fut.exception() is None else str(fut.exception())))

    def pull_landing(self) -> bool:
        """Whether a pull is about to land or has landed unreported: a streamed pull's prefill
        runs its last step (or ended, and the last read runs), or a pull is over. An
        async-scheduling engine then plans its next step only once the pull landed or the step
        in flight is done (`wait_for_landing`), so that request joins the step right after its
        landing, not the one after that (launched, with overlap, before the landing was known)."""
        return bool(self._landing) or any(f.done() for f in list(self._loading.values()))

    def wait_for_landing(self, until: Callable[[], bool], poll_s: float = 100e-6) -> bool:
        """While `pull_landing`: wait until a pull is over (True; get_finished reports it) or
        `until()` (False), whichever comes first. An async-scheduling engine calls it with "the
        step in flight is done": a pull that lands while the device still runs that step joins
        the step planned now, launched behind it (a late join: the overlap is kept, no host gap
        on the first gap). `until` is polled every `poll_s` (a CUDA event query)."""
        if self.ranks is not None:  # TP: the followers' parts land on their own; not overlapped
            return False
        while True:
            loading = list(self._loading.values())
            if any(f.done() for f in loading):
                return True
            if until() or not loading:
                return False
            wait(loading, timeout=poll_s, return_when=FIRST_COMPLETED)

    def wait_for_loads(self, timeout: float) -> None:
        if self._loading:
            if self.link is None or not any(f.done() for f in self._loading.values()):
                wait(self._loading.values(), timeout=timeout, return_when=FIRST_COMPLETED)
            else:  # some landed here and wait on the other ranks: their reports wake us
                self.link.wait(timeout)
        else:  # nothing could be scheduled (no free blocks, or pins at their cap): wait for a release
            time.sleep(timeout)

    # -- decode side: moving bytes (pull threads) -------------------------------------------------

    def _pull(self, params: KVTransferParams, indices: list[int], dst_blocks: list[int], digest: str,
              rid: str = "") -> int:
        """Pull remote blocks at `indices` (positions in remote_block_ids) into `dst_blocks`, for
        our request `rid`."""
        t0 = time.perf_counter()
        transport = self.kv if params.transport == self.transport else self.base
        try:
            host = self.allowed_peer(params)
            if params.stream_kv:
                try:
                    nbytes = self._stream_pull(rid, host, params, indices, dst_blocks, digest, transport)
                finally:
                    self._landing.discard(rid)
            else:
                nbytes = self._pull_blocks(host, params, indices, dst_blocks, digest, transport, last=True)
        except Exception:
            self.metrics.failures.labels("recv", transport.name).inc()
            # Let the prefill side free its blocks now rather than at TTL (a slow peer's pin, a
            # NIXL lease, would hold them): off this failure's path, so a dead peer delays nothing.
            # Under TP rank 0 releases once all ranks are done.
            if not self._tp_pull(params):
                self.pool.submit(_peer(params), self._release_quietly, params)
            raise
        seconds = time.perf_counter() - t0
        self.metrics.observe_pull(transport.name, nbytes, seconds)
        if not params.stream_kv:  # a streamed pull's time is the prefill's too, not the link's alone
            self.metrics.prefix_cost.observe_pull(nbytes, seconds)
        if params.kv_layout.hybrid:
            # The load lists the full group's blocks it lacks, then the sliding ones it lacks within
            # the window: each full block beyond the sliding ones is a sliding block left behind.
            n = -(-params.num_prompt_tokens // params.block_size)
            full = sum(1 for i in indices if i < n)
            self.metrics.window_skipped.labels("recv", transport.name).inc((2 * full - len(indices)) * self.block_bytes)
        return nbytes

    def _pull_blocks(self, host: str, params: KVTransferParams, indices: list[int], dst_blocks: list[int], digest: str,
                     transport: KVTransport, last: bool) -> int:
        """One read of blocks the prefill side has computed; `last`: the read also releases the
        pin (a tensor-parallel pull never does: rank 0 releases once every rank has read)."""
        port = params.remote_port
        if self._tp_pull(params):
            return pull_shards(self, host, params, indices, dst_blocks, digest, transport)
        return transport.pull(self, host, port, params, indices, dst_blocks, digest, release=last)

    def _stream_pull(self, rid: str, host: str, params: KVTransferParams, indices: list[int], dst_blocks: list[int],
                     digest: str, transport: KVTransport) -> int:
        """A streamed hand-off: read each chunk of the blocks we lack as soon as the prefill has
        computed it (the side channel answers `progress` when more blocks are ready), until
        the prefill ends with its first token. Every read keeps the pin; it is released after the
        last one (by rank 0 under tensor parallelism), never while a read may still run."""
        want = dict(zip(indices, dst_blocks))  # remote positions we lack -> our blocks
        port, n = params.remote_port, len(params.remote_block_ids)
        have, nbytes = 0, 0
        # Over NIXL (one rank each side) every progress reply is also the lease of the pin: the
        # chunk it announces is READ at once, one round trip per chunk instead of two (the last
        # chunk's is on the first token's gap).
        leased = transport.leases and not self._tp_pull(params)
        # Over TCP (one rank each side) the blocks move as one stream read, whose senders follow
        # the prefill (tcp_stream.py): no round trip, connection or pipeline refill per chunk. It
        # starts once the prefill's first step has written its first group of layers (a progress
        # with `layers` 0 hears of it; a prefill of an earlier release answers at its first chunk), not at
        # admission: a prefill still queued would hold send streams for nothing. So a prompt
        # computed in one step moves layer by layer while it runs too. This loop then follows
        # the pin only (last step, first token, cancel), and waits for the read's bytes once the
        # prefill is done.
        streamed = transport.streams and not self._tp_pull(params)
        # A NIXL reader also asks for the layers of the step that is writing the next blocks
        # (pins.PinTable.progress `partial`), so the prefill's last step leaves layer by layer
        # while it runs: when its forward ends, only its last layers are left to READ.
        held = [0, 0]  # NIXL: [layers held, up to which block] of the blocks after `have`
        reader = None  # transport.open_stream's
        stalled_since = time.monotonic()
        done_at = None  # when the reply that the prefill is done came (the pull's tail starts)
        try:
            while True:
                if rid in self._stopping:
                    raise PullStopped("the request was aborted")
                unknown = leased and not transport.knows_peer(params.remote_engine_id)
                asked = time.monotonic()
                p = side_channel.progress(host, port, params, digest, have, self.timeout, self.auth,
                                          lease=leased, want_metadata=unknown, last_seen=rid in self._landing,
                                          layers=held[0] if leased else 0 if streamed and reader is None else None)
                log.debug("KV progress of %s: %d/%d blocks ready, %s%s, after %.2f ms", rid, min(p.ready, n), n,
                          p.state, " (last step)" if p.last else "", (time.monotonic() - asked) * 1e3)
                if p.last:
                    self._landing.add(rid)  # the prefill's last step runs: the KV lands within about one step
                if p.state == "cancelled":
                    raise PullStopped("the prefill worker cancelled the prefill")
                ready = min(p.ready, n)
                # A peer that answers but never computes another chunk costs what a silent one does.
                part = p.partial  # only a reader that asked with `layers` gets one
                if ready > have or p.state == "done" or (part is not None and part[1] > held[0]):
                    stalled_since = time.monotonic()
                elif time.monotonic() - stalled_since > self.timeout:
                    raise side_channel.PeerTimeout(f"KV peer {host}:{port} computed no chunk of {rid} for "
                                                   f"{self.timeout:.0f}s")
                if p.state == "done":
                    done_at = time.perf_counter()
                    token = p.first_token_id
                    if type(token) is not int:
                        raise side_channel.SideChannelError(f"KV peer {host}:{port} sent no first token")
                    self._first_tokens[rid] = token  # known even if a read below fails: local prefill then
                    self._landing.add(rid)  # only the last chunk's read is left: see pull_landing
                chunk = [i for i in range(have, ready) if i in want]
                try:
                    if reader is not None:
                        reader.raise_if_failed()
                    elif streamed and (chunk or part):  # the prefill's first step is running
                        rest = sorted(i for i in want if i >= have)
                        reader = transport.open_stream(self, host, port, params, rest, [want[i] for i in rest], digest)
                    elif leased:
                        nbytes += transport.read_layered(self, params, p, have, ready, held, want)
                    elif chunk:
                        nbytes += self._pull_blocks(host, params, chunk, [want[i] for i in chunk], digest, transport,
                                                    last=False)
                    if reader is not None and p.state == "done":
                        nbytes += reader.result()  # the prefill is done: only the last chunk's bytes are left
                except Exception:
                    # A read the prefill side broke off because it cancelled the prefill (its first
                    # token ended the request, or it was aborted) ends the request here too.
                    if self._cancelled(host, params, digest):
                        raise PullStopped("the prefill worker cancelled the prefill") from None
                    raise
                have = max(have, ready)
                if p.state == "done":
                    break
            tail = time.perf_counter() - done_at
            self.metrics.observe_pull_tail(transport.name, tail)
            log.debug("KV pull of %s (%s): %.3f MiB, its tail %.2f ms after the prefill was done", rid,
                      params.remote_request_id, nbytes / 2**20, tail * 1e3)
        finally:
            if reader is not None:
                reader.stop()  # a read still running ends here: no byte lands after the pull ended
        if not self._tp_pull(params):
            self.pool.submit(_peer(params), self._release_quietly, params)  # off this pull's path
        return nbytes

    def _cancelled(self, host: str, params: KVTransferParams, digest: str) -> bool:
        """Whether the prefill side says this streamed pin was cancelled (False: it cannot say)."""
        try:
            p = side_channel.progress(host, params.remote_port, params, digest, -1, min(5.0, self.timeout), self.auth)
        except Exception:
            return False
        return p.state == "cancelled"

    def allowed_peer(self, params: KVTransferParams) -> str:
        """The address to pull these params' blocks from, or PeerNotAllowed (endpoint.allowed_peer)."""
        return allowed_peer(self.policy, params)

    def _tp_pull(self, params: KVTransferParams) -> bool:
        """Either side is tensor-parallel: heads map across ranks, reads keep the pin, rank 0 releases."""
        try:
            return self.tp.size > 1 or remote_tp_size(params) > 1
        except ValueError:
            return True  # the pull refuses it (and falls back to local prefill)

    def _release_quietly(self, params: KVTransferParams) -> None:
        """Best effort: tell the prefill worker we will not read (more of) its pin (every rank's,
        when it is tensor-parallel). Its TTL is the backstop."""
        try:
            host = self.allowed_peer(params)  # never contact a peer we would not pull from
            ranks = remote_tp_size(params)
        except Exception as e:
            log.debug("KV release of %s not sent: %s", params.remote_request_id, e)
            return
        for rank in range(ranks):
            try:
                side_channel.call(host, params.remote_port + rank, "release",
                                  ReleaseRequest(params.remote_request_id, params.transfer_token).to_body(),
                                  min(5.0, self.timeout), self.auth, params.remote_engine_id)
            except Exception as e:
                log.debug("KV release of %s (rank %d) failed: %s", params.remote_request_id, rank, e)

    def shutdown(self) -> None:
        self.pool.shutdown()
        if self.server:
            self.server.stop()
            self._clock_watch.stop()
        # e.g. NIXL deregisters and frees its staging buffers, TCP stops its data listener
        for transport in {id(t): t for t in (self.base, self.kv)}.values():
            transport.close()
        if self.tcp_receiver is not None:
            self.tcp_receiver.close()


class PullStopped(RuntimeError):
    """A streamed pull ended early: its request was aborted here, or the prefill was cancelled."""


def _check_shm(nbytes: int, path: str = "/dev/shm") -> None:
    """ConfigError unless `path` can hold a CPU cache of `nbytes` (a tmpfs past its size kills
    the process that touches the page, SIGBUS, rather than failing the allocation)."""
    try:
        st = os.statvfs(path)
    except OSError as e:
        raise ConfigError("--kv-tcp-io", f"process shares the CPU KV cache through {path}, which is not usable "
                                         f"({e}); use --kv-tcp-io thread") from None
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        raise ConfigError("--kv-tcp-io", f"process shares the CPU KV cache ({nbytes / 2**30:.2f} GiB) through {path}, "
                                         f"which has {free / 2**30:.2f} GiB free: enlarge it (a pod's shmSize, "
                                         f"docker --shm-size), lower --kv-cache-memory, or use --kv-tcp-io thread")


def _peer(params: KVTransferParams) -> tuple[str, int]:
    return params.remote_host, params.remote_port


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False
