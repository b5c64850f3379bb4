"""Background health probes and load scraping of every worker.

Each round, per worker and concurrently: `GET /health` (200 means ready), then `GET /metrics`
for the vLLM gauges least-loaded uses, and `GET /v1/models` for the served-model union.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from pdserve.router.workers import Worker, WorkerSet

log = logging.getLogger("pdserve.router")

# Gauges read from the worker's Prometheus text (vLLM's names), summed over label sets.
_GAUGES = {
    "vllm:num_requests_waiting": "num_waiting",
    "vllm:num_requests_running": "num_running",
    "vllm:kv_cache_usage_perc": "kv_usage",
}


def parse_load(text: str) -> dict[str, float]:
    """A line scan, not a full exposition parser: only three gauges are needed, once a second."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        attr = _GAUGES.get(name)
        if attr is None:
            continue
        # `name{labels} value [timestamp]`; label values may hold spaces, so cut after the "}".
        rest = line.rsplit("}", 1)[1] if "{" in line else line[len(name):]
        try:
            out[attr] = out.get(attr, 0.0) + float(rest.split()[0])
        except (ValueError, IndexError):
            continue
    return out


class Prober:
    def __init__(self, workers: WorkerSet, client: httpx.AsyncClient, interval_s: float, timeout_s: float):
        self._workers = workers
        self._client = client
        self._interval_s = interval_s
        self._timeout = httpx.Timeout(timeout_s)

    async def probe(self, worker: Worker) -> bool:
        try:
            r = await self._client.get(worker.url + "/health", timeout=self._timeout)
            ok = r.status_code == 200
            if ok:
                m = await self._client.get(worker.url + "/metrics", timeout=self._timeout)
                if m.status_code == 200:
                    for attr, value in parse_load(m.text).items():
                        setattr(worker, attr, value)
                v = await self._client.get(worker.url + "/v1/models", timeout=self._timeout)
                if v.status_code == 200:
                    worker.models = frozenset(str(d.get("id")) for d in v.json().get("data", []))
        except (httpx.HTTPError, ValueError, AttributeError) as e:
            log.debug("probe of %s failed: %r", worker.url, e)
            ok = False
        self._workers.probe_result(worker, ok)
        return ok

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in self._workers.all()))

    async def run(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self._interval_s)
