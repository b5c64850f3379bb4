"""Keeps one KV-event subscriber per known worker, following discovery's changes.

Each worker publishes on its own host at the configured ports (5557 live, 5558 replay), so the
endpoints follow from the worker URL. A worker that leaves has its subscription cancelled and
its blocks dropped from the index.
"""

from __future__ import annotations

import asyncio

import zmq.asyncio

from pdserve.router.config import RouterConfig
from pdserve.protocol.kv_events import KVEventSubscriber
from pdserve.router.kv_index import KVIndex
from pdserve.router.metrics import RouterMetrics
from pdserve.router.workers import WorkerSet


class KVSubscriptions:
    def __init__(self, index: KVIndex, workers: WorkerSet, config: RouterConfig, metrics: RouterMetrics,
                 resync_s: float = 1.0):
        self._metrics = metrics
        self._index = index
        self._workers = workers
        self._config = config
        self._resync_s = resync_s
        self._ctx = zmq.asyncio.Context()
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self._tasks: dict[str, asyncio.Task] = {}

    def _endpoints(self, host: str) -> tuple[str, str]:
        host = f"[{host}]" if ":" in host else host
        return (f"tcp://{host}:{self._config.kv_events_port}", f"tcp://{host}:{self._config.kv_events_replay_port}")

    def sync(self) -> None:
        wanted = {w.url: w.host for w in self._workers.all()}
        for url in list(self._tasks):
            if url not in wanted:
                self._tasks.pop(url).cancel()
                self.subscribers.pop(url)
                self._index.clear(url)
        for url, host in wanted.items():
            if url in self._tasks:
                continue
            pub, replay = self._endpoints(host)
            sub = KVEventSubscriber(self._ctx, pub, replay,
                                    apply=lambda events, url=url: self._apply(url, events),
                                    reset=lambda url=url: self._index.clear(url))
            self.subscribers[url] = sub
            self._tasks[url] = asyncio.create_task(sub.run(), name=f"kv-events {url}")

    def _apply(self, url: str, events: list[dict]) -> None:
        self._index.apply(url, events)
        self._metrics.kv_index_blocks.labels(url).set(self._index.num_blocks(url))

    async def run(self) -> None:
        try:
            while True:
                self.sync()
                await asyncio.sleep(self._resync_s)
        finally:
            for task in self._tasks.values():
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def close(self) -> None:
        self._ctx.destroy(linger=0)
