"""Decode attention: one query token per sequence against its paged KV context.

The Triton path is split-K ("flash-decoding"): phase 1 gives each (sequence, KV head, split)
one program that attends all query heads of that KV head's group to 1/S of the context, so K/V
are read once per group and a batch of one still fills the GPU; phase 2 merges the S partial
results with their log-sum-exps. Split boundaries follow each sequence's own context length
(read on the device), so the grid depends only on shapes: no host sync, CUDA-graph safe.

Phase 2 runs inside phase 1 when the caller lends a `semaphores` buffer (int32, zeros, at least
B * Hkv): each split program stores its partial result, then counts itself in with an atomic
add on its (sequence, KV head) counter; the program that arrives last merges the S partials of
the group and resets the counter to zero for the next launch. One launch per layer instead of
two, which is what a batch-1 decode step (launch-bound) pays for. Without the buffer a second
kernel reduces.

Specialization: Triton compiles a variant per distinct key (integer arguments equal to 1 or
divisible by 16, pointer alignment, constexprs). Everything that varies per step (the split
count, the block-table width and stride, the table/length pointers) is kept out of the key, so
the variants are exactly {split, unsplit} x {fused reduce or not}: a live server compiles them
at start-up, never mid-traffic (tests/kernels/test_specialization.py).

Sinks and sliding windows (gpt-oss), both optional and off by default; constexpr switches, so
models without them compile exactly the code they did before:
- `sinks` [Hq]: one learned logit per query head joins the softmax's denominator with a zero
  value row. Unsplit, it seeds the running max and sum (m = sink, l = 1); split, the partials
  leave it out and the merge adds it as one more partial with lse = sink and output zero.
- `window` > 0: the query (position ctx - 1) attends to positions >= ctx - window only, as
  transformers masks them (keys > query - window). The splits divide [max(ctx - window, 0), ctx)
  instead of [0, ctx), so a long context costs a window's worth of tiles.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pdserve.kernels.arrivals import last_arrival, reset_arrivals
from pdserve.kernels.kv_cache_write import kv_store_value
from pdserve.kernels.launch import (
    cache_dtypes,
    check_block_tables_and_scale,
    check_devices,
    check_paged_kv,
    check_sinks_window,
    check_tensor,
    dot_in_f32,
    dot_precision,
    interpreting,
    num_sms,
)
from pdserve.kernels.pdl import pdl_args, pdl_enter
from pdserve.kernels.rotary_kv_write import check_rotary_inputs

MAX_SPLITS = 64

# Attention sinks are natural-log logits; the kernels work in log2 units. A constexpr: a jitted
# function may read no other kind of global.
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _rotated(ptr, rows, row_stride, row_mask, bias_ptr, norm_w_ptr, eps, d, partner, cos, sin_signed,
             HEAD_DIM: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, ROTATE: tl.constexpr):
    # [R, D_PAD] fp32: rows of one token (+ their bias, RMSNorm-ed if HAS_NORM), rotate-half
    # applied on the full width: element d pairs with d +- D/2, so out = x * cos + x[partner] * (-sin | +sin).
    mask = row_mask[:, None] & (d[None, :] < HEAD_DIM)
    x = tl.load(ptr + rows[:, None] * row_stride + d[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(bias_ptr + rows[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0).to(tl.float32)
    if ROTATE:
        xp = tl.load(ptr + rows[:, None] * row_stride + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            xp += tl.load(bias_ptr + rows[:, None] * HEAD_DIM + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            # Qwen3's per-head RMSNorm before rotary, rounded where the separate kernel rounds
            # (rotary_kv_write's _rotate_heads): the biased input, x * rstd, the weighted result.
            # The partner lanes are the same row's, so one rstd serves both.
            dt = ptr.dtype.element_ty
            if HAS_BIAS:
                x, xp = x.to(dt).to(tl.float32), xp.to(dt).to(tl.float32)
            rstd = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps))[:, None]
            w = tl.load(norm_w_ptr + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
            wp = tl.load(norm_w_ptr + partner, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
            x = ((x * rstd).to(dt).to(tl.float32) * w[None, :]).to(dt).to(tl.float32)
            xp = ((xp * rstd).to(dt).to(tl.float32) * wp[None, :]).to(dt).to(tl.float32)
        x = x * cos[None, :] + xp * sin_signed[None, :]
    return x


@triton.jit(do_not_specialize=["num_splits", "stride_btb", "window"],
            do_not_specialize_on_alignment=["bt_ptr", "ctx_ptr", "sem_ptr", "pos_ptr", "slot_ptr", "sinks_ptr"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr, part_out_ptr, part_lse_ptr, sem_ptr,
    pos_ptr, slot_ptr, k_new_ptr, v_new_ptr, bias_ptr, cs_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr,
    scale_log2, num_splits, window,
    stride_qb, stride_qh, stride_qd,
    stride_cb, stride_ct, stride_ch, stride_cd,
    stride_btb, stride_ob, stride_oh,
    stride_knb, stride_knh, stride_vnb, stride_vnh, stride_cs,
    # Last: the arguments before them keep their offsets, so QK_NORM=False compiles to the SASS it did without them.
    q_norm_ptr, k_norm_ptr, norm_eps,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, FUSED_REDUCE: tl.constexpr,
    ROTARY: tl.constexpr, HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, KV_FP8: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr, SLIDING: tl.constexpr, HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    if SLIDING:  # the splits share the window's positions [ctx - span, ctx)
        span = tl.minimum(ctx, window)
        split_len = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
        start = ctx - span + s * split_len
    else:
        span = ctx
        split_len = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
        start = s * split_len
    end = tl.minimum(start + split_len, ctx)

    # Query rows are the GROUP heads sharing this KV head, padded to >= 16 rows for tl.dot.
    rows = tl.arange(0, GROUP_PAD)
    heads = kvh * GROUP + rows
    d = tl.arange(0, D_PAD)
    q_mask = (rows[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    if ROTARY:
        # q/k/v come straight from the projection: add the bias, RMSNorm q and k (QK_NORM), rotate
        # q (rounded to q's dtype, as the separate rotary kernel's output is), and let the split
        # that holds the new token write its rotated k and v into the cache before any of its
        # tiles reads them.
        half = HEAD_DIM // 2
        lo = d < half
        partner = tl.where(lo, d + half, d - half)
        freq = tl.where(lo, d, d - half)
        pos = tl.load(pos_ptr + b).to(tl.int64)
        cos = tl.load(cs_ptr + pos * stride_cs + freq, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        sin = tl.load(cs_ptr + pos * stride_cs + half + freq, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        sin = tl.where(lo, -sin, sin)
        q = _rotated(q_ptr + b * stride_qb, heads, stride_qh, rows < GROUP, bias_ptr, q_norm_ptr, norm_eps, d,
                     partner, cos, sin, HEAD_DIM, HAS_BIAS, QK_NORM, True).to(q_ptr.dtype.element_ty)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        if (ctx - 1 >= start) & (ctx - 1 < end) & (slot >= 0):
            hq_total = tl.num_programs(1) * GROUP
            # The KV head's one row, in row 0 of a [GROUP_PAD, D_PAD] tile (no size-1 tensors).
            first = rows < 1
            dst = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + kvh * stride_ch
                   + rows[:, None] * 0 + d[None, :] * stride_cd)
            kv_mask = first[:, None] & (d[None, :] < HEAD_DIM)
            k_new = _rotated(k_new_ptr + b * stride_knb + kvh * stride_knh, rows, 0, first,
                             bias_ptr + (hq_total + kvh) * HEAD_DIM, k_norm_ptr, norm_eps, d, partner, cos, sin,
                             HEAD_DIM, HAS_BIAS, QK_NORM, True)
            if KV_FP8:  # quantized from k's dtype, as the reference's rotary output is
                k_new = k_new.to(k_new_ptr.dtype.element_ty)
            tl.store(k_ptr + dst, kv_store_value(k_new, k_scale_ptr, k_ptr.dtype.element_ty, KV_FP8), mask=kv_mask)
            v_new = _rotated(v_new_ptr + b * stride_vnb + kvh * stride_vnh, rows, 0, first,
                             bias_ptr + (hq_total + tl.num_programs(1) + kvh) * HEAD_DIM, v_new_ptr, 0.0, d,
                             partner, cos, sin, HEAD_DIM, HAS_BIAS, False, False)
            if KV_FP8:
                v_new = v_new.to(v_new_ptr.dtype.element_ty)
            tl.store(v_ptr + dst, kv_store_value(v_new, v_scale_ptr, v_ptr.dtype.element_ty, KV_FP8), mask=kv_mask)
        tl.debug_barrier()  # every thread's cache stores before any thread's tile loads
    else:
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd, mask=q_mask,
                    other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    if KV_FP8:
        # fp8 tiles are widened to q's type for the dot (exact: e4m3 fits in bf16/fp16/fp32);
        # the per-tensor scales multiply the scores (K) and the output (V), not every element.
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max, log2 units
    l = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2
    if HAS_SINKS:
        if not SPLIT:  # the sink as a first key with a zero value row (split: the merge adds it)
            m = tl.load(sinks_ptr + heads, mask=rows < GROUP, other=0.0).to(tl.float32) * _LOG2E
            l = l + 1.0
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        t_mask = toks < end
        # Any block size works: each token finds its block through the table (int64 offsets:
        # block * block_stride exceeds int32 on a large cache).
        blk = tl.load(bt_ptr + b * stride_btb + toks // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        off = blk * stride_cb + (toks % BLOCK_SIZE) * stride_ct + kvh * stride_ch
        kv_mask = t_mask[:, None] & (d[None, :] < HEAD_DIM)
        k = tl.load(k_ptr + off[:, None] + d[None, :] * stride_cd, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + off[:, None] + d[None, :] * stride_cd, mask=kv_mask, other=0.0)
        if DOT_F32 or KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [GROUP_PAD, BLOCK_N]
        qk = tl.where(t_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    # An empty split (short context) has l == 0 and acc == 0: store zeros, lse = -inf.
    l_safe = tl.where(l > 0, l, 1.0)
    o = acc / l_safe[:, None]
    if KV_FP8:
        o = o * tl.load(v_scale_ptr)
    if SPLIT:
        part = (b * tl.num_programs(1) * GROUP + heads) * num_splits + s  # [B, Hq, S] row index
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], o, mask=q_mask)
        lse = tl.where(l > 0, m + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=rows < GROUP)
        if FUSED_REDUCE:
            # The (sequence, KV head)'s last arrival sees all S partials (kernels/arrivals.py).
            group = b * tl.num_programs(1) + kvh
            if last_arrival(sem_ptr, group, num_splits):
                _merge_splits(
                    part_out_ptr,
                    part_lse_ptr,
                    out_ptr,
                    (b * tl.num_programs(1) * GROUP + heads) * num_splits,
                    tl.cdiv(span, split_len),
                    b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                    q_mask,
                    rows < GROUP,
                    sinks_ptr,
                    heads,
                    GROUP_PAD,
                    HEAD_DIM,
                    D_PAD,
                    HAS_SINKS,
                )
                reset_arrivals(sem_ptr, group)
    else:
        dst = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, first_row, num_used, out_off, out_mask, row_mask,
                  sinks_ptr, heads, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                  HAS_SINKS: tl.constexpr):
    # out = sum_s w_s * o_s / sum_s w_s, w_s = 2^(lse_s - max lse), over ROWS heads whose
    # partials start at rows `first_row` of [B * Hq * S]; one pass with a running max.
    # Only the first `num_used` splits hold tokens: the split count is sized for the longest
    # context a table can hold, so a short one leaves most splits empty (w_s = 0), and each
    # iteration is a dependent global load (~0.5 us): merging 2 of 16 splits, not all 16, took
    # the bs=1 decode attention launch from ~9 to ~3 us at context 128 (docs/performance.md).
    # Loads bypass L1 (.cg): other programs wrote these partials during this launch.
    # Sinks: one more partial with lse = sink and output zero, merged first (m = sink, w_sum = 1).
    d = tl.arange(0, D_PAD)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    w_sum = tl.zeros([ROWS], tl.float32)
    if HAS_SINKS:
        m = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0).to(tl.float32) * _LOG2E
        w_sum = w_sum + 1.0
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    for s in range(0, num_used):
        lse = tl.load(part_lse_ptr + first_row + s, mask=row_mask, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(part_out_ptr + (first_row + s)[:, None] * HEAD_DIM + d[None, :],
                    mask=row_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet: no NaN
        alpha = tl.exp2(m - m_ref)
        w = tl.exp2(lse - m_ref)
        acc = acc * alpha[:, None] + o * w[:, None]
        w_sum = w_sum * alpha + w
        m = m_new
    res = acc / tl.where(w_sum > 0, w_sum, 1.0)[:, None]
    tl.store(out_ptr + out_off, res.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit(do_not_specialize=["num_splits", "window"], do_not_specialize_on_alignment=["ctx_ptr", "sinks_ptr"])
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, ctx_ptr, sinks_ptr, num_splits, window, stride_ob, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, SLIDING: tl.constexpr, HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # Grid (B, Hkv): the same merge the fused path runs in its last-arriving program.
    pdl_enter(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    if SLIDING:
        span = tl.minimum(ctx, window)
    else:
        span = ctx
    split_len = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N  # as the split kernel's
    rows = tl.arange(0, GROUP_PAD)
    heads = kvh * GROUP + rows
    d = tl.arange(0, D_PAD)
    _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, (b * tl.num_programs(1) * GROUP + heads) * num_splits,
                  tl.cdiv(span, split_len), b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                  (rows[:, None] < GROUP) & (d[None, :] < HEAD_DIM), rows < GROUP, sinks_ptr, heads,
                  GROUP_PAD, HEAD_DIM, D_PAD, HAS_SINKS)


def _tile_config() -> tuple[int, int, int]:
    """(BLOCK_N tokens per KV tile, num_warps, num_stages); see docs/kernels.md."""
    if interpreting():
        return 16, 4, 1  # tiny tiles keep the CPU interpreter fast
    return 64, 4, 2


def _choose_splits(batch: int, hkv: int, capacity: int, block_n: int, device: torch.device) -> int:
    # Enough programs for ~2 waves over the SMs, but no split shorter than two KV tiles.
    want = triton.cdiv(2 * num_sms(device), batch * hkv)
    useful = triton.cdiv(capacity, 2 * block_n)
    return max(1, min(want, useful, MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    semaphores: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Triton version of reference.paged_decode_attention_ref.

    The caches hold q's dtype, or float8 e4m3 with per-tensor `k_scale` / `v_scale` ([1] fp32
    tensors, None = 1.0): the values are x / scale, dequantized in the kernel.

    Contract not checked on the host (it would need a sync): 1 <= context_lens[i] <=
    block_tables.shape[1] * block_size, and every used block id is < num_blocks.
    `num_splits` overrides the split-K heuristic (tests use it to force both paths).
    `semaphores`: int32 zeros, >= B * Hkv elements, lent to fuse the split merge into the one
    launch (see the module docstring); the kernel leaves them zero again. Launches that share
    a buffer must be ordered (one stream), as a model's layers are.
    `sinks` [Hq] (any float type, contiguous) and `window` (> 0: sliding): see the module docstring.
    """
    return _launch("paged_decode_attention", q, k_cache, v_cache, block_tables, context_lens, scale,
                   num_splits, semaphores, None, k_scale, v_scale, sinks, window)


def paged_decode_attention_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    semaphores: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    window: int = 0,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Triton version of reference.paged_decode_attention_rotary_ref: a decode layer's whole
    attention in one launch. q [B, Hq, D], k/v [B, Hkv, D] straight from the qkv projection
    (bias not added, not rotated); the bias is added, q and k RMSNorm-ed per head if `qk_norm`
    (q weight [D], k weight [D], eps; Qwen3), rotated at `positions`, k and v written at
    `slot_mapping` (< 0: not written), then attention as paged_decode_attention.
    Same contract, plus: positions[i] < cos_sin_cache rows, and the new token is the last of
    its context (positions[i] == context_lens[i] - 1, as for every decode token)."""
    fn = "paged_decode_attention_rotary"
    tensors = check_rotary_inputs(fn, q, k, v, positions, slot_mapping, cos_sin_cache, bias, k_cache,
                                  cache_dtypes(q.dtype), qk_norm)
    check_devices(fn, **tensors)
    for name, t in tensors.items():
        if t.dim() > 1 and t.stride(-1) != 1 or name == "bias" and not t.is_contiguous():
            raise ValueError(f"{fn}: {name} must be contiguous in its last dimension, got strides {t.stride()}")
    rotary = (positions.contiguous(), slot_mapping.contiguous(), k, v, bias, cos_sin_cache, qk_norm)
    return _launch(fn, q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, semaphores, rotary,
                   k_scale, v_scale, sinks, window)


def _launch(fn, q, k_cache, v_cache, block_tables, context_lens, scale, num_splits, semaphores, rotary,
            k_scale=None, v_scale=None, sinks=None, window=0):
    k_scale, v_scale, fp8 = check_paged_kv(fn, q, k_cache, v_cache, k_scale, v_scale)
    batch, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    check_tensor(fn, "block_tables", block_tables, (batch, None), (torch.int32,))
    check_tensor(fn, "context_lens", context_lens, (batch,), (torch.int32,))
    device = check_devices(fn, q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                           context_lens=context_lens)
    check_block_tables_and_scale(fn, block_tables, scale)
    if num_splits is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"{fn}: num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if semaphores is not None:
        check_tensor(fn, "semaphores", semaphores, (None,), (torch.int32,))
        check_devices(fn, q=q, semaphores=semaphores)
        if semaphores.numel() < batch * hkv or not semaphores.is_contiguous():
            raise ValueError(f"{fn}: semaphores must be contiguous with >= batch * kv_heads = {batch * hkv} "
                             f"elements, got {semaphores.numel()}")
    check_sinks_window(fn, sinks, window, hq, device)
    out = torch.empty((batch, hq, d), dtype=q.dtype, device=device)
    if batch == 0:
        return out

    block_n, warps, stages = _tile_config()
    if num_splits is None:
        capacity = block_tables.shape[1] * block_size
        num_splits = _choose_splits(batch, hkv, min(capacity, window) if window else capacity, block_n, device)
    group = hq // hkv
    d_pad = triton.next_power_of_2(d)
    if num_splits > 1:
        part_out = torch.empty((batch, hq, num_splits, d), dtype=torch.float32, device=device)
        part_lse = torch.empty((batch, hq, num_splits), dtype=torch.float32, device=device)
    else:
        part_out = part_lse = out  # unused
    split = num_splits > 1
    fused = split and semaphores is not None
    group_pad = max(16, triton.next_power_of_2(group))
    if rotary is not None:
        positions, slots, k_new, v_new, bias, cs, qk_norm = rotary
        rotary_args = (positions, slots, k_new, v_new, bias if bias is not None else q, cs)
        rotary_strides = (k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), cs.stride(0))
    else:  # unused pointers and strides: any valid values
        rotary_args, rotary_strides, qk_norm = (context_lens, context_lens, q, q, q, q), (0, 0, 0, 0, 0), None
    q_weight, k_weight, norm_eps = qk_norm if qk_norm is not None else (q, q, 0.0)
    _decode_split_kernel[(batch, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse,
        semaphores if fused else context_lens, *rotary_args, k_scale, v_scale,
        sinks if sinks is not None else q, scale * math.log2(math.e), num_splits, window,
        *q.stride(), *k_cache.stride(), block_tables.stride(0), out.stride(0), out.stride(1), *rotary_strides,
        q_weight, k_weight, float(norm_eps),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=d, D_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLIT=split, FUSED_REDUCE=fused,
        ROTARY=rotary is not None, HAS_BIAS=rotary is not None and rotary[4] is not None,
        QK_NORM=qk_norm is not None, KV_FP8=fp8,
        DOT_F32=dot_in_f32(q.dtype), PRECISION=dot_precision(q.dtype),
        SLIDING=window > 0, HAS_SINKS=sinks is not None,
        num_warps=warps, num_stages=stages,
        **pdl_args(q.device),
    )
    if split and not fused:
        _decode_reduce_kernel[(batch, hkv)](
            part_out, part_lse, out, context_lens, sinks if sinks is not None else q, num_splits, window,
            out.stride(0), out.stride(1),
            GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=d, D_PAD=d_pad, BLOCK_N=block_n,
            SLIDING=window > 0, HAS_SINKS=sinks is not None,
            **pdl_args(part_out.device),
        )
    return out
