"""Write new K/V rows into their paged-cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import (
    FLOAT_DTYPES,
    FP8_E4M3_MAX,
    INDEX_DTYPES,
    KV_DTYPES,
    check_devices,
    check_same_layout,
    check_tensor,
    kv_scales,
)
from pdserve.kernels.pdl import pdl_args, pdl_enter


FP8_MAX = tl.constexpr(FP8_E4M3_MAX)  # a plain annotated global compiles under the interpreter only


@triton.jit
def kv_store_value(x, scale_ptr, dst_ty, KV_FP8: tl.constexpr):
    """x as the cache stores it: cast, or (fp8) x / scale in fp32, saturated to e4m3's range,
    rounded to nearest even (reference.quantize_kv's steps)."""
    if KV_FP8:
        y = x.to(tl.float32) / tl.load(scale_ptr)
        y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
        return _round_to_e4m3(y).to(dst_ty)
    return x.to(dst_ty)


@triton.jit
def _round_to_e4m3(y):
    # fp32 y rounded to nearest even on e4m3's grid (3 mantissa bits; subnormal step 2^-9), so
    # the cast after it is exact. The GPU's cvt rounds the same way by itself, but Triton's CPU
    # interpreter drops the carry when rounding up crosses a power of two (15.9 -> 8, not 16),
    # and the tests run there: one rounding, done here, is the same on both. Adding and taking
    # away 1.5 * 2^23 * step rounds to a multiple of step in fp32's own nearest-even mode.
    # The sign is put back by bit afterwards, so tiny negatives (and -0) keep it, as torch's cast does.
    bits = y.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF  # biased exponent of |y|
    step_exp = tl.maximum(exp - 127 - 3, -9)
    magic = (((step_exp + 23 + 127) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
    r = (tl.abs(y) + magic) - magic
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)



@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])  # a row of a static buffer, or not
def _kv_cache_write_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    block_size,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_ct, stride_ch, stride_cd,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
    KV_FP8: tl.constexpr,
    PDL: tl.constexpr = False,
):
    # One program per new token: all of its heads at once, [H_PAD, D_PAD].
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)  # int64: block * block_stride overflows int32
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    # A negative slot (padding token) masks the whole row off.
    mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM) & (tl.zeros([H_PAD, D_PAD], tl.int64) + slot >= 0)
    dst = blk * stride_cb + off * stride_ct + h[:, None] * stride_ch + d[None, :] * stride_cd
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask)
    tl.store(k_cache_ptr + dst, kv_store_value(k, k_scale_ptr, k_cache_ptr.dtype.element_ty, KV_FP8), mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask)
    tl.store(v_cache_ptr + dst, kv_store_value(v, v_scale_ptr, v_cache_ptr.dtype.element_ty, KV_FP8), mask=mask)


def kv_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Triton version of reference.kv_cache_write_ref. Slots must lie in the cache or be negative
    (skip). An fp8 cache stores x / k_scale (v_scale), [1] fp32 tensors (None = 1.0)."""
    fn = "kv_cache_write"
    check_tensor(fn, "k_cache", k_cache, (None, None, None, None), KV_DTYPES)
    _, block_size, hkv, d = k_cache.shape
    check_same_layout(fn, "k_cache", k_cache, "v_cache", v_cache)
    check_tensor(fn, "key", key, (None, hkv, d), FLOAT_DTYPES)
    t = key.shape[0]
    check_tensor(fn, "value", value, (t, hkv, d), FLOAT_DTYPES)
    check_tensor(fn, "slot_mapping", slot_mapping, (t,), INDEX_DTYPES)
    check_devices(fn, key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    k_scale, v_scale, fp8 = kv_scales(fn, k_cache, k_scale, v_scale)
    if t == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    _kv_cache_write_kernel[(t,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        block_size,
        *key.stride(), *value.stride(), *k_cache.stride(),
        NUM_HEADS=hkv, HEAD_DIM=d,
        H_PAD=triton.next_power_of_2(hkv), D_PAD=triton.next_power_of_2(d), KV_FP8=fp8,
        **pdl_args(key.device),
    )
