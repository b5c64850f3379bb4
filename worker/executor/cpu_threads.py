"""How many intra-op threads a CPU step computes on: all of them for prompts, one fewer for decodes.

torch splits each op of a step over its threads and every op ends at a barrier, so one thread
that the OS preempts stalls the op. A serving worker has other threads that want a core while a
step runs (the event loop streaming tokens, the tokenizer, the HTTP server, often the client
too): on a small host they preempt a compute thread on every decode step, whose ops are short.
A decode step therefore leaves one core to them. A step with prompt tokens (a prefill chunk,
alone or mixed with decodes) is long matmuls that the other threads barely interrupt, and it
takes every core.

A batch-invariant engine (`batch_invariant`: a bf16 model whose every product and attention the
native kernels compute, kernels/cpu_native.py) marks each step so and computes prompt steps on
the native kernels' own threads: torch keeps one thread then, because its OpenMP threads spin
between ops and a spinning thread takes the core a native share wanted (SmolLM2, 2 cores, a
512-token prompt: 300-400 ms with torch's two threads awake, 195 ms with one; docs/engine.md).

torch.set_num_threads is a few microseconds and only called when the count changes; it applies
to the thread that calls it, which is the engine's step thread. The native calls' count is
cpu_native.set_threads'.
"""

from __future__ import annotations

import torch

from pdserve.kernels import cpu_native


class CpuThreads:
    def __init__(self, total: int | None = None, batch_invariant: bool = False):
        """`total`: the threads a prompt step gets (default: torch's, i.e. OMP_NUM_THREADS or one
        per core); a decode step gets one fewer, at least one. `batch_invariant`: the steps run
        every row on the native kernels, whose threads a prompt step's are (the module docstring)."""
        self.total = total if total is not None else torch.get_num_threads()
        self.decode = max(1, self.total - 1)
        self.batch_invariant = batch_invariant

    def for_step(self, decode_only: bool) -> int:
        """Set the step's threads (torch's intra-op count and the native calls') and its
        invariance; returns the count the step computes on. Set every step: engines of one process
        (tests) share the switches."""
        n = self.decode if decode_only else self.total
        torch_n = 1 if self.batch_invariant and not decode_only else n
        if torch.get_num_threads() != torch_n:
            torch.set_num_threads(torch_n)
        cpu_native.set_threads(n)
        cpu_native.set_step_invariant(self.batch_invariant)
        return n


def cpu_batch_invariant(model, kv_dtype: torch.dtype, lora: bool = False) -> bool:
    """A CPU engine that runs batch-invariant: asked for (cpu_native.batch_invariant), every
    product of the model on the native GEMM (cpu_packed.pack_model says; no adapters, whose
    deltas are torch's matmuls), a bf16 cache, the kernels built."""
    return (cpu_native.batch_invariant() and not lora and getattr(model, "cpu_gemm_every_linear", False)
            and kv_dtype == torch.bfloat16 and cpu_native.library() is not None and cpu_native.pointwise() is not None)
