"""Multi-head latent attention (DeepSeek-V2/V3) over the latent KV cache (kv_spec.py).

A step's tokens come decode-first as for every backend (backend.py). Each layer writes its new
tokens' latents [normed latent | roped key] into the cache, then:
- prefill tokens (chunks, with or without a cached prefix) attend over their whole context with
  the context's latents expanded into per-head keys and values through kv_b_proj, which is the
  computation transformers does, so prefix caching and chunked prefill read exactly what a
  one-shot prefill would;
- decode tokens attend in the latent space: the key up-projection is absorbed into the query
  (q_nope W_UK, one R-vector per head) and the value one applied to the attended latent, so each
  cached token is read as R + P values once for all heads (multi-query attention over the latent).
Prefill is the plain-torch reference (kernels/reference.py: mla_prefill_ref) whatever the
attention backend. On the Triton backend the cache write and decode are kernels
(kernels/mla_cache_write.py, kernels/mla_decode.py) that read slots and lengths on the device
only, so a decode step can be captured in a CUDA graph; on the torch one their references
(mla_cache_write_ref, mla_decode_ref), which read them on the host.

An fp8 cache (--kv-cache-dtype fp8) stores the latent row / the layer's scale as e4m3: the K
scale of KVCache.scales (the latent is the key and the value at once, so one scale, as vLLM's
MLA cache keeps it). The write quantizes; decode and prefill dequantize what they read, so
nothing else sees the cache's element type.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.kernels.reference import mla_cache_write_ref, mla_decode_ref, mla_prefill_ref
from pdserve.worker.attention.backend import AttentionBackend, AttentionMetadata


def _triton_kernels() -> tuple[Callable, Callable]:
    # Imported on use: Triton exists only where the Triton backend was chosen.
    from pdserve.kernels.mla_cache_write import mla_cache_write
    from pdserve.kernels.mla_decode import mla_decode

    return mla_cache_write, mla_decode


def latent_attention(backend: AttentionBackend, layer: int, latent: torch.Tensor, q_nope: torch.Tensor,
                     q_pe: torch.Tensor, meta: AttentionMetadata, scale: float, w_uk: torch.Tensor,
                     w_uv: torch.Tensor, expand: Callable) -> torch.Tensor:
    """latent [T, R + P]; q_nope [T, H, N], q_pe [T, H, P] (roped); w_uk [H, N, R] and w_uv
    [H, V, R]: kv_b_proj's key and value up-projections; `expand`: latents [L, R] -> (k_nope
    [L, H, N], v [L, H, V]) -> the heads' outputs [T, H, V]."""
    cache, _ = backend.kv_cache.layer(layer)
    kv_scale, _ = backend.kv_cache.layer_scales(layer)  # an fp8 cache's; None otherwise
    write, decode = _triton_kernels() if backend.name == "triton" else (mla_cache_write_ref, mla_decode_ref)
    write(latent, cache, meta.slot_mapping, kv_scale)
    t, h, _ = q_nope.shape
    nd = meta.num_decode_tokens
    dec = None
    if nd:
        q_latent = torch.einsum("bhn,hnr->bhr", q_nope[:nd], w_uk)
        o = decode(q_latent, q_pe[:nd].contiguous(), cache, meta.decode_block_tables, meta.decode_context_lens, scale,
                   kv_scale=kv_scale)
        dec = torch.einsum("bhr,hvr->bhv", o, w_uv)
        if nd == t:  # a decode-only step (what a CUDA graph captures): no copy into a shared output
            return dec
    out = q_nope.new_empty(t, h, w_uv.shape[1])
    if dec is not None:
        out[:nd] = dec
    out[nd:] = mla_prefill_ref(q_nope[nd:], q_pe[nd:], cache, meta.prefill_block_tables, meta.prefill_cu_seqlens_q,
                               meta.prefill_context_lens, scale, expand, w_uv.shape[1], kv_scale)
    return out
