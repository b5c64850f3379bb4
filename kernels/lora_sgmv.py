"""LoRA's two halves for a prefill or mixed step, by segment (punica's SGMV): the step's tokens
come in runs that share one adapter (a prompt's tokens are contiguous, and neighbouring
sequences of one adapter join the run), so each tile of a run's rows reads its adapter's A and
B once, as a small matrix product, instead of once per token as lora.py's BGMV kernels do.

  segments: starts [G + 1] (token offsets, starts[0] = 0, starts[G] = T), slots [G] (-1: base)
  shrink:   u[t] = x[t] @ A[slot[g]]       for starts[g] <= t < starts[g + 1]; x [T, K] -> u [T, R] fp32
            (by K slice: partials [P, T, R] whose sum is u)
  expand:   y[t] += u[t] @ B[slot[g]]      u (or its partials), B [S, R, N], y [T, N] in place
            (a packed output's parts by `ends`, as lora.py's expand: one launch for q | k | v)

A base segment's rows get zeros from shrink and are left alone by expand, as in BGMV. The grid
has a dimension of `max_len` (the longest segment) row tiles: the step's segments are built on
the host with its inputs (model_runner), so only eager steps use these kernels; a captured
decode step keeps BGMV, whose grid depends on shapes only. References:
reference.lora_shrink_sgmv_ref / lora_expand_sgmv_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import FLOAT_DTYPES, INDEX_DTYPES, check_devices, check_tensor, dot_in_f32, dot_precision
from pdserve.kernels.lora import slice_bounds
from pdserve.kernels.pdl import pdl_args, pdl_enter


# Rows of a segment one program multiplies: tl.dot wants >= 16 on every side. fp32 models
# multiply in full fp32 (launch.dot_precision), bf16/fp16 ones on the tensor cores, the fp32
# product of expand as TF32.
BLOCK_M = 16
# K columns one shrink program reads (the shrink is split along K, as BGMV's): a 16-row tile
# walking all of Llama-8B's 14336 (down_proj) alone was the prefill's LoRA cost; at 1024, K = 4096
# makes 4 partials and 14336 makes 14, which each expand program sums in a fixed order.
K_PER_SPLIT = 1024


@triton.jit
def _segment_rows(starts_ptr, seg_slots_ptr, BLOCK_M: tl.constexpr):
    # Program (g, i, .): rows [i * BLOCK_M, +BLOCK_M) of segment g, which of them it holds, its adapter slot.
    g = tl.program_id(0)
    start = tl.load(starts_ptr + g).to(tl.int64)
    end = tl.load(starts_ptr + g + 1).to(tl.int64)
    m = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    return m, m < end, tl.load(seg_slots_ptr + g).to(tl.int64)


@triton.jit
def _sgmv_shrink_kernel(x_ptr, a_ptr, starts_ptr, seg_slots_ptr, p_ptr, K, R, R_BLOCKS, stride_xt, stride_as,
                        stride_ak, stride_ps, stride_pt, K_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, DOT_F32: tl.constexpr,
                        PRECISION: tl.constexpr, PDL: tl.constexpr = False):
    # Grid (G, cdiv(max_len, BLOCK_M), P * R_BLOCKS): program (g, i, s * R_BLOCKS + j) multiplies
    # its rows' K slice s (K_SPLIT columns) by rank block j and writes partial s.
    pdl_enter(PDL)
    m, rows, slot = _segment_rows(starts_ptr, seg_slots_ptr, BLOCK_M)
    s = tl.program_id(2) // R_BLOCKS
    r = (tl.program_id(2) % R_BLOCKS) * BLOCK_R + tl.arange(0, BLOCK_R)
    k_lo = s * K_SPLIT
    k_hi = tl.where(slot >= 0, tl.minimum(k_lo + K_SPLIT, K), k_lo)  # a base segment reads nothing, stores zeros
    a_base = a_ptr + tl.maximum(slot, 0) * stride_as
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K_SPLIT, BLOCK_K):
        k = k_lo + k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + m[:, None] * stride_xt + k[None, :], mask=rows[:, None] & (k[None, :] < k_hi),
                     other=0.0)
        av = tl.load(a_base + k[:, None] * stride_ak + r[None, :], mask=(k[:, None] < k_hi) & (r[None, :] < R),
                     other=0.0)
        if DOT_F32:
            acc = tl.dot(xv.to(tl.float32), av.to(tl.float32), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(xv, av.to(xv.dtype), acc, input_precision=PRECISION)
    tl.store(p_ptr + s * stride_ps + m[:, None] * stride_pt + r[None, :], acc, mask=rows[:, None] & (r[None, :] < R))


@triton.jit
def _sgmv_rows_product(u_ptr, m, rows, r, P, u_col, r_live, stride_us, stride_ut, BLOCK_M: tl.constexpr,
                       BLOCK_R: tl.constexpr):
    # Rows m's product columns [u_col + r]: their P partials summed in order 0..P-1.
    uv = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for p in range(0, P):
        uv += tl.load(u_ptr + p * stride_us + m[:, None] * stride_ut + u_col + r[None, :],
                      mask=rows[:, None] & (r[None, :] < r_live), other=0.0)
    return uv


@triton.jit
def _sgmv_expand_kernel(y_ptr, u_ptr, b_ptr, starts_ptr, seg_slots_ptr, N, R, P, END0, END1, stride_yt, stride_us,
                        stride_ut, stride_bs, stride_br, SLICES: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
                        PDL: tl.constexpr = False):
    # Grid (G, cdiv(max_len, BLOCK_M), cdiv(N, BLOCK_N)). u: P partials of the rows' product
    # [P, T, SLICES * R], summed here in order 0..P-1 (the same in every program). Slices 0, 1, 2
    # own y's columns [0, END0), [END0, END1), [END1, N), as in lora.py's expand: B's tile is
    # read once, and each slice's product multiplies the tile's columns of that slice (the
    # others zeroed in registers).
    pdl_enter(PDL)
    m, rows, slot = _segment_rows(starts_ptr, seg_slots_ptr, BLOCK_M)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_live = tl.where(slot >= 0, R, 0)
    b_base = b_ptr + tl.maximum(slot, 0) * stride_bs
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        bv = tl.load(b_base + r[:, None] * stride_br + n[None, :], mask=(r[:, None] < r_live) & (n[None, :] < N),
                     other=0.0).to(tl.float32)
        uv = _sgmv_rows_product(u_ptr, m, rows, r, P, 0, r_live, stride_us, stride_ut, BLOCK_M, BLOCK_R)
        if SLICES == 1:
            acc = tl.dot(uv, bv, acc, input_precision=PRECISION)
        else:
            acc = tl.dot(uv, tl.where(n[None, :] < END0, bv, 0.0), acc, input_precision=PRECISION)
            uv = _sgmv_rows_product(u_ptr, m, rows, r, P, R, r_live, stride_us, stride_ut, BLOCK_M, BLOCK_R)
            acc = tl.dot(uv, tl.where((n[None, :] >= END0) & (n[None, :] < END1), bv, 0.0), acc,
                         input_precision=PRECISION)
        if SLICES >= 3:
            uv = _sgmv_rows_product(u_ptr, m, rows, r, P, 2 * R, r_live, stride_us, stride_ut, BLOCK_M, BLOCK_R)
            acc = tl.dot(uv, tl.where(n[None, :] >= END1, bv, 0.0), acc, input_precision=PRECISION)
    out = y_ptr + m[:, None] * stride_yt + n[None, :]
    keep = rows[:, None] & (n[None, :] < tl.where(slot >= 0, N, 0))  # a base segment: nothing stored
    y = tl.load(out, mask=keep, other=0.0).to(tl.float32)
    tl.store(out, (y + acc).to(y_ptr.dtype.element_ty), mask=keep)


def _check(fn: str, rows: torch.Tensor, stack: torch.Tensor, starts: torch.Tensor, seg_slots: torch.Tensor,
           inner: int) -> None:
    check_tensor(fn, "stack", stack, (None, None, None), FLOAT_DTYPES)
    check_tensor(fn, "seg_slots", seg_slots, (None,), INDEX_DTYPES)
    check_tensor(fn, "starts", starts, (seg_slots.shape[0] + 1,), INDEX_DTYPES)
    check_devices(fn, rows=rows, stack=stack, starts=starts, seg_slots=seg_slots)
    if rows.shape[1] != inner:
        raise ValueError(f"{fn}: the rows have {rows.shape[1]} columns, the stack's inner size is {inner}")
    if rows.stride(-1) != 1 or not stack.is_contiguous():
        raise ValueError(f"{fn}: rows must be contiguous in their last dimension and the stack contiguous")


def lora_shrink_sgmv_partials(x: torch.Tensor, a: torch.Tensor, starts: torch.Tensor, seg_slots: torch.Tensor,
                              max_len: int) -> torch.Tensor:
    """reference.lora_shrink_sgmv_ref by K slice: partials [cdiv(K, K_PER_SPLIT), T, R] fp32,
    which lora_expand_sgmv takes as they are (what the LoRA layers run); `max_len`: the longest segment."""
    check_tensor("lora_shrink_sgmv", "x", x, (None, None), FLOAT_DTYPES)
    _check("lora_shrink_sgmv", x, a, starts, seg_slots, a.shape[1])
    t, (_, k, r), g = x.shape[0], a.shape, seg_slots.shape[0]
    block_r = max(16, triton.next_power_of_2(min(r, 64)))
    block_k = max(16, min(triton.next_power_of_2(k), 64))
    k_split = triton.cdiv(min(K_PER_SPLIT, k), block_k) * block_k
    splits = max(1, triton.cdiv(k, k_split))
    parts = torch.empty((splits, t, r), dtype=torch.float32, device=x.device)
    if t == 0 or r == 0 or g == 0 or max_len <= 0:
        return parts.zero_()
    r_blocks = triton.cdiv(r, block_r)
    grid = (g, triton.cdiv(max_len, BLOCK_M), splits * r_blocks)
    _sgmv_shrink_kernel[grid](x, a, starts, seg_slots, parts, k, r, r_blocks, x.stride(0), a.stride(0), a.stride(1),
                              parts.stride(0), parts.stride(1), K_SPLIT=k_split, BLOCK_M=BLOCK_M, BLOCK_K=block_k,
                              BLOCK_R=block_r, DOT_F32=dot_in_f32(x.dtype), PRECISION=dot_precision(x.dtype),
                              **pdl_args(x.device))
    return parts


def lora_shrink_sgmv(x: torch.Tensor, a: torch.Tensor, starts: torch.Tensor, seg_slots: torch.Tensor,
                     max_len: int) -> torch.Tensor:
    """Triton version of reference.lora_shrink_sgmv_ref: [T, R] fp32 (the partials summed)."""
    parts = lora_shrink_sgmv_partials(x, a, starts, seg_slots, max_len)
    return parts[0].clone() if parts.shape[0] == 1 else parts.sum(0)


def lora_expand_sgmv(y: torch.Tensor, u: torch.Tensor, b: torch.Tensor, starts: torch.Tensor,
                     seg_slots: torch.Tensor, max_len: int, ends=None) -> torch.Tensor:
    """Triton version of reference.lora_expand_sgmv_ref (in place on y; returns y). `u`: the
    product [T, slices * R] fp32, or lora_shrink_sgmv_partials' [P, T, slices * R] (summed
    here); `ends`: where each slice of a packed output ends, as lora.lora_expand's."""
    check_tensor("lora_expand_sgmv", "y", y, (None, None), FLOAT_DTYPES)
    t, (_, r, n), g = y.shape[0], b.shape, seg_slots.shape[0]
    slices, end0, end1 = slice_bounds("lora_expand_sgmv", ends, n)
    parts = u if u.dim() == 3 else u.unsqueeze(0)
    check_tensor("lora_expand_sgmv", "u", parts, (None, t, slices * r), (torch.float32,))
    _check("lora_expand_sgmv", parts[0], b, starts, seg_slots, slices * r)
    if y.shape[1] != n or y.stride(-1) != 1:
        raise ValueError(f"lora_expand_sgmv: y must be [T, {n}] and contiguous in its last dimension")
    if t == 0 or n == 0 or g == 0 or max_len <= 0:
        return y
    block_n = max(16, min(triton.next_power_of_2(n), 64))
    block_r = max(16, triton.next_power_of_2(min(r, 64)))
    grid = (g, triton.cdiv(max_len, BLOCK_M), triton.cdiv(n, block_n))
    _sgmv_expand_kernel[grid](y, parts, b, starts, seg_slots, n, r, parts.shape[0], end0, end1, y.stride(0),
                              parts.stride(0), parts.stride(1), b.stride(0), b.stride(1), SLICES=slices,
                              BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=block_r, PRECISION=dot_precision(y.dtype),
                              **pdl_args(y.device))
    return y
