"""Decode attention of multi-head latent attention (DeepSeek-V2/V3) in the latent space: the
Triton twin of reference.mla_decode_ref.

Each sequence has one query token; every head's query arrives absorbed (q_nope times the key
up-projection: R values) beside its roped part (P values), and the cache holds one latent per
token ([latent R | rope key P], attention/kv_spec.py) shared by all heads. So this is multi-query
attention with key = the whole cached row and value = its first R values: a program takes a
block of heads of one sequence and reads each cached row once for all of them (the bytes are
R + P per token, not per head), which is why the heads, not the KV heads, are the tile's rows.

An fp8 cache (--kv-cache-dtype fp8) holds latent / kv_scale as e4m3: tiles are widened to the
query's dtype for the dots (exact: e4m3 fits in bf16/fp16/fp32), and since the latent is both key
and value, its one scale multiplies the scores and the output, not every element.

Split-K as paged_decode_attention: the grid is (sequence, head block, split); a split covers
1/S of that sequence's tiles (boundaries from its context length, read on the device: no host
sync, the grid depends on shapes only); the partial outputs and their log-sum-exps (log2 units)
are merged by a second small kernel. The value up-projection is the caller's (a GEMM over [B, H, R]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import (
    FLOAT_DTYPES,
    cache_dtypes,
    check_devices,
    check_tensor,
    dot_in_f32,
    dot_precision,
    kv_scales,
    num_sms,
)
from pdserve.kernels.pdl import pdl_args, pdl_enter


MAX_SPLITS = 64
_LOG2E = tl.constexpr(1.4426950408889634)


@dataclass(frozen=True)
class MlaDecodeConfig:
    """The decode kernel's tile: heads per program (the dots' M: every head block re-reads the
    latent rows, so wider blocks read the cache fewer times), cached tokens per step (the dots'
    N), and the launch's warps and pipeline stages."""

    block_h: int = 64
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2


def mla_decode_config(heads: int) -> MlaDecodeConfig:
    """The default tile for `heads` query heads: DeepSeek-V3's 128 take two blocks of 64 (the cache
    read twice, not eight times as with blocks of 16); fewer heads one block (>= 16: a dot's M)."""
    block_h = min(64, max(16, triton.next_power_of_2(heads)))
    return MlaDecodeConfig(block_h=block_h, num_warps=8 if block_h >= 64 else 4)


@triton.jit(do_not_specialize=["num_splits", "stride_btb"])
def _mla_decode_kernel(q_ptr, qpe_ptr, cache_ptr, bt_ptr, ctx_ptr, o_ptr, lse_ptr, kv_scale_ptr, num_heads, scale,
                       num_splits,
                       stride_qb, stride_qh, stride_pb, stride_ph, stride_cblk, stride_ctok, stride_btb,
                       stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                       R: tl.constexpr, P: tl.constexpr, R_PAD: tl.constexpr, P_PAD: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       DOT_F32: tl.constexpr, PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
                       FINAL: tl.constexpr, PDL: tl.constexpr = False):
    # Grid (head blocks, sequences, splits): a sequence's head blocks are neighbours in launch
    # order, so the second one's latent rows come from L2. FINAL (one split): the output is
    # written in its own dtype, no log-sum-exp, no merge.
    pdl_enter(PDL)
    hb, b, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < num_heads
    r, p = tl.arange(0, R_PAD), tl.arange(0, P_PAD)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + r[None, :],
                mask=hmask[:, None] & (r[None, :] < R), other=0.0)
    qpe = tl.load(qpe_ptr + b * stride_pb + heads[:, None] * stride_ph + p[None, :],
                  mask=hmask[:, None] & (p[None, :] < P), other=0.0)
    if DOT_F32:
        q, qpe = q.to(tl.float32), qpe.to(tl.float32)
    ctx = tl.load(ctx_ptr + b)
    per = tl.cdiv(tl.cdiv(ctx, BLOCK_N), num_splits) * BLOCK_N
    start = s * per
    end = tl.minimum(start + per, ctx)
    qk_scale = scale * _LOG2E
    if KV_FP8:
        qk_scale = qk_scale * tl.load(kv_scale_ptr)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R_PAD], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        tmask = toks < end
        blk = tl.load(bt_ptr + b * stride_btb + toks // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
        row = blk * stride_cblk + (toks % BLOCK_SIZE) * stride_ctok
        kv = tl.load(cache_ptr + row[:, None] + r[None, :], mask=tmask[:, None] & (r[None, :] < R), other=0.0)
        pe = tl.load(cache_ptr + row[:, None] + R + p[None, :], mask=tmask[:, None] & (p[None, :] < P), other=0.0)
        if DOT_F32:
            kv, pe = kv.to(tl.float32), pe.to(tl.float32)
        elif KV_FP8:
            kv, pe = kv.to(q.dtype), pe.to(q.dtype)
        sc = tl.dot(q, tl.trans(kv), input_precision=PRECISION) + tl.dot(qpe, tl.trans(pe), input_precision=PRECISION)
        sc = tl.where(tmask[None, :], sc * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        pr = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        acc = acc * alpha[:, None] + tl.dot(pr.to(kv.dtype), kv, input_precision=PRECISION)
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if KV_FP8:
        out = out * tl.load(kv_scale_ptr)
    o_rows = o_ptr + b * stride_ob + heads[:, None] * stride_oh + s * stride_os + r[None, :]
    tl.store(o_rows, out.to(o_ptr.dtype.element_ty), mask=hmask[:, None] & (r[None, :] < R))
    if not FINAL:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + s, lse, mask=hmask)


@triton.jit
def _mla_merge_kernel(parts_ptr, lse_ptr, out_ptr, num_splits, stride_pb, stride_ph, stride_ps, stride_lb,
                      stride_lh, stride_ob, stride_oh, R: tl.constexpr, S_PAD: tl.constexpr,
                      BLOCK_R: tl.constexpr, PDL: tl.constexpr = False):
    # Grid (sequences, heads, cdiv(R, BLOCK_R)): the splits' partial outputs weighted by their
    # share of the softmax (2^(lse - max); an empty split's lse is -inf: weight 0), in one pass.
    pdl_enter(PDL)
    b, h = tl.program_id(0), tl.program_id(1)
    r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    s = tl.arange(0, S_PAD)
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + s, mask=s < num_splits, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # a context holds >= 1 token: some split is not empty
    parts = tl.load(parts_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + r[None, :],
                    mask=(s[:, None] < num_splits) & (r[None, :] < R), other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + r, out.to(out_ptr.dtype.element_ty), mask=r < R)


def mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, scale: float, num_splits: int | None = None,
               kv_scale: torch.Tensor | None = None, config: MlaDecodeConfig | None = None) -> torch.Tensor:
    """reference.mla_decode_ref's function: q_latent [B, H, R], q_pe [B, H, P], cache
    [num_blocks, block_size, 1, R + P] (a strided per-layer view) of q's dtype or fp8 (then
    `kv_scale`: [1] fp32, None = 1.0), block_tables [B, max_blocks], context_lens [B] (>= 1 each)
    -> [B, H, R] in q_latent's dtype. `num_splits`: splits of each context (default: enough
    programs to fill the device, from shapes only). `config`: the tile (mla_decode_config's)."""
    fn = "mla_decode"
    b, h, r = q_latent.shape
    p = q_pe.shape[-1]
    check_tensor(fn, "q_latent", q_latent, (None, None, None), FLOAT_DTYPES)
    check_tensor(fn, "q_pe", q_pe, (b, h, p), (q_latent.dtype,))
    check_tensor(fn, "cache", cache, (None, None, 1, r + p), cache_dtypes(q_latent.dtype))
    check_tensor(fn, "block_tables", block_tables, (b, None), (torch.int32, torch.int64))
    check_tensor(fn, "context_lens", context_lens, (b,), (torch.int32, torch.int64))
    check_devices(fn, q_latent=q_latent, q_pe=q_pe, cache=cache, block_tables=block_tables,
                  context_lens=context_lens)
    if q_latent.stride(-1) != 1 or q_pe.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError(f"{fn}: q_latent, q_pe and cache need a contiguous last dimension")
    kv_scale, _, fp8 = kv_scales(fn, cache, kv_scale, None)
    config = config or mla_decode_config(h)
    head_blocks = triton.cdiv(h, config.block_h)
    if num_splits is None:
        num_splits = max(1, min(MAX_SPLITS, triton.cdiv(num_sms(q_latent.device), b * head_blocks)))
    out = torch.empty(b, h, r, dtype=q_latent.dtype, device=q_latent.device)
    final = num_splits == 1
    parts = out.unsqueeze(2) if final else torch.empty(b, h, num_splits, r, dtype=torch.float32, device=out.device)
    lse = parts if final else torch.empty(b, h, num_splits, dtype=torch.float32, device=out.device)
    _mla_decode_kernel[(head_blocks, b, num_splits)](
        q_latent, q_pe, cache, block_tables, context_lens, parts, lse, kv_scale, h, scale, num_splits,
        q_latent.stride(0), q_latent.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(0), cache.stride(1),
        block_tables.stride(0), parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0), lse.stride(1),
        R=r, P=p, R_PAD=max(16, triton.next_power_of_2(r)), P_PAD=max(16, triton.next_power_of_2(p)),
        BLOCK_H=config.block_h, BLOCK_N=config.block_n, BLOCK_SIZE=cache.shape[1],
        DOT_F32=dot_in_f32(q_latent.dtype), PRECISION=dot_precision(q_latent.dtype), KV_FP8=fp8, FINAL=final,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_args(q_latent.device))
    if not final:
        block_r = min(128, triton.next_power_of_2(r))
        _mla_merge_kernel[(b, h, triton.cdiv(r, block_r))](
            parts, lse, out, num_splits, parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0),
            lse.stride(1), out.stride(0), out.stride(1), R=r, S_PAD=triton.next_power_of_2(num_splits),
            BLOCK_R=block_r, **pdl_args(parts.device))
    return out
