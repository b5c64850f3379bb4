"""How fast this process's CPU runs Python right now: a fixed piece of interpreter work, timed.

A small model's offline run is paced by the engine's host loop as much as by the GPU, and on the
lent GPU machines (KVM guests) one process can run that loop ~1.7x slower than the next on the
same machine and tree (docs/results/engine/2026-12-06-h100-offline-host-modes.md): the same GPU
kernels, a different host. A benchmark that prints this probe beside its rows says which host a
row ran on, so a same-call A/B compares like with like.

The work is the kind the engine's step does per request (attribute reads, small lists and dicts,
method calls), a fixed amount, timed five times; the median is returned in microseconds.
"""

from __future__ import annotations

import statistics
import time


class _Row:
    __slots__ = ("rid", "tokens", "blocks", "done")

    def __init__(self, rid: int):
        self.rid, self.tokens, self.blocks, self.done = rid, [], [rid], False


def _work(n: int = 256, steps: int = 40) -> int:
    rows = [_Row(i) for i in range(n)]
    index: dict[int, int] = {}
    total = 0
    for step in range(steps):
        for i, r in enumerate(rows):
            r.tokens.append(step)
            if len(r.tokens) % 16 == 0:
                r.blocks.append(step)
            index[r.rid] = i
            total += len(r.blocks) + (1 if r.done else 0)
    return total


def host_probe_us(repeats: int = 5) -> float:
    """Median µs of `repeats` runs of the fixed work (~1-3 ms each on a server core)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _work()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)
