"""Write new K/V rows into their paged-cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import FLOAT_DTYPES, INDEX_DTYPES, check_devices, check_same_layout, check_tensor


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])  # a row of a static buffer, or not
def _kv_cache_write_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    block_size,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_ct, stride_ch, stride_cd,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    # One program per new token: all of its heads at once, [H_PAD, D_PAD].
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
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def kv_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton version of reference.kv_cache_write_ref. Slots must lie in the cache or be negative (skip)."""
    fn = "kv_cache_write"
    check_tensor(fn, "k_cache", k_cache, (None, None, None, None), FLOAT_DTYPES)
    _, block_size, hkv, d = k_cache.shape
    check_same_layout(fn, "k_cache", k_cache, "v_cache", v_cache)
    check_tensor(fn, "key", key, (None, hkv, d), FLOAT_DTYPES)
    t = key.shape[0]
    check_tensor(fn, "value", value, (t, hkv, d), FLOAT_DTYPES)
    check_tensor(fn, "slot_mapping", slot_mapping, (t,), INDEX_DTYPES)
    check_devices(fn, key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if t == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    _kv_cache_write_kernel[(t,)](
        key, value, k_cache, v_cache, slot_mapping,
        block_size,
        *key.stride(), *value.stride(), *k_cache.stride(),
        NUM_HEADS=hkv, HEAD_DIM=d,
        H_PAD=triton.next_power_of_2(hkv), D_PAD=triton.next_power_of_2(d),
    )
