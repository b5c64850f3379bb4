"""Attention over the paged KV cache, behind a backend interface.

A step's tokens are ordered decode-first: the first `num_decode_tokens` tokens each belong to
a different sequence with exactly one query token (decodes, and prefill chunks of length 1);
the rest are variable-length prefill chunks. Each backend writes the step's new K/V into the
cache first, then attends over the cache, so cached prefixes and new tokens are read alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.kernels import cpu_native
from pdserve.kernels.cpu_attention import kv_cache_write_cpu, paged_decode_attention_cpu, paged_prefill_attention_cpu
from pdserve.kernels.reference import kv_cache_write_ref, paged_decode_attention_ref, paged_prefill_attention_ref
from pdserve.worker.attention.kv_cache import KVCache


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decode] int32
    prefill_block_tables: torch.Tensor  # [num_prefill, max_blocks] int32
    prefill_cu_seqlens_q: torch.Tensor  # [num_prefill + 1] int32, offsets from the first prefill token
    prefill_context_lens: torch.Tensor  # [num_prefill] int32
    # A model whose KV cache has a sliding group (kv_groups.py): that group's slots and block
    # tables (the same tokens and lengths), read by its layers; None: every layer reads these.
    sliding: AttentionMetadata | None = None

    def for_layer(self, kv_cache: KVCache, layer: int) -> AttentionMetadata:
        return self.sliding if self.sliding is not None and kv_cache.sliding[layer] else self


class AttentionBackend(Protocol):
    name: str

    def bind(self, kv_cache: KVCache) -> None: ...

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, scale: float, sinks: torch.Tensor | None = None,
                window: int = 0) -> torch.Tensor: ...


class PagedBackend:
    """Shared dispatch; subclasses pick the write / decode / prefill functions."""

    name = "base"
    write = decode = prefill = None

    def __init__(self):
        self.kv_cache: KVCache | None = None

    def bind(self, kv_cache: KVCache) -> None:
        self.kv_cache = kv_cache

    def forward(self, layer, q, k, v, meta, scale, sinks=None, window=0):
        """`sinks` [Hq]: a learned logit per head in each softmax's denominator (gpt-oss); `window`
        > 0: the layer attends to the last `window` positions only (sliding-window layers)."""
        k_cache, v_cache = self.kv_cache.layer(layer)
        meta = meta.for_layer(self.kv_cache, layer)
        # An fp8 cache's per-layer scales (None otherwise): K/V are quantized on the write and
        # dequantized inside attention, so nothing else sees the cache's element type.
        ks, vs = self.kv_cache.layer_scales(layer)
        type(self).write(k, v, k_cache, v_cache, meta.slot_mapping, ks, vs)
        nd = meta.num_decode_tokens
        if nd and nd == q.shape[0]:  # decode only (every CPU decode step): the kernel's output is the result
            return type(self).decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale,
                                     ks, vs, sinks=sinks, window=window)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = type(self).decode(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                         meta.decode_context_lens, scale, ks, vs, sinks=sinks, window=window)
        if q.shape[0] > nd:
            out[nd:] = type(self).prefill(q[nd:], k_cache, v_cache, meta.prefill_block_tables,
                                          meta.prefill_cu_seqlens_q, meta.prefill_context_lens, scale, ks, vs,
                                          sinks=sinks, window=window)
        return out


class TorchAttentionBackend(PagedBackend):
    """Plain torch: runs anywhere, the reference the Triton backend is tested against."""

    name = "torch"
    write = staticmethod(kv_cache_write_ref)
    decode = staticmethod(paged_decode_attention_ref)
    prefill = staticmethod(paged_prefill_attention_ref)


class CpuAttentionBackend(PagedBackend):
    """The CPU engine's: the reference's math in fewer, larger ops (kernels/cpu_attention.py)."""

    name = "cpu"
    write = staticmethod(kv_cache_write_cpu)
    decode = staticmethod(paged_decode_attention_cpu)
    prefill = staticmethod(paged_prefill_attention_cpu)

    def bind(self, kv_cache: KVCache) -> None:
        super().bind(kv_cache)
        if kv_cache.dtype == torch.bfloat16:  # build (or load) the native kernels at start, not in a request
            cpu_native.library()
            cpu_native.pointwise()
