"""KVMetrics: one observation per pulled request (bytes, seconds, bandwidth) under its transport,
and the decode side's hand-off waits."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdserve.worker.kv.metrics import KVMetrics


def sample(m: KVMetrics, name: str, **labels) -> float | None:
    registry = CollectorRegistry()
    registry.register(m)
    return registry.get_sample_value(name, labels)


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_observe_pull_records_one_request(transport):
    m = KVMetrics()
    m.observe_pull(transport, 4096, 0.5)
    recv = {"direction": "recv", "transport": transport}
    assert sample(m, "pdserve_kv_transfer_bytes_total", **recv) == 4096
    assert sample(m, "pdserve_kv_transfer_seconds_count", **recv) == 1
    assert sample(m, "pdserve_kv_transfer_seconds_sum", **recv) == 0.5
    assert sample(m, "pdserve_kv_transfer_request_bytes_count", **recv) == 1
    assert sample(m, "pdserve_kv_transfer_request_bytes_sum", **recv) == 4096
    assert sample(m, "pdserve_kv_transfer_request_bytes_bucket", le="4096.0", **recv) == 1
    assert sample(m, "pdserve_kv_transfer_bandwidth_bytes_per_second_count", **recv) == 1
    assert sample(m, "pdserve_kv_transfer_bandwidth_bytes_per_second_sum", **recv) == 8192
    other = "nixl" if transport == "tcp" else "tcp"  # the other transport's series stay absent
    assert sample(m, "pdserve_kv_transfer_request_bytes_count", direction="recv", transport=other) is None


def test_a_pull_without_measurable_duration_has_no_bandwidth():
    m = KVMetrics()
    m.observe_pull("tcp", 100, 0.0)
    recv = {"direction": "recv", "transport": "tcp"}
    assert sample(m, "pdserve_kv_transfer_request_bytes_count", **recv) == 1
    assert sample(m, "pdserve_kv_transfer_bandwidth_bytes_per_second_count", **recv) is None


def test_decode_waits_observe_only_what_a_request_had():
    m = KVMetrics()
    m.observe_decode_waits(0.25, None)  # e.g. its pull failed: it never had a landed pull to wait after
    m.observe_decode_waits(0.5, 0.125)
    assert sample(m, "pdserve_kv_decode_admission_wait_seconds_count") == 2
    assert sample(m, "pdserve_kv_decode_admission_wait_seconds_sum") == 0.75
    assert sample(m, "pdserve_kv_first_step_wait_seconds_count") == 1
    assert sample(m, "pdserve_kv_first_step_wait_seconds_sum") == 0.125


def test_a_pull_tail_is_observed_under_its_transport():
    m = KVMetrics()
    m.observe_pull_tail("nixl", 0.04)
    m.observe_pull_tail("tcp", 0.002)
    assert sample(m, "pdserve_kv_pull_tail_seconds_count", direction="recv", transport="nixl") == 1
    assert sample(m, "pdserve_kv_pull_tail_seconds_sum", direction="recv", transport="nixl") == 0.04
    assert sample(m, "pdserve_kv_pull_tail_seconds_sum", direction="recv", transport="tcp") == 0.002


def test_every_family_is_collected_once():
    m = KVMetrics()
    registry = CollectorRegistry()
    registry.register(m)
    text = generate_latest(registry).decode()
    for name, kind in (("pdserve_kv_transfer_bytes_total", "counter"), ("pdserve_kv_transfer_seconds", "histogram"),
                       ("pdserve_kv_transfer_request_bytes", "histogram"),
                       ("pdserve_kv_transfer_bandwidth_bytes_per_second", "histogram"),
                       ("pdserve_kv_transfer_failures_total", "counter"),
                       ("pdserve_kv_local_prefill_fallbacks_total", "counter"),
                       ("pdserve_kv_decode_admission_wait_seconds", "histogram"),
                       ("pdserve_kv_first_step_wait_seconds", "histogram"),
                       ("pdserve_kv_pull_tail_seconds", "histogram")):
        assert text.count(f"# TYPE {name} {kind}\n") == 1, name
