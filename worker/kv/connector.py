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
from that table on its own thread.

Security (docs/security.md): the side channel listens where HTTP does unless --kv-host says
otherwise, and with --kv-secret every message is authenticated both ways; `describe` gives
only the layout, and NIXL agent metadata travels only in the reply to a lease (a live
transfer token for the reader's own prompt). Decode side: every peer is checked against
--kv-peer-allow (default: nobody), and pulls run in a pool bounded per peer.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait

import torch

from pdserve.protocol.kv_transfer import KVTransferParams
from pdserve.worker.config import EngineConfig
from pdserve.worker.kv import side_channel
from pdserve.worker.kv.auth import SideChannelAuth
from pdserve.worker.kv.connector_meta import KVConnectorMetadata, KVConnectorOutput
from pdserve.worker.kv.metrics import KVMetrics
from pdserve.worker.kv.nixl_transport import NixlTransport, nixl_available
from pdserve.worker.kv.peer_policy import PeerNotAllowed, PeerPolicy
from pdserve.worker.kv.pins import LEASE_S, PinTable
from pdserve.worker.kv.pull_pool import PullPool
from pdserve.worker.kv.tcp_transport import TcpServer, check_indices, tcp_pull

PULL_THREADS = 16  # all peers together; --kv-max-pulls-per-peer bounds each one

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
        self.auth = SideChannelAuth(config.kv_secret)
        self.port = config.kv_port
        self.timeout = config.kv_pull_timeout
        # Listen where HTTP listens unless told otherwise; advertise an address peers can use.
        self.bind_host = config.kv_host or config.kv_bind_host or "127.0.0.1"
        advertised = config.kv_host or os.environ.get("POD_IP")
        if advertised is None:
            advertised = "127.0.0.1" if _is_wildcard(self.bind_host) else self.bind_host
        self.host = advertised
        self.nixl = None
        if self.transport == "nixl":
            try:
                self.nixl = NixlTransport(f"pdserve-{engine_id}", cache, self.block_bytes)
            except Exception as e:  # e.g. UCX_TLS names transports this host cannot connect with
                from pdserve.worker.config import ConfigError

                raise ConfigError("--kv-transfer", f"nixl could not start its UCX backend ({e}); check UCX_TLS "
                                                   f"or use --kv-transfer tcp") from e
        self.server: side_channel.SideChannelServer | None = None
        self.pool = PullPool(PULL_THREADS, config.kv_max_pulls_per_peer, cooldown_s=min(10.0, self.timeout))
        self._loading: dict[str, Future] = {}  # request id -> its pull (step thread only)

    # -- prefill side -------------------------------------------------------------------------

    def start_server(self) -> None:
        tcp = TcpServer(self.blocks, self.pins, lambda n: self.metrics.bytes.labels("send", "tcp").inc(n))
        handlers = {"describe": self._describe, "lease": self._lease, "release": self._release, "read": tcp.handle_read}
        self.server = side_channel.SideChannelServer(self.bind_host, self.port, handlers, self.auth,
                                                     tick=self._nixl_tick if self.nixl else None)
        self.server.start()
        log.info("KV side channel on %s:%d (advertised as %s), transport %s, %s", self.bind_host, self.port,
                 self.host, self.transport, "authenticated" if self.auth.enabled else "UNAUTHENTICATED")
        if not self.auth.enabled:
            log.warning("KV side channel without --kv-secret: any host that reaches %s:%d can ask it for pinned "
                        "blocks with a transfer token; set --kv-secret (or PDSERVE_KV_SECRET) on every worker",
                        self.bind_host, self.port)

    def health(self) -> str | None:
        """None while the side channel serves; else why not (the worker's /health turns 503)."""
        if self.server is not None and not self.server.healthy:
            return "the KV side channel thread has stopped"
        return None

    def pin(self, request_id: str, block_ids: list[int], num_prompt_tokens: int, first_token_id: int,
            prompt_digest: str) -> dict:
        token, expires_at = self.pins.add(request_id, block_ids, prompt_digest)
        return KVTransferParams(
            remote_engine_id=self.engine_id, remote_host=self.host, remote_port=self.port,
            remote_request_id=request_id, remote_block_ids=tuple(block_ids), num_prompt_tokens=num_prompt_tokens,
            first_token_id=first_token_id, transfer_token=token, kv_layout=self.layout, transport=self.transport,
            expires_at=expires_at).to_dict()

    def _describe(self, body):
        # Layout only: NIXL metadata would let the asker READ/WRITE the whole cache (see _lease).
        return {"engine_id": self.engine_id, "kv_layout": self.layout, "block_bytes": self.block_bytes,
                "transport": self.transport}, []

    def _lease(self, body):
        if self.nixl is None:
            raise ValueError("this worker serves KV over TCP: use read")
        ids = self.pins.lease(body.get("request_id"), body.get("token"), LEASE_S, body.get("prompt_digest"))
        reply = {"engine_id": self.engine_id, "prompt_digest": body["prompt_digest"],
                 "block_ids": [ids[i] for i in check_indices(body.get("indices"), len(ids))]}
        if body.get("want_metadata"):
            reply["nixl"] = self.nixl.describe()
        return reply, []

    def _release(self, body):
        return {"released": self.pins.release(body.get("request_id"), body.get("token"))}, []

    def _nixl_tick(self) -> None:
        for msg in self.nixl.notifications():
            if msg.get("op") == "release" and self.pins.release(msg.get("request_id", ""), msg.get("token", "")):
                self.metrics.bytes.labels("send", "nixl").inc(msg.get("bytes", 0))

    # -- decode side: the step's orders and what came of them (step thread) ---------------------

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        for load in meta.loads:
            self._loading[load.request_id] = self.pool.submit(
                _peer(load.params), self._pull, load.params, load.indices, load.dst_blocks, load.prompt_digest)
        for params in meta.releases:
            self.pool.submit(_peer(params), self._release_quietly, params)

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
        else:  # nothing could be scheduled (no free blocks, or pins at their cap): wait for a release
            time.sleep(timeout)

    # -- decode side: moving bytes (pull threads) -------------------------------------------------

    def _pull(self, params: dict, indices: list[int], dst_blocks: list[int], digest: str) -> int:
        """Pull remote blocks at `indices` (positions in remote_block_ids) into `dst_blocks`."""
        t0 = time.perf_counter()
        transport = params.get("transport", "tcp")
        try:
            host = self.policy.check(str(params["remote_host"]))
            port = int(params["remote_port"])
            if transport == "nixl" and self.nixl is not None:
                nbytes = self._nixl_pull(host, port, params, indices, dst_blocks, digest)
            else:
                transport = "tcp"
                nbytes = tcp_pull(host, port, params, indices, dst_blocks, self.blocks, self.timeout, self.auth, digest)
        except Exception as e:
            self.metrics.failures.labels("recv", transport).inc()
            if not isinstance(e, (side_channel.PeerTimeout, TimeoutError, PeerNotAllowed)):
                self._release_quietly(params)  # let the prefill side free its blocks now rather than at TTL
            raise
        self.metrics.bytes.labels("recv", transport).inc(nbytes)
        self.metrics.seconds.labels("recv", transport).observe(time.perf_counter() - t0)
        return nbytes

    def _nixl_pull(self, host, port, params, indices, dst_blocks, digest) -> int:
        engine_id = params["remote_engine_id"]
        peer = self.nixl.known_peer(engine_id)
        rid, token = params["remote_request_id"], params["transfer_token"]
        reply, _ = side_channel.call(host, port, "lease", {"request_id": rid, "token": token, "indices": indices,
                                                           "prompt_digest": digest, "want_metadata": peer is None},
                                     self.timeout, self.auth)
        if reply.get("engine_id") != engine_id or reply.get("prompt_digest") != digest:
            raise side_channel.SideChannelError(f"KV peer {host}:{port} is not engine {engine_id} or did not "
                                                f"confirm the prompt digest")
        if peer is None:
            if not isinstance(reply.get("nixl"), dict):
                raise side_channel.SideChannelError(f"KV peer {host}:{port} sent no NIXL metadata")
            peer = self.nixl.add_peer(engine_id, reply["nixl"])
        if len(reply.get("block_ids", ())) != len(dst_blocks):
            raise side_channel.SideChannelError(f"KV peer {host}:{port} leased the wrong number of blocks")
        nbytes = len(dst_blocks) * self.block_bytes
        notif = {"op": "release", "request_id": rid, "token": token, "bytes": nbytes}
        return self.nixl.read(peer, reply["block_ids"], dst_blocks, notif, self.timeout)

    def _release_quietly(self, params: dict) -> None:
        """Best effort: tell the prefill worker we will not read (more of) its pin. Its TTL is the backstop."""
        try:
            host = self.policy.check(str(params["remote_host"]))  # never contact a peer we would not pull from
            side_channel.call(host, int(params["remote_port"]), "release",
                              {"request_id": params["remote_request_id"], "token": params["transfer_token"]},
                              min(5.0, self.timeout), self.auth)
        except Exception as e:
            log.debug("KV release of %s failed: %s", params.get("remote_request_id"), e)

    def shutdown(self) -> None:
        self.pool.shutdown()
        if self.server:
            self.server.stop()


def _peer(params: dict) -> tuple[str, int]:
    return str(params.get("remote_host")), int(params.get("remote_port", 0))


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False
