"""Watching servers stay alive while a test throws something heavy at them (issue 44).

`Liveness` polls each server's `/health` from its own thread and samples each process's RSS
while the `with` block runs. A poll that takes longer than `health_limit_s` (or fails) is
recorded, not retried: the claim under test is "a request's data never stalls the event loop",
and a stalled loop answers nothing. RSS growth is the peak sampled during the block over the
value at its start.

    with Liveness({"worker": worker.url}, {"worker": worker.proc.pid}) as live:
        ... send the hostile requests ...
    live.assert_ok(rss_growth_mib=300)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HEALTH_LIMIT_S = 1.0
POLL_INTERVAL_S = 0.1


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


@dataclass
class _Watched:
    url: str | None
    pid: int | None
    polls: int = 0
    worst_s: float = 0.0
    failures: list[str] = field(default_factory=list)
    rss_start_kib: int = 0
    rss_peak_kib: int = 0


class Liveness:
    def __init__(self, urls: dict[str, str], pids: dict[str, int] | None = None,
                 health_limit_s: float = HEALTH_LIMIT_S, headers: dict[str, str] | None = None):
        pids = pids or {}
        self.limit = health_limit_s
        self.headers = headers or {}
        self.watched = {name: _Watched(urls.get(name), pids.get(name)) for name in {*urls, *pids}}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> "Liveness":
        for name, w in self.watched.items():
            if w.pid is not None:
                w.rss_start_kib = w.rss_peak_kib = rss_kib(w.pid)
            t = threading.Thread(target=self._watch, args=(w,), name=f"liveness-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.limit + 5)

    def _watch(self, w: _Watched) -> None:
        with httpx.Client(timeout=self.limit, headers=self.headers) as client:
            while not self._stop.is_set():
                if w.url is not None:
                    t0 = time.monotonic()
                    try:
                        status = client.get(w.url + "/health").status_code
                        if status != 200:
                            w.failures.append(f"/health answered {status}")
                    except httpx.HTTPError as e:
                        w.failures.append(f"/health: {type(e).__name__} after {time.monotonic() - t0:.2f} s")
                    w.worst_s = max(w.worst_s, time.monotonic() - t0)
                    w.polls += 1
                if w.pid is not None:
                    try:
                        w.rss_peak_kib = max(w.rss_peak_kib, rss_kib(w.pid))
                    except (FileNotFoundError, ProcessLookupError):
                        w.failures.append("process gone")
                        return
                self._stop.wait(POLL_INTERVAL_S)

    def rss_growth_mib(self, name: str) -> float:
        w = self.watched[name]
        return (w.rss_peak_kib - w.rss_start_kib) / 1024

    def assert_ok(self, rss_growth_mib: float | None = None) -> None:
        """Every poll answered 200 within the limit (and at least one poll ran, so this cannot
        pass vacuously); with `rss_growth_mib`, no process grew by more than that."""
        problems = []
        for name, w in self.watched.items():
            if w.url is not None and w.polls == 0:
                problems.append(f"{name}: /health never polled")
            if w.failures:
                problems.append(f"{name}: {len(w.failures)} of {w.polls} polls failed, first: {w.failures[0]}")
            if w.url is not None and w.worst_s > self.limit:
                problems.append(f"{name}: slowest /health {w.worst_s:.2f} s")
            if rss_growth_mib is not None and w.pid is not None and self.rss_growth_mib(name) > rss_growth_mib:
                problems.append(f"{name}: RSS grew {self.rss_growth_mib(name):.0f} MiB (bound {rss_growth_mib})")
        assert not problems, "; ".join(problems)
