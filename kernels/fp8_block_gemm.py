"""Block-scaled FP8 GEMM (DeepSeek-V3 / Qwen3-FP8 128x128 format): out = (A * As) @ (B * Bs)^T.

A: e4m3 activations [M, K] with fp32 scales As [M, ceil(K/128)] (per token and 128-column
group: fp8_quant.py). B: e4m3 weight [N, K] with fp32 scales Bs [ceil(N/scale_rows),
ceil(K/128)]: scale_rows = 128 for the published block grid, 1 when the scales are kept per row
(small models whose fused q/k/v parts are not 128-row aligned: worker/quantization/fp8_linear.py).

Each program owns a BLOCK_M x BLOCK_N tile and walks K one 128-column scale group at a time: an
FP8 tensor-core dot of the group, then the partial sum times A's row scales and B's column
scales, accumulated in fp32. Partial blocks (K, N, M not multiples of the tile) are masked.
Tile sizes are fixed per M bucket (no autotuning: it would benchmark during CUDA-graph capture).
Reference: reference.fp8_block_gemm_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import FLOAT_DTYPES, check_devices, check_tensor
from pdserve.kernels.pdl import pdl_args, pdl_enter


FP8 = torch.float8_e4m3fn
GROUP_K = 128


@triton.jit
def _fp8_block_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K,
                           stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
                           SCALE_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn
    as_rows = as_ptr + offs_m * stride_asm
    bs_rows = bs_ptr + (offs_n // SCALE_ROWS) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k = kb * BLOCK_K + offs_k
        mask_k = k < K
        a = tl.load(a_rows + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_cols + k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        a_s = tl.load(as_rows + kb, mask=mask_m, other=0.0)
        b_s = tl.load(bs_rows + kb, mask=mask_n, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _tiles(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by M: decode-sized M takes narrow N tiles so
    enough programs stream the weight; prefill-sized M takes square tiles for reuse."""
    # M > 64: the fastest of a sweep on an H200 at Llama-3.1-8B shapes (M = 1024 and 8192;
    # 128x128 w8 s3 was 5-70% slower; docs/fp8-gpu-results.md). M <= 16 runs fp8_gemv in the engine.
    if m <= 16:
        return 16, 32, 4, 4
    if m <= 64:
        return 64, 64, 4, 4
    if m <= 2048:
        return 64, 128, 4, 3
    return 64, 256, 8, 3


def fp8_block_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                   scale_rows: int, out_dtype: torch.dtype, tiles: dict | None = None) -> torch.Tensor:
    """[M, K] e4m3 x [N, K] e4m3 -> [M, N] out_dtype, with 128-column group scales (module doc).
    `tiles`: BLOCK_M, BLOCK_N, num_warps, num_stages (default: _tiles by M; benchmarks sweep it)."""
    fn = "fp8_block_gemm"
    check_tensor(fn, "a", a, (None, None), (FP8,))
    m, k = a.shape
    groups = triton.cdiv(k, GROUP_K)
    check_tensor(fn, "b", b, (None, k), (FP8,))
    n = b.shape[0]
    check_tensor(fn, "a_scale", a_scale, (m, groups), (torch.float32,))
    check_tensor(fn, "b_scale", b_scale, (triton.cdiv(n, scale_rows), groups), (torch.float32,))
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"{fn}: out_dtype must be one of float16, bfloat16, float32, got {out_dtype}")
    check_devices(fn, a=a, a_scale=a_scale, b=b, b_scale=b_scale)
    for name, t in (("a", a), ("b", b), ("a_scale", a_scale), ("b_scale", b_scale)):
        if t.stride(-1) != 1:
            raise ValueError(f"{fn}: {name} must be contiguous in its last dimension, got strides {t.stride()}")
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    bm, bn, warps, stages = (_tiles(m) if tiles is None else
                             (tiles["BLOCK_M"], tiles["BLOCK_N"], tiles["num_warps"], tiles["num_stages"]))
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _fp8_block_gemm_kernel[grid](a, a_scale, b, b_scale, out, m, n, k, a.stride(0), a_scale.stride(0),
                                 b.stride(0), b_scale.stride(0), out.stride(0), SCALE_ROWS=scale_rows,
                                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=GROUP_K, num_warps=warps, num_stages=stages,
                                 **pdl_args(a.device))
    return out
