"""Rotary embedding and the KV-cache write in one pass: a decode layer's q/k/v epilogue.

After the fused qkv projection, a layer used to launch two kernels: rotary (q and k rotated
into new tensors) and the KV write (k and v copied into their cache slots). Here one program
per token adds the projection's bias (Qwen2's qkv bias: at one token cuBLAS cannot fuse it and
torch launches a separate broadcast copy for it), rotates q and k in fp32, and stores the
rotated q to the output, the rotated k and v straight into the cache. Attention then reads the
new token's K/V from the cache like any other, so the rotated k never exists as a tensor.

Qwen3 normalises every q and k head (RMSNorm over head_dim, its own weight for q and for k)
between the bias and rotary; `qk_norm` fuses that too (two launches a layer fewer). The norm
rounds where the separate RMSNorm kernel does (its input, x * rstd, and the weighted output in
the input's dtype), so only the order of the sum of squares can differ from the unfused path.
Off (a constexpr) for models without it, whose variants compile exactly the code they did.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.kv_cache_write import kv_store_value
from pdserve.kernels.launch import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    KV_DTYPES,
    check_devices,
    check_same_layout,
    check_tensor,
    kv_scales,
)
from pdserve.kernels.pdl import pdl_args, pdl_enter


@triton.jit
def _rotate_heads(src_ptr, stride_h, bias_ptr, norm_w_ptr, eps, cos, sin,
                  HEADS: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                  HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr):
    # -> the rotated first and second halves of every head, fp32 [H_PAD, HALF_PAD] each.
    h = tl.arange(0, H_PAD)[:, None]
    i = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < HEADS) & (i < HALF)
    x1 = tl.load(src_ptr + h * stride_h + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + h * stride_h + HALF + i, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x1 += tl.load(bias_ptr + h * (2 * HALF) + i, mask=mask, other=0.0).to(tl.float32)
        x2 += tl.load(bias_ptr + h * (2 * HALF) + HALF + i, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        # RMSNorm over the head's whole dim (both halves; padding lanes are 0), rounded as the
        # separate kernel rounds: the biased input, x * rstd, and the weighted result in x's dtype.
        dt = src_ptr.dtype.element_ty
        if HAS_BIAS:
            x1, x2 = x1.to(dt).to(tl.float32), x2.to(dt).to(tl.float32)
        rstd = (1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps))[:, None]
        w1 = tl.load(norm_w_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(norm_w_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
        x1 = ((x1 * rstd).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        x2 = ((x2 * rstd).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr"])
def _rotary_kv_write_kernel(
    pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, bias_ptr, cs_ptr, qo_ptr, k_cache_ptr, v_cache_ptr,
    k_scale_ptr, v_scale_ptr,
    block_size,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_qot, stride_qoh,
    stride_cb, stride_ct, stride_ch,
    # Last: the arguments before them keep their offsets, so QK_NORM=False compiles to the SASS it did without them.
    q_norm_ptr, k_norm_ptr, norm_eps,
    HQ: tl.constexpr, HKV: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, KV_FP8: tl.constexpr,
    QK_NORM: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # One program per token; cos/sin are read once for all of its q and k heads.
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF_PAD)[None, :]
    cos = tl.load(cs_ptr + pos * stride_cs + i, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)

    hq = tl.arange(0, HQ_PAD)[:, None]
    q_mask = (hq < HQ) & (i < HALF)
    q1, q2 = _rotate_heads(q_ptr + t * stride_qt, stride_qh, bias_ptr, q_norm_ptr, norm_eps, cos, sin,
                           HQ, HQ_PAD, HALF, HALF_PAD, HAS_BIAS, QK_NORM)
    q_dst = qo_ptr + t * stride_qot + hq * stride_qoh + i
    tl.store(q_dst, q1.to(qo_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_dst + HALF, q2.to(qo_ptr.dtype.element_ty), mask=q_mask)

    # int64: block * block_stride overflows int32 on a large cache. A negative slot (a padding
    # row of a CUDA-graph batch) writes nothing; its q is still rotated (and discarded).
    slot = tl.load(slot_ptr + t).to(tl.int64)
    hk = tl.arange(0, HKV_PAD)[:, None]
    kv_mask = (hk < HKV) & (i < HALF) & (tl.zeros([HKV_PAD, HALF_PAD], tl.int64) + slot >= 0)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_ct + hk * stride_ch + i
    k1, k2 = _rotate_heads(k_ptr + t * stride_kt, stride_kh, bias_ptr + HQ * 2 * HALF, k_norm_ptr, norm_eps,
                           cos, sin, HKV, HKV_PAD, HALF, HALF_PAD, HAS_BIAS, QK_NORM)
    if KV_FP8:  # quantized from k's dtype, as the reference (rotary in k's dtype, then the write) does
        k1, k2 = k1.to(k_ptr.dtype.element_ty), k2.to(k_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + dst, kv_store_value(k1, k_scale_ptr, k_cache_ptr.dtype.element_ty, KV_FP8), mask=kv_mask)
    tl.store(k_cache_ptr + dst + HALF, kv_store_value(k2, k_scale_ptr, k_cache_ptr.dtype.element_ty, KV_FP8),
             mask=kv_mask)
    # v is not rotated: cos = 1, sin = 0 passes both halves through (plus their bias).
    v1, v2 = _rotate_heads(v_ptr + t * stride_vt, stride_vh, bias_ptr + (HQ + HKV) * 2 * HALF, v_ptr, 0.0,
                           1.0, 0.0, HKV, HKV_PAD, HALF, HALF_PAD, HAS_BIAS, False)
    if KV_FP8:
        v1, v2 = v1.to(v_ptr.dtype.element_ty), v2.to(v_ptr.dtype.element_ty)
    tl.store(v_cache_ptr + dst, kv_store_value(v1, v_scale_ptr, v_cache_ptr.dtype.element_ty, KV_FP8), mask=kv_mask)
    tl.store(v_cache_ptr + dst + HALF, kv_store_value(v2, v_scale_ptr, v_cache_ptr.dtype.element_ty, KV_FP8),
             mask=kv_mask)


def check_rotary_inputs(fn: str, q, k, v, positions, slot_mapping, cos_sin_cache, bias, k_cache,
                        cache_dtypes, qk_norm=None) -> dict:
    """The checks every kernel that rotates q/k and writes k/v makes of its inputs (this one and
    the decode attention that fuses it): q [T, Hq, D] (D even), k/v [T, Hkv, D] of q's dtype, one
    position and slot a token, cos_sin_cache [rows, D], k_cache [.., .., Hkv, D] of `cache_dtypes`,
    the optional bias [(Hq + 2 Hkv) D], the optional qk_norm (q weight [D], k weight [D], eps > 0;
    the weights contiguous, of q's dtype: the unfused norm's output dtype is theirs promoted with
    q's, and the fused kernel writes q's). Returns the named tensors (bias, norm weights if given)."""
    check_tensor(fn, "q", q, (None, None, None), FLOAT_DTYPES)
    t, hq, d = q.shape
    if d % 2:
        raise ValueError(f"{fn}: head_dim must be even, got {d}")
    check_tensor(fn, "k", k, (t, None, d), (q.dtype,))
    hkv = k.shape[1]
    check_tensor(fn, "v", v, (t, hkv, d), (q.dtype,))
    check_tensor(fn, "positions", positions, (t,), INDEX_DTYPES)
    check_tensor(fn, "slot_mapping", slot_mapping, (t,), INDEX_DTYPES)
    check_tensor(fn, "cos_sin_cache", cos_sin_cache, (None, d), FLOAT_DTYPES)
    check_tensor(fn, "k_cache", k_cache, (None, None, hkv, d), cache_dtypes)
    tensors = dict(positions=positions, q=q, k=k, v=v, cos_sin_cache=cos_sin_cache, slot_mapping=slot_mapping)
    if bias is not None:
        check_tensor(fn, "bias", bias, ((hq + 2 * hkv) * d,), FLOAT_DTYPES)
        tensors["bias"] = bias
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        for name, w in (("q_norm_weight", q_weight), ("k_norm_weight", k_weight)):
            check_tensor(fn, name, w, (d,), (q.dtype,))
            if not w.is_contiguous():
                raise ValueError(f"{fn}: {name} must be contiguous, got strides {w.stride()}")
            tensors[name] = w
        if not eps > 0:
            raise ValueError(f"{fn}: qk_norm eps must be > 0, got {eps}")
    return tensors


def rotary_kv_write(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    bias: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """Triton version of reference.rotary_kv_write_ref: returns the rotated q (a new tensor) and
    writes the rotated k and v into the cache. Positions must be < cos_sin_cache rows; slots must
    lie in the cache or be negative (skip). An fp8 cache stores k / k_scale, v / v_scale ([1]
    fp32 tensors, None = 1.0). `qk_norm` (q weight, k weight, eps): each q and k head
    RMSNorm-ed after the bias, before rotary (Qwen3)."""
    fn = "rotary_kv_write"
    tensors = check_rotary_inputs(fn, q, k, v, positions, slot_mapping, cos_sin_cache, bias, k_cache, KV_DTYPES,
                                  qk_norm)
    t, hq, d = q.shape
    hkv = k.shape[1]
    check_same_layout(fn, "k_cache", k_cache, "v_cache", v_cache)
    tensors.update(k_cache=k_cache, v_cache=v_cache)
    check_devices(fn, **tensors)
    for name in ("q", "k", "v", "cos_sin_cache", "k_cache", "bias"):
        if name in tensors and tensors[name].stride(-1) != 1:
            raise ValueError(f"{fn}: {name} must be contiguous in its last dimension, "
                             f"got strides {tensors[name].stride()}")
    k_scale, v_scale, fp8 = kv_scales(fn, k_cache, k_scale, v_scale)
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out
    q_weight, k_weight, eps = qk_norm if qk_norm is not None else (q, q, 0.0)
    _rotary_kv_write_kernel[(t,)](
        positions.contiguous(), slot_mapping.contiguous(), q, k, v, bias if bias is not None else q,
        cos_sin_cache, q_out, k_cache, v_cache, k_scale, v_scale,
        k_cache.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        q_out.stride(0), q_out.stride(1), *k_cache.stride()[:3], q_weight, k_weight, float(eps),
        HQ=hq, HKV=hkv, HQ_PAD=triton.next_power_of_2(hq), HKV_PAD=triton.next_power_of_2(hkv),
        HALF=d // 2, HALF_PAD=triton.next_power_of_2(d // 2), HAS_BIAS=bias is not None, KV_FP8=fp8,
        QK_NORM=qk_norm is not None,
        **pdl_args(q.device),
    )
    return q_out
