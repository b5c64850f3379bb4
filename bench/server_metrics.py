"""The servers' own view of a run: Prometheus `/metrics` scraped before and after, differenced.

Only monotonic series are kept (counters, and histograms' `_sum`/`_count`), so the difference is
what happened during the run: e.g. `vllm:generation_tokens_total` must equal the tokens the load
generator received, and `pdserve_kv_transfer_seconds_sum / _count` is the mean KV pull time.
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

_MONOTONIC = ("counter", "histogram", "summary")


def _key(name: str, labels: dict) -> str:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "model_name")
    return f"{name}{{{inner}}}" if inner else name


def scrape(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """`URL/metrics` -> {series: value} for its monotonic series (bucket series left out)."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout_s) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type not in _MONOTONIC:
            continue
        for s in family.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            key = _key(s.name, s.labels)
            out[key] = out.get(key, 0.0) + s.value  # several model_name labels fold together
    return out


def scrape_all(urls: list[str]) -> dict[str, dict[str, float]]:
    return {u: scrape(u) for u in urls}


def delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    return {u: {k: v - before.get(u, {}).get(k, 0.0) for k, v in after[u].items()
                if v - before.get(u, {}).get(k, 0.0)} for u in after}


def total(deltas: dict[str, dict[str, float]], series: str, urls: list[str] | None = None) -> float:
    """Sum of one series (exact key, e.g. 'vllm:generation_tokens_total') over the given servers."""
    return sum(d.get(series, 0.0) for u, d in deltas.items() if urls is None or u in urls)


def mean(deltas: dict[str, dict[str, float]], histogram: str, urls: list[str] | None = None,
         labels: str = "") -> float | None:
    """Mean of one histogram over the run, from its `_sum` and `_count` deltas."""
    count = total(deltas, f"{histogram}_count{labels}", urls)
    return total(deltas, f"{histogram}_sum{labels}", urls) / count if count else None
