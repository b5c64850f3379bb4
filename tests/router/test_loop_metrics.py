"""The router's lock-free series (router/loop_metrics.py) expose exactly what prometheus_client's
own kinds do for the same updates, and refuse what those refuse."""

from __future__ import annotations

import math
import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.router.loop_metrics import LoopCounter, LoopGauge, LoopHistogram

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.1, 1.0, 10.0)


def _exposition(counter, gauge, histogram, registry) -> list[str]:
    rng = random.Random(7)
    for _ in range(500):
        counter.labels(rng.choice("ab"), "200").inc(rng.choice((1, 3, 0.5)))
        gauge.labels(rng.choice("xy")).set(rng.randint(-3, 9))
        # On and between the bounds, past the last one, and a NaN (in no bucket, the sum only).
        histogram.labels("yes").observe(rng.choice((*BUCKETS, 0.0, 0.003, 0.7, 11.0, 1e9)))
    histogram.labels("no").observe(math.nan)
    histogram.labels("no").observe(0.002)
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_the_same_updates_give_the_same_exposition():
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    expected = _exposition(Counter("c", "c", ["route", "status"], registry=theirs),
                           Gauge("g", "g", ["worker"], registry=theirs),
                           Histogram("h", "h", ["p"], buckets=BUCKETS, registry=theirs), theirs)
    got = _exposition(LoopCounter("c", "c", ["route", "status"], registry=ours),
                      LoopGauge("g", "g", ["worker"], registry=ours),
                      LoopHistogram("h", "h", ["p"], buckets=BUCKETS, registry=ours), ours)
    assert got == expected


def test_what_prometheus_client_refuses_is_still_refused():
    r = CollectorRegistry()
    counter, gauge = LoopCounter("c", "c", ["x"], registry=r), LoopGauge("g", "g", ["x"], registry=r)
    histogram = LoopHistogram("h", "h", ["x"], registry=r)
    with pytest.raises(ValueError):
        counter.inc()  # a labelled parent
    with pytest.raises(ValueError):
        gauge.set(1)
    with pytest.raises(ValueError):
        histogram.observe(1)
    with pytest.raises(ValueError):
        counter.labels("a").inc(-1)  # counters only go up
    unlabelled = LoopHistogram("u", "u", registry=r)
    unlabelled.observe(0.5, {"trace_id": "abc"})  # an exemplar: prometheus_client's own path
    assert r.get_sample_value("u_bucket", {"le": "0.5"}) == 1.0
    assert r.get_sample_value("u_bucket", {"le": "0.25"}) == 0.0
