"""A CPU step's bf16 linears read straight from oneDNN's packed weights by a native kernel
(cpu_small_gemm.c): a decode batch's few rows always, a prompt's many rows too while the engine is
batch-invariant (cpu_native.step_invariant: every row then gets the same sums whatever its step);
with that off, many rows stay on oneDNN, faster there.

At 1-32 rows a SmolLM2 linear is bound by reading its weight, and oneDNN's packed GEMM reads it at
about half the rate a plain AVX512-BF16 loop does (this 2-core machine, weights from memory: 1-4
rows 1.6-2.4x faster, 8 rows 1.2-1.9x, 32 rows 1.0-1.3x). The kernel needs no copy of the weight:
it reads the packed tensor in place (blocks of 64 output columns, [K/2][64][2] each: the layout
oneDNN picks on a CPU with AVX512-BF16 and no AMX). `attach` checks that layout at load, once per
shape, by comparing the kernel with oneDNN on a probe; a weight that fails (another layout: AMX,
a shape not in 64-column blocks) keeps oneDNN.

The sums are oneDNN's products in K order, accumulated in fp32 and rounded once to bf16, like
oneDNN's; where oneDNN splits K differently the last fp32 bit differs, and so at times one bf16
step of an output (tests/kernels/test_cpu_small_gemm.py compares with the fp32 reference).
`PDSERVE_CPU_SMALL_GEMM=0` turns it off (A/B runs; batch invariance then does not hold).

Many rows are split by rows over the step's threads (cpu_native.threads; a row's sums do not
depend on which thread or pass computes it), six rows a pass over each weight block (the kernel's
widest). On this 2-core machine, SmolLM2's shapes take 1.0-1.25x oneDNN's time at 256-1024 rows and
1.2-2x at 64 (docs/results/cpu/2026-12-05-cpu-batch-invariance.md).
A bias is added to the rounded product (one more bf16 rounding than oneDNN's epilogue), the same
way for every row count.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from pdserve.kernels import cpu_native

ENV = "PDSERVE_CPU_SMALL_GEMM"
SOURCE = Path(__file__).with_name("cpu_small_gemm.c")
MAX_ROWS = 32  # up to here the kernel was faster than oneDNN for every SmolLM2 shape
DECODE_GROUP, PROMPT_GROUP = 4, 6  # rows a pass over a weight block (cpu_small_gemm.c)
ROWS_PER_THREAD = 24  # below this many rows a share is not worth a pool thread
BLOCK = 64  # output columns per packed block
_ATTR = "_small_gemm_ptr"  # on an attached weight: the address of its packed bytes
_layouts: dict[tuple[int, int], bool] = {}  # (N, K) -> the kernel reads oneDNN's packed layout


@functools.cache
def library() -> ctypes.CDLL | None:
    lib = cpu_native.load(SOURCE, "small_gemm_bf16", ENV, "small-batch GEMM")
    if lib is not None:
        p, i = ctypes.c_void_p, ctypes.c_int64
        lib.small_gemm_bf16.argtypes = [p, i, i, i, p, p, i, i, i, i]
        lib.small_gemm_bf16.restype = ctypes.c_int
    return lib


def _run(x: torch.Tensor, ptr: int, n: int) -> torch.Tensor:
    """Up to MAX_ROWS rows: one call on the calling thread (a decode step computes on one thread,
    and a prompt step's few-row call, its last tokens' head, is not handed in shares to a pool
    thread beside torch's OpenMP threads). More: shares of rows on the step's threads."""
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.bfloat16)
    lib, xs = library(), x.stride(0)
    if m <= MAX_ROWS:
        lib.small_gemm_bf16(x.data_ptr(), xs, m, k, ptr, y.data_ptr(), n, 0, n // BLOCK, DECODE_GROUP)
        return y

    def run(lo: int, hi: int) -> None:
        lib.small_gemm_bf16(x[lo].data_ptr(), xs, hi - lo, k, ptr, y[lo].data_ptr(), n, 0, n // BLOCK, PROMPT_GROUP)

    cpu_native.run_split(m, max(1, min(cpu_native.threads(), m // ROWS_PER_THREAD)), run)
    return y


def attach(weight: torch.Tensor) -> bool:
    """Mark a packed bf16 weight [N, K] for the kernel if it reads it as oneDNN does; False: oneDNN
    only. oneDNN picks the layout by shape and CPU, so the first weight of each shape is probed."""
    if os.environ.get(ENV, "1") == "0" or library() is None:
        return False
    n, k = weight.shape
    if n % BLOCK or k % 2:
        return False
    ptr = torch.ops.mkldnn.data_ptr(weight)
    if (n, k) not in _layouts:
        _layouts[(n, k)] = _reads_like_onednn(weight, ptr)
    if _layouts[(n, k)]:
        setattr(weight, _ATTR, ptr)
    return _layouts[(n, k)]


def _reads_like_onednn(weight: torch.Tensor, ptr: int) -> bool:
    """A probe of three rows: the kernel's output equals oneDNN's within fp32 summation order."""
    n, k = weight.shape
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0)).bfloat16()
    ref = torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    if library().small_gemm_bf16(x.data_ptr(), k, 3, k, ptr, torch.empty(0).data_ptr(), n, 0, 0, DECODE_GROUP) != 0:
        return False  # built without AVX512-BF16
    return torch.allclose(_run(x, ptr, n).float(), ref.float(), rtol=1e-2, atol=1e-2)


def attached(weight: torch.Tensor) -> bool:
    return getattr(weight, _ATTR, None) is not None


def small_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x @ W^T for an attached weight and x of contiguous bf16 rows (at most MAX_ROWS unless the
    step is batch-invariant); None: not for the kernel (oneDNN's call then)."""
    ptr = getattr(weight, _ATTR, None)
    if ptr is None or x.dim() != 2 or x.dtype != torch.bfloat16 or x.stride(-1) != 1:
        return None
    if x.shape[0] > MAX_ROWS and not cpu_native.step_invariant():
        return None
    return _run(x, ptr, weight.shape[0])


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, W, bias) for x [M, K] bf16 and W oneDNN's packed bf16 weight: the kernel where
    it takes the call (an attached weight; few rows and no bias unless batch-invariant), else oneDNN."""
    if bias is None or cpu_native.step_invariant():
        out = small_linear(x, weight)
        if out is not None:
            return out if bias is None else out.add_(bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
