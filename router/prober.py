"""Background health probes and load scraping of every worker.

Each round, per worker and concurrently: `GET /health` (200 means ready), then `GET /metrics`
for the vLLM gauges least-loaded uses and the LoRA adapters in each worker's slots
(`vllm:lora_requests_info`), and `GET /v1/models` for the served-model union (adapters included,
with their `parent`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re

import aiohttp

from pdserve.router.workers import UNROUTABLE_AFTER_SLOW_PROBES, Worker, WorkerSet

log = logging.getLogger("pdserve.router")

# Gauges read from the worker's Prometheus text (vLLM's names), summed over label sets.
_GAUGES = {
    "vllm:num_requests_waiting": "num_waiting",
    "vllm:num_requests_running": "num_running",
    "vllm:kv_cache_usage_perc": "kv_usage",
}


LORA_INFO = "vllm:lora_requests_info"


def _labels(line: str) -> dict[str, str]:
    """`name{a="x",b="y"} v` -> {"a": "x", "b": "y"} (the exposition's escapes undone)."""
    inner = line[line.index("{") + 1:line.rindex("}")]
    unescape = lambda v: re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), v)
    return {k: unescape(v) for k, v in re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', inner)}


def _names(labels: dict[str, str], key: str) -> frozenset[str]:
    return frozenset(n for n in labels.get(key, "").split(",") if n)


def parse_lora(text: str) -> dict[str, object] | None:
    """The newest `vllm:lora_requests_info` sample (its value is when it was taken), as the
    Worker's lora_running / lora_waiting / max_lora; None when the worker exports none."""
    best, newest = None, float("-inf")
    for line in text.splitlines():
        if not line.startswith(LORA_INFO + "{"):
            continue
        try:
            when = float(line.rsplit("}", 1)[1].split()[0])
            labels = _labels(line)
            max_lora = int(labels.get("max_lora") or 0)
        except (ValueError, IndexError):
            continue
        if when >= newest:
            best, newest = {"lora_running": _names(labels, "running_lora_adapters"),
                            "lora_waiting": _names(labels, "waiting_lora_adapters"), "max_lora": max_lora}, when
    return best


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
    def __init__(self, workers: WorkerSet, session: aiohttp.ClientSession, interval_s: float, timeout_s: float):
        self._workers = workers
        self._session = session
        self._interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def _get(self, url: str) -> tuple[int, bytes]:
        async with self._session.get(url, timeout=self._timeout) as r:
            return r.status, await r.read()

    async def probe(self, worker: Worker) -> bool:
        """/health decides; /metrics and /v1/models only refresh what the router knows of it (a
        slow scrape of a worker whose /health answered 200 does not take it out of the pools)."""
        timed_out, why = False, ""
        try:
            status, _ = await self._get(worker.url + "/health")
            ok, why = status == 200, f"/health answered {status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.debug("probe of %s failed: %r", worker.url, e)
            ok, timed_out = False, isinstance(e, asyncio.TimeoutError)
            why = (f"/health timed out {UNROUTABLE_AFTER_SLOW_PROBES} times in a row" if timed_out
                   else f"/health failed: {e!r}")
        if ok:
            try:
                await self._scrape(worker)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError, TypeError) as e:
                log.debug("scraping %s failed: %r", worker.url, e)
        was = worker.healthy
        self._workers.probe_result(worker, ok, timed_out)
        # Pool changes are rare and explain 503s and fallbacks: logged, with their cause.
        if was and not worker.healthy:
            log.warning("%s worker %s out of its pools: %s", worker.role, worker.url, why)
        elif worker.healthy and not was:
            log.info("%s worker %s back in its pools", worker.role, worker.url)
        return ok

    async def _scrape(self, worker: Worker) -> None:
        # The models first: requests need them (a slow /metrics must not keep them unknown).
        status, body = await self._get(worker.url + "/v1/models")
        if status == 200:
            cards = json.loads(body).get("data", [])
            worker.models = frozenset(str(d.get("id")) for d in cards)
            lens = [d["max_model_len"] for d in cards if isinstance(d.get("max_model_len"), int)]
            worker.max_model_len = min(lens) if lens else None
            worker.roots = {str(d.get("id")): d["root"] for d in cards if isinstance(d.get("root"), str)}
            worker.parents = {str(d.get("id")): d["parent"] for d in cards if isinstance(d.get("parent"), str)}
            worker.lora_loading = any(d.get("runtime_lora_loading") is True for d in cards)
        status, body = await self._get(worker.url + "/metrics")
        if status == 200:
            text = body.decode(errors="replace")
            for attr, value in parse_load(text).items():
                setattr(worker, attr, value)
            lora = parse_lora(text) or {"lora_running": frozenset(), "lora_waiting": frozenset(), "max_lora": None}
            for attr, value in lora.items():
                setattr(worker, attr, value)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(w) for w in self._workers.all()))

    async def run(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self._interval_s)
