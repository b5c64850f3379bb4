"""How many intra-op threads a CPU step computes on: all of them for prompts, one fewer for decodes.

torch splits each op of a step over its threads and every op ends at a barrier, so one thread
that the OS preempts stalls the op. A serving worker has other threads that want a core while a
step runs (the event loop streaming tokens, the tokenizer, the HTTP server, often the client
too): on a small host they preempt a compute thread on every decode step, whose ops are short.
A decode step therefore leaves one core to them. A step with prompt tokens (a prefill chunk,
alone or mixed with decodes) is long matmuls that the other threads barely interrupt, and it
takes every core.

A batch-invariant bf16 engine (`native_prompts`: every linear and the attention of a prompt step
run as native kernels, kernels/cpu_native.py) computes prompt steps on the native kernels' own
threads: torch keeps one thread then, because its OpenMP threads spin between ops and a spinning
thread takes the core a native share wanted (SmolLM2, 2 cores, a 512-token prompt: 300-400 ms
with torch's two threads awake, 195 ms with one; docs/engine.md).

torch.set_num_threads is a few microseconds and only called when the count changes; it applies
to the thread that calls it, which is the engine's step thread. The native calls' count is
cpu_native.set_threads'.
"""

from __future__ import annotations

import torch

from pdserve.kernels import cpu_native


class CpuThreads:
    def __init__(self, total: int | None = None, native_prompts: bool = False):
        """`total`: the threads a prompt step gets (default: torch's, i.e. OMP_NUM_THREADS or one
        per core); a decode step gets one fewer, at least one. `native_prompts`: prompt steps'
        threads are the native kernels' and torch keeps one (the module docstring)."""
        self.total = total if total is not None else torch.get_num_threads()
        self.decode = max(1, self.total - 1)
        self.native_prompts = native_prompts
        self._current = None

    def for_step(self, decode_only: bool) -> int:
        """Set the step's threads (torch's intra-op count and the native calls'); returns the
        count the step computes on."""
        n = self.decode if decode_only else self.total
        torch_n = 1 if self.native_prompts and not decode_only else n
        if (torch_n, n) != self._current:
            torch.set_num_threads(torch_n)
            cpu_native.set_threads(n)
            self._current = (torch_n, n)
        return n


def cpu_native_prompts(model, kv_dtype: torch.dtype) -> bool:
    """A CPU model whose prompt steps run on native kernels alone: batch-invariant, every linear
    read by the native GEMM (cpu_packed.pack_model says), a bf16 cache, the kernels built."""
    return (cpu_native.batch_invariant() and getattr(model, "cpu_gemm_every_linear", False)
            and kv_dtype == torch.bfloat16 and cpu_native.library() is not None and cpu_native.pointwise() is not None)
