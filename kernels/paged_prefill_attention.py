"""Prefill attention over paged KV: variable-length query chunks, causal, with a cached prefix.

Sequence i has `context_lens[i]` tokens in the cache (already written, the new ones
included); its `n_i = cu_seqlens_q[i+1] - cu_seqlens_q[i]` queries are the last n_i of them.

The Triton path runs one program per (query tile, query head). Sequence i's tiles are numbered
from cu_seqlens_q[i] // BLOCK_M + i, so the grid (T // BLOCK_M + B tiles) needs only shapes,
and a program finds its sequence by binary search over that monotone start index. Keys wholly
before the tile's first query need no causal mask; only the diagonal tiles are masked.

Sinks and sliding windows (gpt-oss; constexpr switches, off by default: other models compile the
code they did before). `sinks` [Hq] seeds each row's running max and sum (m = sink, l = 1: one
more logit with a zero value row). With `window` > 0 a query at position p sees keys in
(p - window, p]: the tile's loop starts at the block holding its first query's first key, and
every tile of it is masked by position (a later row's window may start tiles later, so a row may
see nothing of a tile: its running max is then guarded against -inf - -inf).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import (
    check_block_tables_and_scale,
    check_devices,
    check_paged_kv,
    check_sinks_window,
    check_tensor,
    dot_in_f32,
    dot_precision,
    interpreting,
)
from pdserve.kernels.pdl import pdl_args, pdl_enter


# Attention sinks are natural-log logits; the kernels work in log2 units. A constexpr: a jitted
# function may read no other kind of global.
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _attend_tile(
    q, m, l, acc, n0, k_ptr, v_ptr, bt_row_ptr, kvh, q_pos, ctx, scale_log2,
    stride_cb, stride_ct, stride_ch, stride_cd, d, window,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
    SLIDING: tl.constexpr,
):
    # One online-softmax step over keys [n0, n0 + BLOCK_N); CAUSAL masks by position and length.
    toks = n0 + tl.arange(0, BLOCK_N)
    t_mask = toks < ctx
    blk = tl.load(bt_row_ptr + toks // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
    off = blk * stride_cb + (toks % BLOCK_SIZE) * stride_ct + kvh * stride_ch
    kv_mask = t_mask[:, None] & (d[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + off[:, None] + d[None, :] * stride_cd, mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + off[:, None] + d[None, :] * stride_cd, mask=kv_mask, other=0.0)
    if DOT_F32 or KV_FP8:  # fp8 tiles widen exactly to q's type; the caller folded in the K scale
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
    if CAUSAL:
        visible = (toks[None, :] <= q_pos[:, None]) & t_mask[None, :]
        if SLIDING:
            visible = visible & (toks[None, :] > q_pos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m, tl.max(qk, axis=1))
    if SLIDING:  # a row that has seen no key yet keeps m = -inf: exponents from 0, not NaN
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_ref)
        p = tl.exp2(qk - m_ref[:, None])
    else:
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(qk - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l, acc


# num_seqs and the table stride change every step; table/length pointers may be views at any
# offset: none of them may enter the specialization key (a new compile mid-traffic).
@triton.jit(do_not_specialize=["num_seqs", "stride_btb", "window"],
            do_not_specialize_on_alignment=["bt_ptr", "cu_q_ptr", "ctx_ptr", "sinks_ptr"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cu_q_ptr, ctx_ptr, out_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr,
    scale_log2, num_seqs, window,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_ct, stride_ch, stride_cd,
    stride_btb, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr, SLIDING: tl.constexpr, HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    tile = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    # Largest seq with cu_q[seq] // BLOCK_M + seq <= tile. lo/hi start as int32 tensors, not
    # constants: Triton specialises num_seqs == 1 into a constexpr.
    lo = tile * 0
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(cu_q_ptr + mid) // BLOCK_M + mid <= tile:
            lo = mid
        else:
            hi = mid - 1
    seq = lo
    q_start = tl.load(cu_q_ptr + seq)
    n = tl.load(cu_q_ptr + seq + 1) - q_start
    ctx = tl.load(ctx_ptr + seq)
    m0 = (tile - q_start // BLOCK_M - seq) * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    row_mask = rows < n
    q_pos = ctx - n + rows  # queries are the last n tokens of the context
    d = tl.arange(0, D_PAD)
    io_mask = row_mask[:, None] & (d[None, :] < HEAD_DIM)
    q_off = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + q_off[:, None] * stride_qt + h * stride_qh + d[None, :] * stride_qd, mask=io_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    if KV_FP8:  # per-tensor scales: K's multiplies the scores, V's the output
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # the head's sink as a first key with a zero value row
        m = tl.zeros([BLOCK_M], tl.float32) + tl.load(sinks_ptr + h).to(tl.float32) * _LOG2E
        l = l + 1.0
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # A tile past the sequence's queries (the grid over-covers) does no work and stores nothing.
    first_q = ctx - n + m0
    kv_end = tl.where(m0 < n, tl.minimum(ctx, first_q + BLOCK_M), 0)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_btb
    if SLIDING:  # from the block holding the first query's first key, every tile masked
        win_start = tl.where(m0 < n, (tl.maximum(first_q - window + 1, 0) // BLOCK_N) * BLOCK_N, 0)
        for n0 in range(win_start, kv_end, BLOCK_N):
            m, l, acc = _attend_tile(q, m, l, acc, n0, k_ptr, v_ptr, bt_row, kvh, q_pos, ctx, scale_log2,
                                     stride_cb, stride_ct, stride_ch, stride_cd, d, window,
                                     HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_F32, PRECISION, KV_FP8, True)
    else:
        full_end = tl.where(m0 < n, (first_q // BLOCK_N) * BLOCK_N, 0)
        for n0 in range(0, full_end, BLOCK_N):  # keys before every query of the tile
            m, l, acc = _attend_tile(q, m, l, acc, n0, k_ptr, v_ptr, bt_row, kvh, q_pos, ctx, scale_log2,
                                     stride_cb, stride_ct, stride_ch, stride_cd, d, window,
                                     HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, DOT_F32, PRECISION, KV_FP8, False)
        for n0 in range(full_end, kv_end, BLOCK_N):  # the diagonal: causal mask
            m, l, acc = _attend_tile(q, m, l, acc, n0, k_ptr, v_ptr, bt_row, kvh, q_pos, ctx, scale_log2,
                                     stride_cb, stride_ct, stride_ch, stride_cd, d, window,
                                     HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_F32, PRECISION, KV_FP8, False)
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    if KV_FP8:
        o = o * tl.load(v_scale_ptr)
    tl.store(out_ptr + q_off[:, None] * stride_ot + h * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=io_mask)


def _tile_config(dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages); see docs/kernels.md for how these were chosen."""
    if interpreting():
        return 16, 16, 4, 1  # tiny tiles keep the CPU interpreter fast
    if dtype == torch.float32:
        return 64, 32, 4, 2
    return 128, 64, 8, 2


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Triton version of reference.paged_prefill_attention_ref. The caches hold q's dtype, or
    float8 e4m3 values x / scale with per-tensor `k_scale` / `v_scale` ([1] fp32, None = 1.0).
    `sinks` [Hq] and `window` (> 0: sliding): see the module docstring.

    Contract not checked on the host (it would need a sync): cu_seqlens_q is non-decreasing
    from 0 to T, n_i <= context_lens[i] <= block_tables.shape[1] * block_size, block ids valid.
    """
    fn = "paged_prefill_attention"
    k_scale, v_scale, fp8 = check_paged_kv(fn, q, k_cache, v_cache, k_scale, v_scale)
    total, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    check_tensor(fn, "context_lens", context_lens, (None,), (torch.int32,))
    batch = context_lens.shape[0]
    check_tensor(fn, "cu_seqlens_q", cu_seqlens_q, (batch + 1,), (torch.int32,))
    check_tensor(fn, "block_tables", block_tables, (batch, None), (torch.int32,))
    device = check_devices(fn, q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                           cu_seqlens_q=cu_seqlens_q, context_lens=context_lens)
    check_block_tables_and_scale(fn, block_tables, scale)
    check_sinks_window(fn, sinks, window, hq, device)
    out = torch.empty((total, hq, d), dtype=q.dtype, device=device)
    if total == 0 or batch == 0:
        return out

    block_m, block_n, warps, stages = _tile_config(q.dtype)
    _prefill_kernel[(total // block_m + batch, hq)](
        q, k_cache, v_cache, block_tables, cu_seqlens_q.contiguous(), context_lens.contiguous(), out,
        k_scale, v_scale, sinks if sinks is not None else q, scale * math.log2(math.e), batch, window,
        *q.stride(), *k_cache.stride(), block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=hq // hkv, HEAD_DIM=d, D_PAD=triton.next_power_of_2(d), BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_F32=dot_in_f32(q.dtype), PRECISION=dot_precision(q.dtype),
        KV_FP8=fp8, SLIDING=window > 0, HAS_SINKS=sinks is not None, num_warps=warps, num_stages=stages,
        **pdl_args(q.device),
    )
    return out
