"""`vllm:lora_requests_info`, as vLLM exports it: one sample whose labels name the adapters of
the running and of the waiting requests (comma-separated) and the GPU slots (`max_lora`); its
value is when that was last seen (Unix seconds). A LoRA-aware router reads which worker runs
which adapter from it."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client.core import GaugeMetricFamily

NAME = "vllm:lora_requests_info"


class LoRARequestsInfo:
    """The prometheus_client collector protocol (`CollectorRegistry.register(self)`)."""

    def __init__(self, max_loras: int, snapshot: Callable[[], tuple[list[str], list[str]]]):
        self.max_loras = max_loras
        self.snapshot = snapshot  # (running adapters, waiting adapters), each name once

    def describe(self):
        return [GaugeMetricFamily(NAME, "Running stats on LoRA requests.",
                                  labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"])]

    def collect(self):
        running, waiting = self.snapshot()
        family = GaugeMetricFamily(NAME, "Running stats on LoRA requests.",
                                   labels=["running_lora_adapters", "max_lora", "waiting_lora_adapters"])
        family.add_metric([",".join(running), str(self.max_loras), ",".join(waiting)], time.time())
        yield family
