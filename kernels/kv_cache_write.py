"""Write new K/V rows into their paged-cache slots."""

from __future__ import annotations

import torch


def kv_cache_write_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] (strided view)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int, slot = block_id * block_size + offset; -1 = skip
) -> None:
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)
