"""Write new tokens' latents (multi-head latent attention, DeepSeek-V2/V3) into their paged-cache
slots: the Triton twin of reference.mla_cache_write_ref.

A latent cache holds one row [latent R | rope key P] per token and layer (worker/attention/kv_spec.py),
so a program copies one row; an fp8 cache stores row / kv_scale rounded as kv_cache_write rounds
K and V (kv_store_value), bit for bit the reference's. Negative slots (padding rows of a CUDA
graph's batch) are skipped by a mask, not by selecting rows on the host: no sync, no shape that
depends on values, so a decode step that writes through it can be captured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.kv_cache_write import kv_store_value
from pdserve.kernels.launch import FLOAT_DTYPES, INDEX_DTYPES, KV_DTYPES, check_devices, check_tensor, kv_scales
from pdserve.kernels.pdl import pdl_args, pdl_enter


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])  # a row of a static buffer, or not
def _mla_cache_write_kernel(latent_ptr, cache_ptr, slot_ptr, scale_ptr, block_size, stride_lt, stride_cb, stride_ct,
                            WIDTH: tl.constexpr, W_PAD: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)  # int64: block * block stride overflows int32
    d = tl.arange(0, W_PAD)
    mask = (d < WIDTH) & (tl.zeros([W_PAD], tl.int64) + slot >= 0)
    x = tl.load(latent_ptr + t * stride_lt + d, mask=mask)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_ct + d
    tl.store(cache_ptr + dst, kv_store_value(x, scale_ptr, cache_ptr.dtype.element_ty, KV_FP8), mask=mask)


def mla_cache_write(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                    kv_scale: torch.Tensor | None = None) -> None:
    """latent [T, R + P] into cache [num_blocks, block_size, 1, R + P] (a strided per-layer view)
    at slot_mapping [T] (block * block_size + offset; negative = skip). Slots must lie in the
    cache. An fp8 cache stores latent / kv_scale ([1] fp32, None = 1.0)."""
    fn = "mla_cache_write"
    check_tensor(fn, "cache", cache, (None, None, 1, None), KV_DTYPES)
    width = cache.shape[-1]
    check_tensor(fn, "latent", latent, (None, width), FLOAT_DTYPES)
    check_tensor(fn, "slot_mapping", slot_mapping, (latent.shape[0],), INDEX_DTYPES)
    check_devices(fn, latent=latent, cache=cache, slot_mapping=slot_mapping)
    if latent.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError(f"{fn}: latent and cache need a contiguous last dimension")
    kv_scale, _, fp8 = kv_scales(fn, cache, kv_scale, None)
    if latent.shape[0] == 0:
        return
    _mla_cache_write_kernel[(latent.shape[0],)](
        latent, cache, slot_mapping.contiguous(), kv_scale, cache.shape[1], latent.stride(0), cache.stride(0),
        cache.stride(1), WIDTH=width, W_PAD=triton.next_power_of_2(width), KV_FP8=fp8, **pdl_args(latent.device))
