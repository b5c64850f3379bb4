"""KVConnector: the worker-side half of P/D transfer; it moves bytes and owns no request.

The scheduler-side half (`connector_scheduler.KVConnectorScheduler`) decides; each step this
half gets its orders as `KVConnectorMetadata` and reports back as `KVConnectorOutput`:

  start_load_kv(meta)  start this step's pulls (NIXL READ or TCP) into blocks the scheduler
                       allocated, on a thread pool so engine steps go on meanwhile; send the
                       releases of pins nobody will read
  get_finished()       pulls that landed or failed; pinned requests the decode side released
                       (or that expired), whose blocks the scheduler may now free
  wait_for_loads(t)    nothing to compute until a pull lands: block briefly rather than spin

Prefill side: `pin()` records a finished prefill's blocks in the pin table and describes them
in kv_transfer_params; the side channel serves reads and releases (and NIXL notifications)
from that table on its own thread. Every peer is checked against --kv-peer-allow first.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from pdserve.worker.config import EngineConfig
from pdserve.worker.kv import side_channel
from pdserve.worker.kv.connector_meta import KVConnectorMetadata, KVConnectorOutput
from pdserve.worker.kv.metrics import KVMetrics
from pdserve.worker.kv.nixl_transport import NixlTransport, nixl_available
from pdserve.worker.kv.peer_policy import PeerPolicy
from pdserve.worker.kv.pins import LEASE_S, PinTable
from pdserve.worker.kv.tcp_transport import TcpServer, tcp_pull

log = logging.getLogger(__name__)


class KVConnector:
    def __init__(self, config: EngineConfig, cache: torch.Tensor, engine_id: str, layout: str):
        self.engine_id = engine_id
        self.layout = layout  # "<layers>x<kv heads>x<head dim>:<dtype>:<block size>"
        self.transport = config.kv_transfer or ("nixl" if nixl_available() else "tcp")
        if self.transport == "nixl" and not nixl_available():
            from pdserve.worker.config import ConfigError

            raise ConfigError("--kv-transfer", "nixl needs the nixl extra: pip install 'pdserve[nixl]'")
        self.num_blocks = cache.shape[0]
        self.blocks = cache.view(torch.uint8).view(self.num_blocks, -1)  # [num_blocks, block_bytes]
        self.block_bytes = self.blocks.shape[1]
        self.pins = PinTable(config.kv_pin_ttl)
        self.metrics = KVMetrics()
        self.policy = PeerPolicy(config.kv_peer_allow)
        self.port = config.kv_port
        self.timeout = config.kv_pull_timeout
        self.host = config.kv_host or os.environ.get("POD_IP") or "127.0.0.1"
        self.nixl = None
        if self.transport == "nixl":
            try:
                self.nixl = NixlTransport(f"pdserve-{engine_id}", cache, self.block_bytes)
            except Exception as e:  # e.g. UCX_TLS names transports this host cannot connect with
                from pdserve.worker.config import ConfigError

                raise ConfigError("--kv-transfer", f"nixl could not start its UCX backend ({e}); check UCX_TLS "
                                                   f"or use --kv-transfer tcp") from e
        self.server: side_channel.SideChannelServer | None = None
        self.executor = ThreadPoolExecutor(4, thread_name_prefix="kv-pull")
        self._loading: dict[str, Future] = {}  # request id -> its pull (step thread only)

    # -- prefill side -------------------------------------------------------------------------

    def start_server(self, bind_host: str = "0.0.0.0") -> None:
        tcp = TcpServer(self.blocks, self.pins, lambda n: self.metrics.bytes.labels("send", "tcp").inc(n))
        handlers = {"describe": self._describe, "lease": self._lease, "release": self._release, "read": tcp.handle_read}
        self.server = side_channel.SideChannelServer(bind_host, self.port, handlers, tick=self._nixl_tick if self.nixl else None)
        self.server.start()
        log.info("KV side channel on %s:%d (advertised as %s), transport %s", bind_host, self.port, self.host, self.transport)

    def pin(self, request_id: str, block_ids: list[int], num_prompt_tokens: int, first_token_id: int) -> dict:
        token, expires_at = self.pins.add(request_id, block_ids)
        return {
            "remote_engine_id": self.engine_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_request_id": request_id,
            "remote_block_ids": block_ids,
            "num_prompt_tokens": num_prompt_tokens,
            "first_token_id": first_token_id,
            "transfer_token": token,
            "expires_at": expires_at,
            "kv_layout": self.layout,
            "transport": self.transport,
        }

    def _describe(self, body):
        desc = {"engine_id": self.engine_id, "kv_layout": self.layout, "block_bytes": self.block_bytes}
        if self.nixl:
            desc["nixl"] = self.nixl.describe()
        return desc, [], None

    def _lease(self, body):
        ids = self.pins.lease(body["request_id"], body["token"], LEASE_S)
        return {"block_ids": [ids[i] for i in body["indices"]]}, [], None

    def _release(self, body):
        return {"released": self.pins.release(body["request_id"], body["token"])}, [], None

    def _nixl_tick(self) -> None:
        for msg in self.nixl.notifications():
            if msg.get("op") == "release" and self.pins.release(msg.get("request_id", ""), msg.get("token", "")):
                self.metrics.bytes.labels("send", "nixl").inc(msg.get("bytes", 0))

    # -- decode side: the step's orders and what came of them (step thread) ---------------------

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        for load in meta.loads:
            self._loading[load.request_id] = self.executor.submit(self._pull, load.params, load.indices,
                                                                  load.dst_blocks)
        for params in meta.releases:
            self.executor.submit(self._release_quietly, params)

    def get_finished(self) -> KVConnectorOutput:
        out = KVConnectorOutput()
        for rid, block_ids, expired in self.pins.collect():
            if expired:
                log.warning("KV pin of %s expired after %.0fs without a release; freeing %d blocks",
                            rid, self.pins.ttl, len(block_ids))
            out.finished_sending.append(rid)
        for rid, fut in list(self._loading.items()):
            if not fut.done():
                continue
            del self._loading[rid]
            if fut.exception() is None:
                out.finished_recving.append(rid)
            else:
                log.warning("KV pull for %s failed: %s", rid, fut.exception())
                out.failed_recving.append(rid)
        return out

    def wait_for_loads(self, timeout: float) -> None:
        if self._loading:
            wait(self._loading.values(), timeout=timeout, return_when=FIRST_COMPLETED)

    # -- decode side: moving bytes (pull threads) -------------------------------------------------

    def _pull(self, params: dict, indices: list[int], dst_blocks: list[int]) -> int:
        """Pull remote blocks at `indices` (positions in remote_block_ids) into `dst_blocks`."""
        t0 = time.perf_counter()
        transport = params.get("transport", "tcp")
        try:
            host = self.policy.check(str(params["remote_host"]))
            port = int(params["remote_port"])
            if transport == "nixl" and self.nixl is not None:
                nbytes = self._nixl_pull(host, port, params, indices, dst_blocks)
            else:
                transport = "tcp"
                nbytes = tcp_pull(host, port, params, indices, dst_blocks, self.blocks, self.timeout)
        except Exception:
            self.metrics.failures.labels("recv", transport).inc()
            self._release_quietly(params)  # let the prefill side free its blocks now rather than at TTL
            raise
        self.metrics.bytes.labels("recv", transport).inc(nbytes)
        self.metrics.seconds.labels("recv", transport).observe(time.perf_counter() - t0)
        return nbytes

    def _nixl_pull(self, host, port, params, indices, dst_blocks) -> int:
        engine_id = params["remote_engine_id"]
        peer = self.nixl.known_peer(engine_id)
        if peer is None:
            desc, _ = side_channel.call(host, port, "describe", {}, self.timeout)
            if desc["engine_id"] != engine_id or "nixl" not in desc:
                raise side_channel.SideChannelError(f"KV peer {host}:{port} is not NIXL engine {engine_id}")
            peer = self.nixl.add_peer(engine_id, desc["nixl"])
        rid, token = params["remote_request_id"], params["transfer_token"]
        reply, _ = side_channel.call(host, port, "lease", {"request_id": rid, "token": token, "indices": indices},
                                     self.timeout)
        nbytes = len(dst_blocks) * self.block_bytes
        notif = {"op": "release", "request_id": rid, "token": token, "bytes": nbytes}
        return self.nixl.read(peer, reply["block_ids"], dst_blocks, notif, self.timeout)

    def _release_quietly(self, params: dict) -> None:
        """Best effort: tell the prefill worker we will not read (more of) its pin. Its TTL is the backstop."""
        try:
            host = self.policy.check(str(params["remote_host"]))  # never contact a peer we would not pull from
            side_channel.call(host, int(params["remote_port"]), "release",
                              {"request_id": params["remote_request_id"], "token": params["transfer_token"]}, 5.0)
        except Exception as e:
            log.debug("KV release of %s failed: %s", params.get("remote_request_id"), e)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.server:
            self.server.stop()
