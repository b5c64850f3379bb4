"""Arrival counters: the last of a group of programs finishes the group's work in the same launch.

A split-K GEMV (fused_gemv, fp8_gemv) writes each K slice's partial sums, then the strip's last
program to arrive adds them in slice order and stores the result: no second launch (moe_gate's
routing, the split decode attention's merge and fused_moe's DOWN_REDUCE_HERE finish the same way). The
protocol, in `last_arrival` and `reset_arrivals`: every thread's stores, a barrier, one acq_rel
increment of the group's counter (the release publishes this program's stores, the last
arrival's acquire sees everyone's), and the last arrival sets the counter back to zero, so the
next launch (or graph replay) finds it as the first did.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# int32 zeros the kernels count arrivals in, one per group (an output strip; moe_gate: a token;
# the split decode attention: a (sequence, KV head)), left zero after every launch (fused_gemv's
# and fp8_gemv's reduce_in_kernel, moe_gate, fused_moe's DOWN_REDUCE_HERE, the Triton attention
# backend's fused split merge). One buffer per device: a device's kernels run in stream order (the
# engine's one compute stream; two streams launching them at once would mix their counts), and
# every launch leaves its groups at zero.
MAX_COUNTERS = 1 << 16
_counters: dict[torch.device, torch.Tensor] = {}


def strip_counters(device: torch.device) -> torch.Tensor:
    """The device's counters, made on first use; never during CUDA-graph capture (its address is
    baked into the graph): DecodeGraphs runs each bucket once before capturing it."""
    buf = _counters.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("split-K counters would be allocated during CUDA-graph capture; "
                               "run the launch once before capturing")
        buf = _counters[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return buf


@triton.jit
def last_arrival(counter_ptr, group, arrivals):
    """True in the program that arrives last of `arrivals` at `group`'s counter; its loads after
    this see every earlier arrival's stores (read them with cache_modifier=".cg")."""
    tl.debug_barrier()  # every thread's stores before the counting thread's release
    arrived = tl.atomic_add(counter_ptr + group, 1, sem="acq_rel", scope="gpu")
    return arrived == arrivals - 1


@triton.jit
def reset_arrivals(counter_ptr, group):
    """The last arrival, done: the counter back to zero for the next launch."""
    tl.atomic_xchg(counter_ptr + group, 0, sem="relaxed", scope="gpu")
