"""The router's view of its workers: role, revision, health, load and ejection state.

A `Worker` is mutated only on the event loop (no locks needed). Discovery replaces the set of
workers; state of a worker that stays (same URL and role) is kept across updates.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlsplit

@dataclass(eq=False)
class Worker:
    url: str
    role: str  # "prefill" or "decode"; a "both" worker appears once in each pool
    revision: str | None = None
    healthy: bool = True  # until the first probe says otherwise: static workers are tried at once
    inflight: int = 0  # requests this router has open on it right now
    num_waiting: float = 0.0  # scraped vllm:num_requests_waiting
    num_running: float = 0.0  # scraped vllm:num_requests_running
    kv_usage: float = 0.0  # scraped vllm:kv_cache_usage_perc (0..1)
    models: frozenset[str] = frozenset()
    max_model_len: int | None = None  # from its /v1/models card
    roots: dict[str, str] = field(default_factory=dict)  # model id -> its card's `root` (what it was loaded from)
    parents: dict[str, str] = field(default_factory=dict)  # LoRA adapter id -> its card's `parent` (the base)
    # From the scraped vllm:lora_requests_info: the adapters its running and waiting requests use,
    # and its GPU adapter slots (None: it exports no such metric, i.e. serves no adapters).
    lora_running: frozenset[str] = frozenset()
    lora_waiting: frozenset[str] = frozenset()
    max_lora: int | None = None
    # Its base model card says `runtime_lora_loading`: it loads the adapter a hand-off names
    # when it lacks it (the worker's --enable-lora and $VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    lora_loading: bool = False
    consecutive_failures: int = 0
    ejected_until: float = 0.0
    backoff_s: float = 0.0
    # A probe failed while the worker was ejected: it really was down, so a later good probe
    # means it came back (a restart) and readmits it without waiting for the backoff.
    seen_down: bool = False
    failed_probes: int = 0  # consecutive health probes that failed or timed out
    host: str = field(init=False)

    def __post_init__(self) -> None:
        self.host = urlsplit(self.url).hostname or ""

    def routable(self, now: float | None = None) -> bool:
        return self.healthy and (now if now is not None else time.monotonic()) >= self.ejected_until

    def lora_active(self, adapter: str) -> bool:
        """`adapter` is in one of its GPU slots now (running or queued requests use it)."""
        return adapter in self.lora_running or adapter in self.lora_waiting

    def lora_slot_free(self) -> bool:
        """One more adapter fits in its GPU slots without evicting one a request uses."""
        return self.max_lora is not None and len(self.lora_running | self.lora_waiting) < self.max_lora

    @property
    def load(self) -> float:
        """What least-loaded minimises: our in-flight requests plus the worker's own queue."""
        return self.inflight + self.num_waiting

    def __repr__(self) -> str:  # short, for logs and test failure messages
        return f"Worker({self.role} {self.url} rev={self.revision})"


@dataclass(frozen=True)
class WorkerSpec:
    """What discovery reports for one endpoint."""

    url: str
    role: str
    revision: str | None = None


# A worker whose health probes fail this many times in a row is "lost": calls waiting on it are
# abandoned (and retried elsewhere) instead of waiting out the long request timeouts. One failed
# probe may be a blip on a loaded host; three in a row (each with the connect timeout, a probe
# interval apart: ~8 s with the defaults) is a worker that cannot answer a trivial GET for
# seconds: stopped, wedged, or partitioned away. A busy worker still answers /health (its HTTP
# loop is not the engine's thread), and cutting a slow but live worker's streams costs answers.
LOST_AFTER_FAILED_PROBES = 3
# A probe that timed out (the worker did not answer /health within the connect timeout) is not a
# verdict on its own: on a loaded host (a neighbour importing torch, a prefill burst) one slow
# answer is common and taking every worker out of the pools for a probe interval answered 503 to
# every request in between. Two timeouts in a row do take it out; a refused connection or a non-200
# /health does at once (the worker is really gone, restarting or draining).
UNROUTABLE_AFTER_SLOW_PROBES = 2


class WorkerSet:
    """All known workers, by role; failure accounting with ejection and exponential backoff."""

    def __init__(self, eject_after: int, backoff_s: float, backoff_max_s: float):
        self._by_key: dict[tuple[str, str], Worker] = {}
        self._eject_after = eject_after
        self._backoff_s = backoff_s
        self._backoff_max_s = backoff_max_s
        self.version = 0  # bumped on membership change, so subscribers can react
        self.on_lost: list[Callable[[Worker], None]] = []  # called when a worker's probes start failing

    def update(self, specs: list[WorkerSpec]) -> None:
        fresh: dict[tuple[str, str], Worker] = {}
        for spec in specs:
            key = (spec.url, spec.role)
            worker = self._by_key.get(key)
            if worker is None or worker.revision != spec.revision:
                worker = Worker(spec.url, spec.role, spec.revision)
            fresh[key] = worker
        if fresh.keys() != self._by_key.keys():
            self.version += 1
        self._by_key = fresh

    def all(self) -> list[Worker]:
        return list(self._by_key.values())

    def pool(self, role: str, now: float | None = None) -> list[Worker]:
        now = time.monotonic() if now is None else now
        return [w for w in self._by_key.values() if w.role == role and w.routable(now)]

    def models(self) -> set[str]:
        out: set[str] = set()
        for w in self._by_key.values():
            out |= w.models
        return out

    def record_success(self, worker: Worker) -> None:
        worker.consecutive_failures = 0
        worker.backoff_s = 0.0

    def record_failure(self, worker: Worker) -> bool:
        """Count a failed call; returns True when this failure ejected the worker."""
        worker.consecutive_failures += 1
        if worker.consecutive_failures < self._eject_after:
            return False
        self.eject(worker)
        return True

    def eject(self, worker: Worker) -> None:
        worker.backoff_s = min(self._backoff_max_s, worker.backoff_s * 2 or self._backoff_s)
        worker.ejected_until = time.monotonic() + worker.backoff_s

    def probe_result(self, worker: Worker, ok: bool, timed_out: bool = False) -> None:
        """A health probe's verdict. An ejected worker comes back when its backoff ran out, or
        at once when its health went bad and is good again (it was restarted): waiting out a
        backoff grown while it was down would answer 503 for seconds with a healthy worker.
        A worker ejected for failing requests while its health stayed good waits the backoff.
        A probe that `timed_out` changes nothing until UNROUTABLE_AFTER_SLOW_PROBES in a row."""
        now = time.monotonic()
        worker.failed_probes = 0 if ok else worker.failed_probes + 1
        if worker.failed_probes == LOST_AFTER_FAILED_PROBES:
            for callback in self.on_lost:
                callback(worker)
        if timed_out and worker.failed_probes < UNROUTABLE_AFTER_SLOW_PROBES:
            return
        if now < worker.ejected_until:
            if not ok:
                worker.healthy = False
                worker.seen_down = True
                return
            if not worker.seen_down:
                return
            worker.ejected_until = 0.0
        worker.seen_down = False
        if ok:
            worker.healthy = True
            if worker.consecutive_failures >= self._eject_after:
                # Half-open: re-admitted on probation; one more failure ejects it again, for longer.
                worker.consecutive_failures = self._eject_after - 1
        else:
            worker.healthy = False
            if worker.consecutive_failures >= self._eject_after:
                self.eject(worker)  # still down: wait longer before the next look
