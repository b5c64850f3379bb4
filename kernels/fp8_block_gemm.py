"""Block-scaled FP8 GEMM (DeepSeek-V3 / Qwen3-FP8 128x128 format): out = (A * As) @ (B * Bs)^T.

A: e4m3 activations [M, K] with fp32 scales As [M, ceil(K/128)] (per token and 128-column
group: fp8_quant.py). B: e4m3 weight [N, K] with fp32 scales Bs [ceil(N/scale_rows),
ceil(K/128)]: scale_rows = 128 for the published block grid, 1 when the scales are kept per row
(small models whose fused q/k/v parts are not 128-row aligned: worker/quantization/fp8_linear.py).

Each program owns a BLOCK_M x BLOCK_N tile and walks K one 128-column scale group at a time: an
FP8 tensor-core dot of the group, then the partial sum times A's row scales and B's column
scales, accumulated in fp32. Partial blocks (K, N, M not multiples of the tile) are masked.
Decode batches past the GEMV's rows (17-127) leave few tiles (Llama-3.1-8B's down_proj at 64 rows:
64 tiles of 64 x 64 on a 132-SM card, each streaming 14336 columns), so K can be split there
(SPLIT_MAX_M): each slice writes fp32 partial sums and the tile's last slice to arrive adds them in
slice order (the same bits on every run; kernels/arrivals.py), in the same launch.
Tile sizes are fixed per M bucket (no autotuning: it would benchmark during CUDA-graph capture).
Reference: reference.fp8_block_gemm_ref.

`fp8_rowwise_gemm` runs the same tiles and splits for per-channel weights (scales per token and
per output row, applied once to the sum): the W8A8 GEMM of decode batches past the GEMV's rows,
where cuBLASLt's row-wise kernels (torch._scaled_mm, built for large tiles) leave the same few
tiles (Llama-3.1-8B's down_proj at 64 rows read at 40% of copy bandwidth on an H100).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.arrivals import MAX_COUNTERS, last_arrival, reset_arrivals, strip_counters
from pdserve.kernels.launch import FLOAT_DTYPES, check_devices, check_tensor, num_sms
from pdserve.kernels.pdl import pdl_args, pdl_enter


FP8 = torch.float8_e4m3fn
GROUP_K = 128


@triton.jit
def _fp8_block_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, part_ptr, counter_ptr, M, N, K, GROUPS_PER_SPLIT,
                           stride_am, stride_asm, stride_bn, stride_bsn, stride_cm, stride_ps,
                           SPLITS: tl.constexpr, SCALE_ROWS: tl.constexpr, ROWWISE: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m, mask_n = offs_m < M, offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn
    as_rows = as_ptr + offs_m * stride_asm
    bs_rows = bs_ptr + (offs_n // SCALE_ROWS) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    kb_begin = pid_s * GROUPS_PER_SPLIT
    kb_end = tl.minimum(kb_begin + GROUPS_PER_SPLIT, tl.cdiv(K, BLOCK_K))
    for kb in range(kb_begin, kb_end):
        k = kb * BLOCK_K + offs_k
        mask_k = k < K
        a = tl.load(a_rows + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_cols + k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if ROWWISE:
            # Promoted to the fp32 accumulator every group, as the scaled groups below are: sm90's
            # FP8 tensor cores add in reduced precision, and Triton's default there never promotes
            # (torch._scaled_mm's default, use_fast_accum=False, promotes too).
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            a_s = tl.load(as_rows + kb, mask=mask_m, other=0.0)
            b_s = tl.load(bs_rows + kb, mask=mask_n, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    if ROWWISE:  # one scale per token and per output row: once, on the slice's sum
        acc *= tl.load(as_rows, mask=mask_m, other=0.0)[:, None] * tl.load(bs_rows, mask=mask_n, other=0.0)[None, :]
    tile_mask = mask_m[:, None] & mask_n[None, :]
    if SPLITS == 1:
        c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=tile_mask)
    else:
        # This slice's partial sums; the tile's last slice to arrive adds all of them in slice order.
        parts = part_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(parts + pid_s * stride_ps, acc, mask=tile_mask)
        tile = pid_m * tl.num_programs(1) + pid_n
        if last_arrival(counter_ptr, tile, SPLITS):
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s_i in range(SPLITS):
                total += tl.load(parts + s_i * stride_ps, mask=tile_mask, other=0.0, cache_modifier=".cg")
            c = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
            tl.store(c, total.to(c_ptr.dtype.element_ty), mask=tile_mask)
            reset_arrivals(counter_ptr, tile)


def _tiles(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by M: decode-sized M takes narrow N tiles so
    enough programs stream the weight; prefill-sized M takes square tiles for reuse."""
    # M > 64: the fastest of a sweep on an H200 at Llama-3.1-8B shapes (M = 1024 and 8192;
    # 128x128 w8 s3 was 5-70% slower; docs/fp8-gpu-results.md). M <= 16 runs fp8_gemv in the engine.
    # 17-64: 3 stages, with _split_k's slices, the fastest of an H100 sweep at 64 rows (gate_up_proj
    # unsplit 48 us against 62 at 4 stages; docs/results/fp8/2026-12-07-h100-w8a8-k-split.md).
    if m <= 16:
        return 16, 32, 4, 4
    if m <= 64:
        return 64, 64, 4, 3
    if m <= 2048:
        return 64, 128, 4, 3
    return 64, 256, 8, 3


# K is split up to this many rows (the decode batches measured: 64 rows on an H100; 65-127 keep one
# slice, unmeasured; prefill-sized M has tiles enough; 0: never, unless `tiles` asks), into slices
# of at least MIN_SPLIT_GROUPS scale groups (a slice's partial store and the sum must stay small
# beside its reads), SPLIT_WAVES x the SMs' programs in all: Llama-3.1-8B's qkv, o and down at 64
# rows were fastest at 2.9x (split 4, 6, 6: 18.4 / 15.4 / 34.8 us against 32.5 / 29.6 / 99.0
# unsplit; the H100 sweep in docs/results/fp8/2026-12-07-h100-w8a8-k-split.md).
SPLIT_ROWS = 64
SPLIT_MAX_M = SPLIT_ROWS
SPLIT_WAVES = 3
MIN_SPLIT_GROUPS = 4


def _split_k(m: int, tiles: int, groups: int, sms: int) -> int:
    """K slices per tile: about SPLIT_WAVES programs per SM where the tiles alone leave SMs idle."""
    if m > SPLIT_MAX_M or tiles >= sms:
        return 1
    return max(1, min(round(SPLIT_WAVES * sms / tiles), groups // MIN_SPLIT_GROUPS))


def fp8_block_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                   scale_rows: int, out_dtype: torch.dtype, tiles: dict | None = None) -> torch.Tensor:
    """[M, K] e4m3 x [N, K] e4m3 -> [M, N] out_dtype, with 128-column group scales (module doc).
    `tiles`: BLOCK_M, BLOCK_N, num_warps, num_stages and optionally SPLIT_K (default: _tiles by M,
    K split by _split_k; benchmarks sweep them)."""
    fn = "fp8_block_gemm"
    m, k, n = _check_operands(fn, a, b, out_dtype)
    groups = triton.cdiv(k, GROUP_K)
    check_tensor(fn, "a_scale", a_scale, (m, groups), (torch.float32,))
    check_tensor(fn, "b_scale", b_scale, (triton.cdiv(n, scale_rows), groups), (torch.float32,))
    return _launch(fn, a, a_scale, b, b_scale, scale_rows, False, out_dtype, tiles)


def fp8_rowwise_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                     out_dtype: torch.dtype, tiles: dict | None = None) -> torch.Tensor:
    """[M, K] e4m3 x [N, K] e4m3 -> [M, N] out_dtype with one scale per token (a_scale [M, 1])
    and per output row (b_scale [N] or [1, N]): torch._scaled_mm's row-wise product on this
    kernel's tiles and K splits (module doc). `tiles` as fp8_block_gemm's."""
    fn = "fp8_rowwise_gemm"
    m, k, n = _check_operands(fn, a, b, out_dtype)
    check_tensor(fn, "a_scale", a_scale, (m, 1), (torch.float32,))
    if b_scale.numel() != n or b_scale.dtype != torch.float32:
        raise ValueError(f"{fn}: b_scale must hold {n} float32 per-row scales, got {tuple(b_scale.shape)} "
                         f"{b_scale.dtype}")
    return _launch(fn, a, a_scale, b, b_scale.reshape(n, 1), 1, True, out_dtype, tiles)


def _check_operands(fn: str, a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> tuple[int, int, int]:
    check_tensor(fn, "a", a, (None, None), (FP8,))
    m, k = a.shape
    check_tensor(fn, "b", b, (None, k), (FP8,))
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"{fn}: out_dtype must be one of float16, bfloat16, float32, got {out_dtype}")
    return m, k, b.shape[0]


def _launch(fn: str, a, a_scale, b, b_scale, scale_rows: int, rowwise: bool, out_dtype: torch.dtype,
            tiles: dict | None) -> torch.Tensor:
    check_devices(fn, a=a, a_scale=a_scale, b=b, b_scale=b_scale)
    for name, t in (("a", a), ("b", b), ("a_scale", a_scale), ("b_scale", b_scale)):
        if t.stride(-1) != 1 and t.shape[-1] != 1:
            raise ValueError(f"{fn}: {name} must be contiguous in its last dimension, got strides {t.stride()}")
    (m, k), n = a.shape, b.shape[0]
    groups = triton.cdiv(k, GROUP_K)
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    bm, bn, warps, stages = (_tiles(m) if tiles is None else
                             (tiles["BLOCK_M"], tiles["BLOCK_N"], tiles["num_warps"], tiles["num_stages"]))
    grid_m, grid_n = triton.cdiv(m, bm), triton.cdiv(n, bn)
    split = (_split_k(m, grid_m * grid_n, groups, num_sms(a.device)) if tiles is None or "SPLIT_K" not in tiles
             else max(1, min(tiles["SPLIT_K"], groups)))
    per_split = triton.cdiv(groups, split)
    split = triton.cdiv(groups, per_split)  # no empty slice
    if split > 1 and grid_m * grid_n > MAX_COUNTERS:
        split, per_split = 1, groups
    parts = torch.empty((split, m, n), dtype=torch.float32, device=a.device) if split > 1 else out
    counters = strip_counters(a.device) if split > 1 else out
    _fp8_block_gemm_kernel[(grid_m, grid_n, split)](
        a, a_scale, b, b_scale, out, parts, counters, m, n, k, per_split, a.stride(0), a_scale.stride(0),
        b.stride(0), b_scale.stride(0), out.stride(0), parts.stride(0) if split > 1 else 0, SPLITS=split,
        SCALE_ROWS=scale_rows, ROWWISE=rowwise, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=GROUP_K, num_warps=warps,
        num_stages=stages, **pdl_args(a.device))
    return out
