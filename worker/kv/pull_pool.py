"""Decode side: a bounded pool for pulls and releases, fair across prefill peers.

A pull to a peer that never answers holds its thread for --kv-pull-timeout. Without bounds, a
few forged params naming such a peer would hold every thread and stall every other pull. So:
at most `per_peer` calls run per peer (the rest wait in that peer's queue, holding no thread),
the pool has `max_workers` threads in all, and a peer that timed out is cooled down: for
`cooldown_s` its queued and new calls fail at once (the request prefills locally), instead of
each waiting out its own timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque
from concurrent.futures import Future, ThreadPoolExecutor

from pdserve.worker.kv.side_channel import PeerTimeout

log = logging.getLogger(__name__)

Peer = tuple[str, int]


class PeerCoolingDown(RuntimeError):
    pass


class PullPool:
    def __init__(self, max_workers: int, per_peer: int, cooldown_s: float):
        self.per_peer, self.cooldown_s = per_peer, cooldown_s
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="kv-pull")
        self._lock = threading.Lock()
        self._queued: dict[Peer, deque] = defaultdict(deque)
        self._running: dict[Peer, int] = defaultdict(int)
        self._cool_until: dict[Peer, float] = {}

    def submit(self, peer: Peer, fn, *args) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._cooling(peer):
                fut.set_exception(PeerCoolingDown(f"KV peer {peer[0]}:{peer[1]} timed out recently; not retried "
                                                  f"for {self.cooldown_s:.0f}s"))
                return fut
            self._queued[peer].append((fut, fn, args))
            self._dispatch(peer)
        return fut

    def running(self, peer: Peer) -> int:
        with self._lock:
            return self._running.get(peer, 0)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- internals (under self._lock) -------------------------------------------------------------

    def _cooling(self, peer: Peer) -> bool:
        until = self._cool_until.get(peer)
        if until is not None and until <= time.monotonic():
            del self._cool_until[peer]
            return False
        return until is not None

    def _dispatch(self, peer: Peer) -> None:
        queue = self._queued[peer]
        if self._cooling(peer):
            while queue:
                fut, _, _ = queue.popleft()
                fut.set_exception(PeerCoolingDown(f"KV peer {peer[0]}:{peer[1]} timed out; not retried for now"))
        while queue and self._running[peer] < self.per_peer:
            fut, fn, args = queue.popleft()
            self._running[peer] += 1
            self._executor.submit(self._run, peer, fut, fn, args)
        if not queue:
            del self._queued[peer]
        if not self._running[peer]:
            del self._running[peer]

    def _run(self, peer: Peer, fut: Future, fn, args) -> None:
        try:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:
                    if isinstance(e, (PeerTimeout, TimeoutError)):  # TimeoutError: a NIXL READ
                        with self._lock:
                            self._cool_until[peer] = time.monotonic() + self.cooldown_s
                        log.warning("KV peer %s:%d timed out; failing its pulls for %.0fs", *peer, self.cooldown_s)
                    fut.set_exception(e)
        finally:
            with self._lock:
                self._running[peer] -= 1
                self._dispatch(peer)
