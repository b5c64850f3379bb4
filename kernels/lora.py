"""LoRA's two halves for a batch in which every token may run another adapter (punica's BGMV:
one gathered matrix-vector product per token, the adapter picked by the token's slot).

  shrink: p[s, t] = x[t, Ks] @ A[slot[t]][Ks]   x [T, K], A [S, K, R] -> partials [P, T, R] fp32
  expand: y[t] += (sum_s p[s, t]) @ B[slot[t]]  B [S, R, N], y [T, N] in place

A packed projection (q | k | v, gate | up: one input, its parts' outputs side by side) is one
shrink and one expand for all its parts: A holds the parts' A matrices side by side ([S, K,
parts * R]: one shrink gives every part's product), and the expand takes the column where each
part ends (`ends`): part i's output columns take product columns [i * R, (i + 1) * R) through
their own R rows of B, so B is [S, R, N] whatever the parts (no block-diagonal zeros to read).

The shrink is split along K: at decode sizes (T = 1..64, R = 16..48) a program per token would
walk all of K (4096, or 14336 for Llama-8B's down_proj) alone, latency-bound on one SM for tens
of microseconds, so each program takes one K_PER_SPLIT slice and writes its partial product. The
expand sums a token's P partials itself, in one fixed order (no atomics, no second launch): the
split depends on K alone, so a token's result is the same bits whatever the batch around it.

Slot -1 is the base model: shrink writes zeros, expand leaves the row alone. The slots are read
on the device, the grids depend on shapes only: a decode step with adapters is captured by the
CUDA graphs like any other. A prefill's tokens of one adapter each re-read its A and B (SGMV
would share them across a segment); at LoRA's ranks those reads are small beside the base GEMM.
References: reference.lora_shrink_ref / lora_expand_ref.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import FLOAT_DTYPES, check_devices, check_tensor
from pdserve.kernels.pdl import pdl_args, pdl_enter


# K columns one shrink program reads: Llama-8B's 4096 makes 8 programs per token, 14336 makes 28
# (each four unrolled 128-column tiles: a few microseconds), and the expand's sum of P partials
# stays one small tile. The split depends on K alone, never on T: batch invariance.
# PDSERVE_LORA_K_PER_SPLIT overrides it for a whole engine (a measurement; `pdserve bench lora
# --kernels` sweeps it without one). 512 over 256: H200, Llama-8B shapes, batch 8 with 4 adapters
# 1.25x the base step vs 1.25x-1.26x, batch 64 1.97x vs 2.00x, batch 1 1.16x vs 1.13x (docs/lora.md).
K_PER_SPLIT = int(os.environ.get("PDSERVE_LORA_K_PER_SPLIT", "512"))
# A shrink slice of at most this many BLOCK_K tiles is unrolled (the default's 2): the tiles' loads
# are independent, and a decode-sized shrink is a few memory round trips long, not bandwidth-bound.
UNROLL_K_TILES = tl.constexpr(4)


@triton.jit
def _lora_shrink_tile(x_row, a_base, k, k_end, k_hi, r, R, stride_ak):
    # One BLOCK_K tile: x's mask ignores the slot, so its load goes out beside the slot's rather
    # than after it; A's (the slot's rows) is empty for slot -1, which makes the product zero.
    xv = tl.load(x_row + k, mask=k < k_end, other=0.0).to(tl.float32)
    av = tl.load(a_base + k[:, None] * stride_ak + r[None, :], mask=(k[:, None] < k_hi) & (r[None, :] < R),
                 other=0.0).to(tl.float32)
    return tl.sum(xv[:, None] * av, axis=0)


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, slots_ptr, p_ptr, K, R, stride_xt, stride_as, stride_ak, stride_ps,
                        stride_pt, K_SPLIT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                        PDL: tl.constexpr = False):
    # Grid (T, P, cdiv(R, BLOCK_R)): program (t, s, .) multiplies x[t, s*K_SPLIT : +K_SPLIT].
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    # Slot -1 reads and adds nothing: its slice is taken as empty (a scalar bool in a mask is not portable).
    k_lo = s * K_SPLIT
    k_end = tl.minimum(k_lo + K_SPLIT, K)
    k_hi = tl.where(slot >= 0, k_end, k_lo)
    a_base = a_ptr + tl.maximum(slot, 0) * stride_as
    x_row = x_ptr + t * stride_xt
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    if K_SPLIT // BLOCK_K <= UNROLL_K_TILES:  # a slice of a few tiles: every tile's loads in flight at once
        for k0 in tl.static_range(0, K_SPLIT, BLOCK_K):
            acc += _lora_shrink_tile(x_row, a_base, k_lo + k0 + tl.arange(0, BLOCK_K), k_end, k_hi, r, R, stride_ak)
    else:
        for k0 in range(0, K_SPLIT, BLOCK_K):
            acc += _lora_shrink_tile(x_row, a_base, k_lo + k0 + tl.arange(0, BLOCK_K), k_end, k_hi, r, R, stride_ak)
    tl.store(p_ptr + s * stride_ps + t * stride_pt + r, acc, mask=r < R)


@triton.jit
def _lora_expand_kernel(y_ptr, u_ptr, b_ptr, slots_ptr, N, P, END0, END1, stride_yt, stride_us, stride_ut,
                        stride_bs, stride_br, R: tl.constexpr, SLICES: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr = False):
    # Grid (T, cdiv(N, BLOCK_N)). u: P partials of each token's product [P, T, SLICES * R],
    # summed here (tl.sum over a fixed [BLOCK_P, BLOCK_R] tile: the same order in every program
    # and every batch). Slices 0, 1, 2 own y's columns [0, END0), [END0, END1), [END1, N): a
    # column multiplies its own slice's product by its B rows. R is a constexpr so that the
    # loops unroll and every load (B once, each slice's partials) is issued before the math:
    # at decode sizes this kernel is a few memory round trips long, not a bandwidth bound.
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    p = tl.arange(0, BLOCK_P)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    r_live = tl.where(slot >= 0, R, 0)  # slot -1: nothing summed, nothing stored
    b_base = b_ptr + tl.maximum(slot, 0) * stride_bs
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in tl.static_range(0, R, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        rows = u_ptr + p[:, None] * stride_us + t * stride_ut + r[None, :]
        live = (p[:, None] < P) & (r[None, :] < R)  # slot -1's partials are the shrink's zeros
        bv = tl.load(b_base + r[:, None] * stride_br + n[None, :], mask=(r[:, None] < r_live) & (n[None, :] < N),
                     other=0.0).to(tl.float32)
        u0 = tl.load(rows, mask=live, other=0.0)
        if SLICES >= 2:
            u1 = tl.load(rows + R, mask=live, other=0.0)
        if SLICES >= 3:
            u2 = tl.load(rows + 2 * R, mask=live, other=0.0)
        own = tl.sum(u0, axis=0)[:, None]  # [BLOCK_R, 1], then per column its slice's
        if SLICES >= 2:
            own = tl.where(n[None, :] >= END0, tl.sum(u1, axis=0)[:, None], own)
        if SLICES >= 3:
            own = tl.where(n[None, :] >= END1, tl.sum(u2, axis=0)[:, None], own)
        acc += tl.sum(own * bv, axis=0)
    out = y_ptr + t * stride_yt + n
    y = tl.load(out, mask=n < N, other=0.0).to(tl.float32)  # not waiting on the slot: only the store does
    tl.store(out, (y + acc).to(y_ptr.dtype.element_ty), mask=n < tl.where(slot >= 0, N, 0))


def _check(fn: str, rows: torch.Tensor, stack: torch.Tensor, slots: torch.Tensor, inner: int) -> None:
    check_tensor(fn, "stack", stack, (None, None, None), FLOAT_DTYPES)
    check_tensor(fn, "slots", slots, (rows.shape[0],), (torch.int32, torch.int64))
    check_devices(fn, rows=rows, stack=stack, slots=slots)
    if rows.shape[1] != inner:
        raise ValueError(f"{fn}: the rows have {rows.shape[1]} columns, the stack's inner size is {inner}")
    if rows.stride(-1) != 1 or not stack.is_contiguous():
        raise ValueError(f"{fn}: rows must be contiguous in their last dimension and the stack contiguous")


def lora_shrink_partials(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor,
                         k_per_split: int | None = None) -> torch.Tensor:
    """x [T, K] @ a[slots] by K slice -> partials [cdiv(K, k_per_split), T, R] fp32, which
    lora_expand takes as they are (what the LoRA layers run: no separate reduction).
    `k_per_split` (default K_PER_SPLIT) >= K: one program per token walks all of K."""
    k_per_split = K_PER_SPLIT if k_per_split is None else k_per_split
    if k_per_split < 1:
        raise ValueError(f"lora_shrink: k_per_split (PDSERVE_LORA_K_PER_SPLIT) must be >= 1, got {k_per_split}")
    check_tensor("lora_shrink", "x", x, (None, None), FLOAT_DTYPES)
    _check("lora_shrink", x, a, slots, a.shape[1])
    t, (_, k, r) = x.shape[0], a.shape
    block_r = triton.next_power_of_2(min(r, 64))
    block_k = min(triton.next_power_of_2(k), 128, triton.next_power_of_2(k_per_split))
    k_split = triton.cdiv(min(k_per_split, k), block_k) * block_k  # whole K tiles per program
    splits = max(1, triton.cdiv(k, k_split))
    parts = torch.empty((splits, t, r), dtype=torch.float32, device=x.device)
    if t == 0 or r == 0:
        return parts.zero_()
    _lora_shrink_kernel[(t, splits, triton.cdiv(r, block_r))](
        x, a, slots, parts, k, r, x.stride(0), a.stride(0), a.stride(1), parts.stride(0), parts.stride(1),
        K_SPLIT=k_split, BLOCK_K=block_k, BLOCK_R=block_r, **pdl_args(x.device))
    return parts


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Triton version of reference.lora_shrink_ref: [T, R] fp32 (the partials summed)."""
    parts = lora_shrink_partials(x, a, slots)
    return parts[0].clone() if parts.shape[0] == 1 else parts.sum(0)


MAX_SLICES = 3  # q | k | v: the most parts one LoRA linear fuses


def slice_bounds(fn: str, ends, n: int) -> tuple[int, int, int]:
    """(slices, END0, END1) of the kernels' arguments for a packed output whose parts end at
    `ends` (cumulative column ends, the last = n); None: one slice, the whole output."""
    ends = [n] if ends is None else [int(e) for e in ends]
    if not 1 <= len(ends) <= MAX_SLICES or ends[-1] != n or any(b <= a for a, b in zip([0] + ends, ends)):
        raise ValueError(f"{fn}: slice ends {ends} must rise from above 0 to the output's {n} columns, "
                         f"at most {MAX_SLICES} of them")
    padded = ends + [n] * (MAX_SLICES - len(ends))
    return len(ends), padded[0], padded[1]


def lora_expand(y: torch.Tensor, u: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                ends=None) -> torch.Tensor:
    """Triton version of reference.lora_expand_ref (in place on y; returns y). `u`: the product
    [T, slices * R] fp32, or lora_shrink_partials' [P, T, slices * R] (summed here). `ends`: the
    column where each slice of a packed output (q | k | v) ends; slice i adds its R product
    columns through b's rows [0, R) of its own columns (b [S, R, N]). None: one slice."""
    check_tensor("lora_expand", "y", y, (None, None), FLOAT_DTYPES)
    t, (_, r, n) = y.shape[0], b.shape
    slices, end0, end1 = slice_bounds("lora_expand", ends, n)
    parts = u if u.dim() == 3 else u.unsqueeze(0)
    check_tensor("lora_expand", "u", parts, (None, t, slices * r), (torch.float32,))
    _check("lora_expand", parts[0], b, slots, slices * r)
    if y.shape[1] != n or y.stride(-1) != 1:
        raise ValueError(f"lora_expand: y must be [T, {n}] and contiguous in its last dimension")
    splits = parts.shape[0]
    if t == 0 or n == 0:
        return y
    block_n = min(triton.next_power_of_2(n), 128)
    block_p = triton.next_power_of_2(splits)
    # The partials' tile [BLOCK_P, BLOCK_R] stays near 1024 values: 56 partials of rank 16 at Llama-8B's down_proj.
    block_r = max(1, min(triton.next_power_of_2(min(r, 64)), max(1, 1024 // block_p)))
    _lora_expand_kernel[(t, triton.cdiv(n, block_n))](y, parts, b, slots, n, splits, end0, end1, y.stride(0),
                                                      parts.stride(0), parts.stride(1), b.stride(0), b.stride(1),
                                                      R=r, SLICES=slices, BLOCK_N=block_n, BLOCK_R=block_r,
                                                      BLOCK_P=block_p, **pdl_args(y.device))
    return y
