"""NIXL transport: one-sided READ of the remote KV cache (UCX backend), CPU or GPU memory.

The whole KV cache tensor is registered once. The decode side leases the request's blocks
over the side channel; the first lease's reply also carries the prefill agent's metadata,
which the decode side adds once. A NIXL notification sent once the READ is DONE tells the
prefill side to release the blocks (attached to the READ instead, it makes the READ wait for
a flush round trip to the peer: see docs/performance.md).

Descriptors are prepared once, not per pull: this agent's cache as one descriptor per block
(`prep_xfer_dlist` on NIXL_INIT_AGENT) and, when a peer is added, the peer's cache the same
way. A pull is then `make_prepped_xfer` with block indices on both sides, and NIXL posts one
descriptor per run: it merges indices that are consecutive on both sides (a dense stride of the
prepared list) before handing the list to UCX, so a run of consecutive blocks (block_manager.py
hands those out) moves as one span. tests/worker/test_kv_nixl.py checks this against NIXL's own
count (its transfer telemetry); `PostedRead.descriptors` computes the same count.

Which way a pull builds its descriptors, by cost (CPU, 4096 indices in 1 / 16 / 128 / 512 /
4096 runs, µs): make_prepped_xfer with int32 index arrays 3 / 4 / 5 / 12 / 79 (the ids converted
from a list: +50); with Python lists 100 / 100 / 100 / 100 / 165; initialize_xfer with one
descriptor per run built per call 24 / 22 / 23 / 32 / 107 with numpy, 590 / 570 / 620 / 790 /
2800 from Python tuples. NIXL's own merging of prepared indices costs less than building the run
descriptors ourselves at every run length, so the rule is: the prepared path whenever the peer's
cache is prepared (it said its block count and has our block size); descriptors built per call,
one per run, only otherwise (`use_prepped = False` forces that, for the bench).

A tensor-parallel peer of another TP size has other blocks than ours: its blocks are READ into
`self.staging` (staging.py), buffers registered once and reused by one pull at a time, and
tp_transfer.py scatters the heads this rank keeps.

What NIXL/UCX cannot enforce for us: once a peer holds the agent metadata (the UCX worker
address and the remote key of the registered cache), a one-sided READ or WRITE of any byte of
that registration is served by the NIC / UCX transport without asking this process. The
lease is then a courtesy, not a check. So the metadata is handed out only inside a lease,
i.e. to a peer that proved it holds the side-channel secret *and* a live transfer token, and
the registration is the whole cache (see docs/security.md for why not per lease).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.protocol.contract import ENV_NIXL_PROGRESS_DELAY_US, ENV_NIXL_PROGRESS_NICE
from pdserve.protocol.flags import ConfigError
from pdserve.worker.kv import side_channel
from pdserve.worker.kv.messages import MalformedReply, NixlPeer, ReleaseNotice
from pdserve.worker.kv.block_runs import as_indices, check_indices, merge_runs, run_starts
from pdserve.worker.kv.staging import StagingPool, slot_cap
from pdserve.worker.kv.transport import KVTransport

log = logging.getLogger(__name__)

PROGRESS_NICE_ENV = ENV_NIXL_PROGRESS_NICE  # a nice value for the threads NIXL starts
# The progress thread's poll timeout, µs (docs/performance.md: measured against NIXL's busy poll).
PROGRESS_DELAY_ENV, PROGRESS_DELAY_US = ENV_NIXL_PROGRESS_DELAY_US, 1000
# Completion polling: busy-check for SPIN_S, then sleep POLL_MIN_S doubling to POLL_MAX_S.
SPIN_S, POLL_MIN_S, POLL_MAX_S = 100e-6, 20e-6, 200e-6


class ReadFailed(RuntimeError):
    """NIXL reported the READ failed: it has ended, nothing writes into its destination any more."""


def import_nixl():
    try:
        from nixl_cu13 import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl._api import nixl_agent, nixl_agent_config  # other nixl wheels
    return nixl_agent, nixl_agent_config


def _thread_ids() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # not Linux: nothing to renice
        return set()


def _renice(tids: set[int], nice: int) -> None:
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError as e:
            log.warning("could not renice NIXL thread %d: %s", tid, e)


def progress_delay_us() -> int:
    """$PDSERVE_NIXL_PROGRESS_DELAY_US, else PROGRESS_DELAY_US; a bad value stops the start (ConfigError)."""
    raw = os.environ.get(PROGRESS_DELAY_ENV, "").strip()
    if not raw:
        return PROGRESS_DELAY_US
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"${PROGRESS_DELAY_ENV}", f"must be a whole number of microseconds >= 0, got {raw!r}")
    return value


_config_lock = threading.Lock()  # one swap of the bindings' class at a time (agents made on several threads)


@contextlib.contextmanager
def progress_delay(delay_us: int):
    """While open, the NIXL agents made get a progress thread that sleeps in poll() up to
    `delay_us` (whole milliseconds, rounded up) between rounds instead of spinning.

    NIXL's UCX progress thread polls its workers' event fds with the agent's `pthrDelay` as the
    timeout, so it wakes at once when UCX has work; nixl_agent's Python constructor fixes that
    delay at 0, which makes the poll return at once: a core per worker, busy even when idle.
    The constructor reads the config class from its bindings module when called; a subclass
    there that keeps `delay_us` whatever the constructor writes is the one way in without
    rebuilding nixl_agent. Wheels without that layout (older or other builds) keep their default."""
    if not delay_us:
        yield
        return
    bindings = getattr(sys.modules.get(import_nixl()[0].__module__), "nixlBind", None)
    with _config_lock:
        base = getattr(bindings, "nixlAgentConfig", None)
        delayed = _delayed_config(base, delay_us)
        if delayed is None:
            log.warning("this NIXL wheel's agent config is out of reach: its progress thread spins (%s ignored)",
                        PROGRESS_DELAY_ENV)
        else:
            bindings.nixlAgentConfig = delayed
        try:
            yield
        finally:
            if delayed is not None:
                bindings.nixlAgentConfig = base


def _delayed_config(base, delay_us: int):
    """A subclass of the bindings' config class whose pthrDelay stays `delay_us`; None where the
    class is missing or cannot be subclassed (a wheel built otherwise)."""
    if base is None:
        return None
    try:
        class DelayedConfig(base):
            def __setattr__(self, key, value):
                super().__setattr__(key, delay_us if key == "pthrDelay" else value)

        probe = DelayedConfig()
        probe.pthrDelay = 0
        return DelayedConfig if probe.pthrDelay == delay_us else None
    except Exception:  # noqa: BLE001 - any failure here only means the default (busy) thread
        return None


def nixl_available() -> bool:
    try:
        import_nixl()
        return True
    except ImportError:
        return False


class NixlTransport(KVTransport):
    """NIXL (UCX underneath): a reader leases blocks on the side channel, then READs them from
    the peer's registered cache itself (one-sided: the prefill side's CPU moves no byte)."""

    name = "nixl"
    leases = True
    stream_split = "tail"  # fast enough that one extra step of a streamed prefill suffices

    def __init__(self, name: str, cache: torch.Tensor, block_bytes: int, capture_telemetry: bool = False,
                 progress_us: int | None = None):
        """capture_telemetry: NIXL keeps per-transfer telemetry (descriptors posted, bytes, times),
        read with self.agent.get_xfer_telemetry(handle) until the handle is released (tests).
        progress_us: the progress thread's poll timeout (`progress_delay`); None: the environment's."""
        if cache.device.type == "cuda":
            # UCX turns cuda_ipc READs (get_zcopy) off unless it sees NVLink; the fallback is a
            # software emulation over TCP at ~0.5 GB/s. Measured on one H100 (P and D on the same
            # card): 0.5 -> 215 GB/s for a 1 GiB pull with it on. An explicit setting wins.
            os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
        nixl_agent, nixl_agent_config = import_nixl()
        # No NIXL listener thread: metadata leaves this process only through our authenticated side channel.
        telemetry = {"capture_telemetry": True} if capture_telemetry else {}  # older wheels lack the flag
        threads = _thread_ids()
        with progress_delay(progress_delay_us() if progress_us is None else progress_us):
            self.agent = nixl_agent(name, nixl_agent_config(enable_listen_thread=False, backends=["UCX"],
                                                            **telemetry))
        if os.environ.get(PROGRESS_NICE_ENV):
            # A peer reading over UCX's TCP transport needs the progress thread (the target's
            # progress), so it stays; on a small shared machine (CI: 2 cores, a dozen workers)
            # it is niced so it yields to the work it would otherwise slow down.
            _renice(_thread_ids() - threads, int(os.environ[PROGRESS_NICE_ENV]))
        self.agent_name = name
        self.cache = cache
        self.block_bytes = block_bytes
        self.reg = self.agent.register_memory(cache)
        self.mem_type = "VRAM" if cache.device.type == "cuda" else "DRAM"
        self.device_id = cache.device.index or 0
        self.base = cache.data_ptr()
        self.num_blocks = cache.numel() * cache.element_size() // block_bytes
        self.use_prepped = True  # False: build descriptor lists per pull (the bench compares both)
        # False: the release notification rides on the READ (NIXL completes the READ only after a
        # flush round trip to the peer); True: sent with send_notif once the READ is DONE.
        self.notify_after_read = True
        # A known peer: READ while the lease round trip runs (pull); False: lease, then READ.
        self.overlap_lease = True
        self._local_prep = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _block_descs(self.base, self.num_blocks, block_bytes, self.device_id), self.mem_type)
        self._remote: dict[str, NixlPeer] = {}  # engine id -> described peer
        self._remote_prep: dict[str, object] = {}  # agent name -> its cache prepared, one descriptor per block
        self._described: dict | None = None
        self._lock = threading.Lock()  # agent calls from pull threads and the side-channel thread
        # Where a tensor-parallel peer's blocks (other heads than ours) land: registered once, reused.
        self.staging = StagingPool(cache.device, slot_cap(cache), self._register, self._deregister)

    @classmethod
    def start(cls, agent_name: str, cache: torch.Tensor, block_bytes: int) -> "NixlTransport":
        try:
            import_nixl()
        except ImportError:
            raise ConfigError("--kv-transfer", "nixl needs the nixl extra: pip install 'pdserve[nixl]'") from None
        progress_us = progress_delay_us()
        try:
            return cls(agent_name, cache, block_bytes, progress_us=progress_us)
        except Exception as e:  # e.g. UCX_TLS names transports this host cannot connect with
            raise ConfigError("--kv-transfer", f"nixl could not start its UCX backend ({e}); check UCX_TLS "
                                               f"or use --kv-transfer tcp") from e

    def describe(self) -> dict:
        """Everything a peer needs to READ (or WRITE) this cache: give it only to a leaseholder."""
        if self._described is None:
            self._described = NixlPeer(self.agent_name, self.agent.get_agent_metadata(), self.base, self.device_id,
                                       self.mem_type, self.num_blocks, self.block_bytes).to_body()
        return self._described

    def add_peer(self, engine_id: str, desc: dict) -> NixlPeer:
        """The peer `engine_id` as its reply's NIXL metadata `desc` describes it (parsed and added
        once; later calls return the peer added first)."""
        with self._lock:
            if engine_id not in self._remote:
                try:
                    peer = NixlPeer.parse(desc, f"KV peer {engine_id}")
                except MalformedReply as e:
                    raise side_channel.SideChannelError(str(e)) from None
                self.agent.add_remote_agent(peer.agent_metadata)
                # A tensor-parallel peer of another TP size has other block bytes: its blocks are
                # read whole into a staging buffer (read_into), never paired with ours one to one.
                if peer.block_bytes in (None, self.block_bytes) and peer.num_blocks is not None:
                    self._remote_prep[peer.agent] = self.agent.prep_xfer_dlist(
                        peer.agent, _block_descs(peer.base, peer.num_blocks, self.block_bytes, peer.device_id),
                        peer.mem_type)
                self._remote[engine_id] = peer
            return self._remote[engine_id]

    def known_peer(self, engine_id: str) -> NixlPeer | None:
        return self._remote.get(engine_id)

    def read(self, peer: NixlPeer, src_blocks: list[int], dst_blocks: list[int], notif: dict | None, timeout_s: float,
             timings: dict | None = None) -> int:
        """READ remote `src_blocks` into local `dst_blocks`; returns bytes. `timings` (if given)
        gets the seconds spent preparing the request, posting it, waiting for it, releasing it
        and sending the notification."""
        return self.finish_read(self.post_read(peer, src_blocks, dst_blocks, notif, timings), timeout_s, timings)

    def post_read(self, peer: NixlPeer, src_blocks: list[int], dst_blocks: list[int], notif: dict | None,
                  timings: dict | None = None) -> "PostedRead":
        """Start a READ; finish_read (or abort_read) must follow. In between, the caller may do
        other work while the bytes move (the connector runs the lease round trip)."""
        if len(src_blocks) != len(dst_blocks):
            raise ValueError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destination blocks")
        msg = json.dumps(notif).encode() if notif else b""
        attached = b"" if self.notify_after_read else msg
        t0 = time.perf_counter()
        src, dst = as_indices(src_blocks), as_indices(dst_blocks)
        with self._lock:
            prepped = self._remote_prep.get(peer.agent) if self.use_prepped else None
            if prepped is not None:
                handle = self.agent.make_prepped_xfer("READ", self._local_prep, dst, prepped, src, attached)
            else:
                bb = self.block_bytes
                starts = run_starts(src, dst)  # one descriptor per run
                counts = np.diff(np.append(starts, len(src))).astype(np.uint64) * bb
                remote = _span_descs(peer.base, src[starts], counts, bb, peer.device_id)
                local = _span_descs(self.base, dst[starts], counts, bb, self.device_id)
                handle = self.agent.initialize_xfer(
                    "READ", self.agent.get_xfer_descs(local, self.mem_type),
                    self.agent.get_xfer_descs(remote, peer.mem_type), peer.agent, attached)
            t1 = time.perf_counter()
            state = self.agent.transfer(handle)
        if timings is not None:
            timings.update(prepare=t1 - t0, post=time.perf_counter() - t1)
        return PostedRead(handle, state, peer.agent, b"" if attached else msg, len(src) * self.block_bytes,
                          (src, dst))

    def post_read_layers(self, peer: NixlPeer, src_blocks: list[int], dst_blocks: list[int], lo: int, hi: int,
                         num_layers: int) -> "PostedRead":
        """Start a READ of layers [lo, hi) of remote `src_blocks` into the same layers of local
        `dst_blocks` (no notification): a block holds its layers one after another (kv_cache.py),
        so each block's part is one descriptor. A layered streamed hand-off reads the layers a
        running prefill step has written (connector._stream_pull)."""
        if lo == 0 and hi == num_layers:
            return self.post_read(peer, src_blocks, dst_blocks, None)
        if len(src_blocks) != len(dst_blocks) or not 0 <= lo < hi <= num_layers or self.block_bytes % num_layers:
            raise ValueError(f"bad layer read: {len(src_blocks)} -> {len(dst_blocks)} blocks, layers [{lo}, {hi}) "
                             f"of {num_layers}")
        layer_bytes = self.block_bytes // num_layers
        src, dst = as_indices(src_blocks), as_indices(dst_blocks)
        nbytes = np.full(len(src), (hi - lo) * layer_bytes, dtype=np.uint64)
        remote = _span_descs(peer.base + lo * layer_bytes, src, nbytes, self.block_bytes, peer.device_id)
        local = _span_descs(self.base + lo * layer_bytes, dst, nbytes, self.block_bytes, self.device_id)
        with self._lock:
            handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, self.mem_type),
                                                self.agent.get_xfer_descs(remote, peer.mem_type), peer.agent, b"")
            state = self.agent.transfer(handle)
        return PostedRead(handle, state, peer.agent, b"", int(nbytes.sum()), (src, dst))

    def finish_read(self, xfer: "PostedRead", timeout_s: float, timings: dict | None = None) -> int:
        """Wait for a posted READ, release its handle, then send its notification (the bytes
        have landed here: the peer may free its blocks). Returns bytes."""
        t2 = time.perf_counter()
        try:
            self._wait(xfer.handle, xfer.state, xfer.agent, timeout_s)
        finally:
            t3 = time.perf_counter()
            with self._lock:
                self.agent.release_xfer_handle(xfer.handle)
        t4 = time.perf_counter()
        if xfer.notif:
            with self._lock:
                self.agent.send_notif(xfer.agent, xfer.notif)
        if timings is not None:
            timings.update(wait=t3 - t2, release=t4 - t3, notify=time.perf_counter() - t4)
        return xfer.nbytes

    def abort_read(self, xfer: "PostedRead", timeout_s: float) -> bool:
        """A posted READ whose bytes will not be used: let it end (its handle cannot be released
        while in flight), release it, and send no notification. False: it may still be writing
        into its destination (the wait timed out or the release failed)."""
        ended = True
        try:
            self._wait(xfer.handle, xfer.state, xfer.agent, timeout_s)
        except ReadFailed as e:
            log.debug("abandoned NIXL READ from %s: %s", xfer.agent, e)
        except (TimeoutError, RuntimeError) as e:
            log.debug("abandoned NIXL READ from %s: %s", xfer.agent, e)
            ended = False
        try:
            with self._lock:
                self.agent.release_xfer_handle(xfer.handle)
        except Exception as e:
            log.warning("could not release an abandoned NIXL READ from %s: %s", xfer.agent, e)
            ended = False
        return ended

    def _wait(self, handle, state: str, agent: str, timeout_s: float) -> None:
        """Poll a posted transfer until DONE. Spin first (a small pull completes in tens of
        microseconds, and each check also drives UCX progress), then back off to at most
        POLL_MAX_S between checks so a long pull does not hold the lock and a core."""
        start = time.perf_counter()
        delay = 0.0
        while state == "PROC":
            elapsed = time.perf_counter() - start
            if elapsed > timeout_s:
                raise TimeoutError(f"NIXL READ from {agent} timed out after {timeout_s}s")
            if elapsed > SPIN_S:
                delay = min(POLL_MAX_S, max(POLL_MIN_S, delay * 2))
                time.sleep(delay)
            with self._lock:
                state = self.agent.check_xfer_state(handle)
        if state != "DONE":
            raise ReadFailed(f"NIXL READ from {agent} failed ({state})")

    def post_read_into(self, peer: NixlPeer, src_blocks: list[int], dst: torch.Tensor) -> "PostedRead":
        """Start a READ of remote blocks src_blocks[i] into row i of `dst` [rows, remote block
        bytes], a view inside a buffer of self.staging (registered): a tensor-parallel peer's
        blocks hold other heads than ours, so they land there and the caller scatters the heads
        it keeps (tp_transfer.py). No notification: tensor-parallel reads keep the pin."""
        bb = dst.shape[1]
        runs = merge_runs(src_blocks, list(range(len(src_blocks))))
        remote = [(peer.base + s * bb, c * bb, peer.device_id) for s, _, c in runs]
        local = [(dst.data_ptr() + d * bb, c * bb, self.device_id) for _, d, c in runs]
        with self._lock:
            handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, self.mem_type),
                                                self.agent.get_xfer_descs(remote, peer.mem_type), peer.agent, b"")
            state = self.agent.transfer(handle)
        return PostedRead(handle, state, peer.agent, b"", len(src_blocks) * bb,
                          (as_indices(src_blocks), np.arange(len(src_blocks), dtype=np.int32)))

    def _register(self, buf: torch.Tensor):
        with self._lock:
            return self.agent.register_memory(buf)

    def _deregister(self, reg) -> None:
        with self._lock:
            self.agent.deregister_memory(reg)

    def close(self) -> None:
        """Deregister and free the staging buffers (the connector shuts down)."""
        self.staging.close()

    # -- KVTransport --------------------------------------------------------------------------

    def metadata(self) -> dict:
        return self.describe()

    def tick(self, released) -> None:
        for msg in self.notifications():
            notice = ReleaseNotice.parse(msg)
            if notice is not None:
                released(notice.request_id, notice.token, notice.nbytes)

    def knows_peer(self, engine_id: str) -> bool:
        return self.known_peer(engine_id) is not None

    def pull(self, conn, host, port, params, indices, dst_blocks, digest, release) -> int:
        """Lease, then READ; from a peer whose metadata we hold, the READ of the blocks the params
        name starts first and the lease round trip runs while the bytes move. Those bytes count
        only if the lease then confirms the same blocks for this prompt: a pin is never re-made
        under a token, so blocks read before a successful lease were read while the pin held
        them. Otherwise the READ is abandoned and the scheduler prefills locally over them."""
        engine_id = params.remote_engine_id
        peer = self.known_peer(engine_id)
        rid, token = params.remote_request_id, params.transfer_token
        notif = ReleaseNotice(rid, token, len(dst_blocks) * conn.block_bytes).to_body() if release else None
        src = [params.remote_block_ids[i] for i in check_indices(indices, len(params.remote_block_ids))]
        early = None
        # Not with the release riding on the READ: it would end the pin before the lease. Not
        # for a streamed chunk either: the lease is what says its blocks are computed.
        if peer is not None and self.overlap_lease and release and self.notify_after_read:
            early = self.post_read(peer, src, dst_blocks, notif)
        try:
            reply = side_channel.lease(host, port, params, indices, digest, peer is None, conn.timeout, conn.auth)
            if peer is None:
                peer = self.add_peer(engine_id, reply.metadata)
            if reply.block_ids != src:
                raise side_channel.SideChannelError(f"KV peer {host}:{port} leased other blocks than the params name")
        except BaseException:
            if early is not None:
                self.abort_read(early, conn.timeout)
            raise
        return self.finish_read(early or self.post_read(peer, src, dst_blocks, notif), conn.timeout)

    def read_layered(self, conn, params, reply, have, ready, held, want) -> int:
        """READ what a layered progress reply announces beyond what this reader holds (`held`:
        [layers, up to which block] of the blocks from `have`, updated here): the rest of those
        blocks' layers once their step is through (or the layers it has written since), whole
        blocks up to `ready`, then the layers written so far of the step after them. Only the
        positions in `want` (the blocks we lack) are read; the READs run side by side."""
        num_layers = conn.cache.shape[1]
        part = reply.partial
        if part is not None and part[2] != num_layers:  # not our model's layers: whole blocks only
            part = None
        layers, upto = held
        reads, start = [], have  # (positions, first layer, end layer)
        if layers and ready >= upto:  # that step's forward is through: the rest of its layers
            reads.append((range(have, upto), layers, num_layers))
            start, layers = upto, 0
        elif layers and part is not None and part[0] == upto and part[1] > layers:  # more of them
            reads.append((range(have, upto), layers, part[1]))
            layers = part[1]
        if ready > start:
            reads.append((range(start, ready), 0, num_layers))
        if not layers and part is not None:  # the next step's first layers
            reads.append((range(ready, part[0]), 0, part[1]))
            layers, upto = part[1], part[0]
        reads = [([i for i in pos if i in want], lo, hi) for pos, lo, hi in reads]
        reads = [r for r in reads if r[0]]
        nbytes = 0
        if reads:
            if reply.block_ids != list(params.remote_block_ids):
                raise side_channel.SideChannelError(f"KV peer {params.remote_engine_id} leased other blocks than "
                                                    "the params name")
            engine_id = params.remote_engine_id
            peer = self.known_peer(engine_id) or self.add_peer(engine_id, reply.metadata)
            src = params.remote_block_ids
            posted, landed = [], 0
            t0 = time.perf_counter()
            try:
                for pos, lo, hi in reads:
                    posted.append(self.post_read_layers(peer, [src[i] for i in pos], [want[i] for i in pos],
                                                        lo, hi, num_layers))
                t1 = time.perf_counter()
                for xfer in posted:
                    landed += 1  # finish_read releases its handle however it ends
                    nbytes += self.finish_read(xfer, conn.timeout)
            except BaseException:
                for xfer in posted[landed:]:
                    self.abort_read(xfer, conn.timeout)
                raise
            if log.isEnabledFor(logging.DEBUG):  # a streamed pull's timeline, READ by READ
                log.debug("KV layered READ for %s from %s: %s; %.3f MiB, post %.2f ms, wait %.2f ms",
                          params.remote_request_id, engine_id,
                          ", ".join(f"{len(pos)} blocks layers {lo}-{hi}" for pos, lo, hi in reads), nbytes / 2**20,
                          (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3)
        held[:] = [layers, upto] if layers else [0, 0]
        return nbytes

    def pull_shard(self, conn, host, port, remote_rank, params, indices, dst_blocks, digest) -> int:
        peer, src = self._lease_rank(conn, host, port, remote_rank, params, indices, digest)
        return self.read(peer, src, dst_blocks, None, conn.timeout)

    def staged_blocks(self, conn, per_block: int, num_blocks: int) -> int:
        # A registered staging slot holds at most its cap; a longer pull goes in chunks (a lease each).
        return self.staging.blocks_per_chunk(per_block)

    @contextlib.contextmanager
    def staging_area(self, conn, nbytes: int):
        with self.staging.take(nbytes, conn.timeout) as slot:
            yield slot.data[:nbytes], slot

    def pull_staged(self, conn, slot, host, params, indices, digest, staged, regions) -> int:
        """Lease and post a READ per source, then wait for all: source k's bytes move while source
        k + 1's lease runs. Every READ has ended before this returns or raises; one that may not
        have (a timeout) retires the slot, which is then never reused (staging.py)."""
        base_port, pending, nbytes = params.remote_port, [], 0
        try:
            for s, region in zip(staged, regions):
                peer, src = self._lease_rank(conn, host, base_port + s.remote_rank, s.remote_rank, params, indices,
                                             digest)
                pending.append(self.post_read_into(peer, src, region))
            while pending:
                xfer = pending.pop(0)
                try:
                    nbytes += self.finish_read(xfer, conn.timeout)
                except ReadFailed:
                    raise  # it ended
                except BaseException:
                    slot.retire = True
                    raise
        finally:
            for xfer in pending:  # a lease or an earlier READ failed: these bytes will not be used
                if not self.abort_read(xfer, conn.timeout):
                    slot.retire = True
        return nbytes

    def _lease_rank(self, conn, host: str, port: int, remote_rank: int, params, indices: list[int],
                    digest: str) -> tuple[NixlPeer, list[int]]:
        """Lease the blocks at `indices` from prefill rank `remote_rank`: (its NIXL peer, their block ids).
        No release on read: decode rank 0 releases every prefill rank's pin once all ranks read."""
        key = f"{params.remote_engine_id}#{remote_rank}"
        peer = self.known_peer(key)
        reply = side_channel.lease(host, port, params, indices, digest, peer is None, conn.timeout, conn.auth)
        if reply.tp_rank != remote_rank:
            raise side_channel.SideChannelError(f"KV peer {host}:{port} is tensor-parallel rank "
                                                f"{reply.tp_rank}, not rank {remote_rank}: its heads are "
                                                "not the ones expected")
        if peer is None:
            peer = self.add_peer(key, reply.metadata)
        if not isinstance(reply.block_ids, list) or len(reply.block_ids) != len(indices):
            raise side_channel.SideChannelError(f"KV peer {host}:{port} leased the wrong number of blocks")
        return peer, reply.block_ids

    def notifications(self) -> list[dict]:
        with self._lock:
            notifs = self.agent.get_new_notifs()
        out = []
        for msgs in notifs.values():
            for m in msgs:
                try:
                    out.append(json.loads(m))
                except ValueError:
                    log.warning("ignoring malformed NIXL notification %r", m[:80])
        return out


@dataclass
class PostedRead:
    handle: object  # NIXL transfer handle
    state: str  # what transfer() answered: "DONE" or "PROC"
    agent: str  # the peer agent
    notif: bytes  # to send once DONE (empty: none, or it rode on the READ)
    nbytes: int
    blocks: tuple[np.ndarray, np.ndarray]  # (source, destination) block indices, int32

    @property
    def descriptors(self) -> int:
        """NIXL descriptors posted: runs of blocks consecutive on both sides (computed on
        demand: a few µs that a 1-block pull need not pay)."""
        return len(run_starts(*self.blocks))


def _block_descs(base: int, num_blocks: int, block_bytes: int, device_id: int) -> np.ndarray:
    """[num_blocks, 3] (address, bytes, device): one transfer descriptor per KV block."""
    descs = np.empty((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(num_blocks, dtype=np.uint64) * block_bytes
    descs[:, 1] = block_bytes
    descs[:, 2] = device_id
    return descs


def _span_descs(base: int, starts: np.ndarray, nbytes: np.ndarray, block_bytes: int, device_id: int) -> np.ndarray:
    """[runs, 3] (address, bytes, device): one transfer descriptor per run of blocks."""
    descs = np.empty((len(starts), 3), dtype=np.uint64)
    descs[:, 0] = base + starts.astype(np.uint64) * block_bytes
    descs[:, 1] = nbytes
    descs[:, 2] = device_id
    return descs
