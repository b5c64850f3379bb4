"""When the pool is saturated even below `--flow-control-max-inflight`: every routable decode
worker reports at least `--flow-control-worker-max-waiting` queued requests
(vllm:num_requests_waiting) or a KV cache used past `--flow-control-worker-max-kv-usage`
(vllm:kv_cache_usage_perc), as the prober scrapes them. Then requests wait at the router, in
band and fairness order, instead of in the workers' FIFO queues."""

from __future__ import annotations

from typing import Callable

from pdserve.protocol.contract import ROLE_DECODE
from pdserve.router.flow_control.config import FlowControlConfig
from pdserve.router.workers import WorkerSet


def saturation_check(config: FlowControlConfig, workers: WorkerSet) -> Callable[[], bool]:
    if not (config.worker_max_waiting or config.worker_max_kv_usage):
        return lambda: False

    def full(w) -> bool:
        return bool((config.worker_max_waiting and w.num_waiting >= config.worker_max_waiting)
                    or (config.worker_max_kv_usage and w.kv_usage >= config.worker_max_kv_usage))

    def saturated() -> bool:
        pool = workers.pool(ROLE_DECODE)
        return bool(pool) and all(full(w) for w in pool)

    return saturated
