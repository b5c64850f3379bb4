"""How many intra-op threads a CPU step computes on: all of them for prompts, one fewer for decodes.

torch splits each op of a step over its threads and every op ends at a barrier, so one thread
that the OS preempts stalls the op. A serving worker has other threads that want a core while a
step runs (the event loop streaming tokens, the tokenizer, the HTTP server, often the client
too): on a small host they preempt a compute thread on every decode step, whose ops are short.
A decode step therefore leaves one core to them. A step with prompt tokens (a prefill chunk,
alone or mixed with decodes) is long matmuls that the other threads barely interrupt, and it
takes every core.

torch.set_num_threads is a few microseconds and only called when the count changes; it applies
to the thread that calls it, which is the engine's step thread.
"""

from __future__ import annotations

import torch


class CpuThreads:
    def __init__(self, total: int | None = None):
        """`total`: the threads a prompt step gets (default: torch's, i.e. OMP_NUM_THREADS or one
        per core); a decode step gets one fewer, at least one."""
        self.total = total if total is not None else torch.get_num_threads()
        self.decode = max(1, self.total - 1)
        self._current = None

    def for_step(self, decode_only: bool) -> int:
        """Set the step thread's intra-op threads for a step; returns the count."""
        n = self.decode if decode_only else self.total
        if n != self._current:
            torch.set_num_threads(n)
            self._current = n
        return n
