"""Reading a Prometheus /metrics page: one sample family's value, summed over the series whose
labels include the ones asked for (0 when there is none yet, e.g. a counter never incremented).

    before = metric(worker, "pdserve_kv_transfer_bytes_total")  # a WorkerProcess: its url, its key
    metric(router.url, "pdserve_router_requests_total", status="200", disaggregated="yes")

`name` is a sample's full name (a counter's `_total`, a histogram's `_count`), matched exactly,
so one name never picks up another that merely starts with it.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str, headers: dict[str, str] | None = None, timeout: float = 10) -> str:
    """The /metrics page of the server at `url` (a keyed server wants `headers`)."""
    r = httpx.get(url + "/metrics", headers=headers, timeout=timeout)
    r.raise_for_status()
    return r.text


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named `name` in a /metrics page whose labels include `labels`."""
    want = labels.items()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and want <= s.labels.items())


def metric(server, name: str, *, headers: dict[str, str] | None = None, **labels: str) -> float:
    """`metric_value` of a server's page, read now. `server`: its URL, or a test's handle on it
    (its `url`, and its `headers` when it is keyed: WorkerProcess, the router tests' Proc)."""
    if isinstance(server, str):
        return metric_value(scrape(server, headers), name, **labels)
    return metric_value(scrape(server.url, headers or getattr(server, "headers", None)), name, **labels)
