"""Bulk L2 prefetch of a program's weight rows, for the memory-bound decode GEMVs.

A decode GEMV at one token streams each weight byte once, and a program's K loop only has the
loads of one step in flight: at 20-30% occupancy (gpt-oss-120b's MXFP4 expert GEMVs on an H200,
docs/results/gpt-oss/2026-12-04-h200-decode-bounds.md) the SMs keep too few bytes in flight for
HBM's latency, and DRAM runs at a quarter of its rate. Hopper's TMA unit takes a bulk prefetch
(`cp.async.bulk.prefetch.L2`: an address and a byte count, no registers, no completion to wait
for): issued once at a program's start for every row it will read, the whole strip streams from
HBM into L2 at once, and the K loop's ordinary loads then hit L2. The values read do not change;
only when their bytes arrive.

Kernels call `prefetch_rows` under a constexpr their launchers set only where `available` (a
CUDA device of compute capability 9.0 or more, not the interpreter, which runs no asm).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import interpreting

# One bulk prefetch per row, issued by threads 0 .. rows - 1 of the program (row i's first byte
# at base + i * stride): computed inside the asm from %tid.x, so the issue does not depend on how
# Triton lays a tensor over the threads, and no thread repeats another's row. Each span is widened
# to 16-byte boundaries (the bulk copy's granularity): at most 15 bytes either side, never past
# the 512-byte granule an allocation of torch's caching allocator is rounded to.
_PREFETCH_ROWS_ASM = tl.constexpr("""
{
.reg .pred p;
.reg .u32 t;
.reg .u64 lo;
.reg .u64 hi;
.reg .u64 n;
mov.u32 t, %tid.x;
setp.lt.u32 p, t, $2;
mul.wide.u32 lo, t, $3;
add.u64 lo, $1, lo;
cvt.u64.u32 n, $4;
add.u64 hi, lo, n;
add.u64 hi, hi, 15;
and.b64 hi, hi, -16;
and.b64 lo, lo, -16;
sub.u64 n, hi, lo;
cvt.u32.u64 t, n;
@p cp.async.bulk.prefetch.L2.global [lo], t;
mov.u32 $0, 0;
}
""")


@triton.jit
def prefetch_rows(base, rows, stride_bytes, nbytes):
    """Prefetch `rows` rows of `nbytes` bytes each into L2, row i at byte address base + i *
    stride_bytes (base: any pointer; rows <= the program's threads)."""
    tl.inline_asm_elementwise(
        _PREFETCH_ROWS_ASM, "=r,l,r,r,r",
        [base.to(tl.pointer_type(tl.int8)).to(tl.int64, bitcast=True), tl.cast(rows, tl.int32),
         tl.cast(stride_bytes, tl.int32), tl.cast(nbytes, tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)


def available(device: torch.device) -> bool:
    """True where prefetch_rows can be turned on: a CUDA device of compute capability >= 9.0
    (the bulk prefetch is Hopper's), not under the interpreter."""
    if interpreting() or device.type != "cuda":
        return False
    return _hopper_or_later(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _hopper_or_later(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)
