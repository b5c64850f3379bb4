"""Prometheus series that only the event loop's thread updates: a plain float, no lock.

prometheus_client guards every value with a mutex and checks on every update that the metric is
a child of a labelled one; a P/D request makes ~20 such updates (in-flight gauges, latency
histograms, counters), about 3 % of its CPU. The router's per-request series are updated only by
the event loop's callbacks and tasks, never from the threads `off_loop` or `to_thread` run, so a
scrape (also on the loop) reads each value between two updates, never inside one.

Each class is prometheus_client's own (registration, labels, exposition unchanged) with its
values replaced by `LoopValue` and the hot update done inline; anything unusual (an exemplar, a
negative counter increment, a labelled parent) takes prometheus_client's path and its errors.
"""

from __future__ import annotations

from bisect import bisect_left

from prometheus_client import Counter, Gauge, Histogram


class LoopValue:
    """What prometheus_client's `MutexValue` offers, without its lock."""

    __slots__ = ("_value", "_exemplar")

    def __init__(self) -> None:
        self._value = 0.0
        self._exemplar = None

    def inc(self, amount: float) -> None:
        self._value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def set_exemplar(self, exemplar) -> None:
        self._exemplar = exemplar

    def get(self) -> float:
        return self._value

    def get_exemplar(self):
        return self._exemplar


class LoopCounter(Counter):
    def _metric_init(self) -> None:
        super()._metric_init()
        self._value = LoopValue()

    def inc(self, amount: float = 1, exemplar=None) -> None:
        value = getattr(self, "_value", None)  # none on a labelled parent: prometheus_client raises
        if value is None or exemplar or amount < 0:
            super().inc(amount, exemplar)
            return
        value._value += amount


class LoopGauge(Gauge):
    def _metric_init(self) -> None:
        super()._metric_init()
        self._value = LoopValue()

    def set(self, value: float) -> None:
        held = getattr(self, "_value", None)
        if held is None:
            super().set(value)
            return
        held._value = float(value)


class LoopHistogram(Histogram):
    def _metric_init(self) -> None:
        super()._metric_init()
        self._sum = LoopValue()
        self._buckets = [LoopValue() for _ in self._upper_bounds]

    def observe(self, amount: float, exemplar=None) -> None:
        buckets = getattr(self, "_buckets", None)
        if buckets is None or exemplar:
            super().observe(amount, exemplar)
            return
        self._sum._value += amount
        # The first bucket whose upper bound is >= amount (the last bound is +Inf; a NaN is in
        # none), as prometheus_client's linear scan finds it.
        bounds = self._upper_bounds
        i = bisect_left(bounds, amount)
        if amount <= bounds[i]:
            buckets[i]._value += 1
