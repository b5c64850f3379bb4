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
Prefill and the cache write are the plain-torch references (kernels/reference.py: mla_prefill_ref,
mla_cache_write_ref) whatever the attention backend; decode is kernels/mla_decode.py's Triton kernel
on the Triton backend and mla_decode_ref on the torch one. The references read lengths and slots
on the host, so a DeepSeek model runs without decode CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.kernels.reference import mla_cache_write_ref, mla_decode_ref, mla_prefill_ref
from pdserve.worker.attention.backend import AttentionBackend, AttentionMetadata


def _triton_decode() -> Callable:
    # Imported on use: Triton exists only where the Triton backend was chosen.
    from pdserve.kernels.mla_decode import mla_decode

    return mla_decode


def latent_attention(backend: AttentionBackend, layer: int, latent: torch.Tensor, q_nope: torch.Tensor,
                     q_pe: torch.Tensor, meta: AttentionMetadata, scale: float, w_uk: torch.Tensor,
                     w_uv: torch.Tensor, expand: Callable) -> torch.Tensor:
    """latent [T, R + P]; q_nope [T, H, N], q_pe [T, H, P] (roped); w_uk [H, N, R] and w_uv
    [H, V, R]: kv_b_proj's key and value up-projections; `expand`: latents [L, R] -> (k_nope
    [L, H, N], v [L, H, V]) -> the heads' outputs [T, H, V]."""
    cache, _ = backend.kv_cache.layer(layer)
    mla_cache_write_ref(latent, cache, meta.slot_mapping)
    t, h, _ = q_nope.shape
    out = q_nope.new_empty(t, h, w_uv.shape[1])
    nd = meta.num_decode_tokens
    if nd:
        q_latent = torch.einsum("bhn,hnr->bhr", q_nope[:nd], w_uk)
        decode = _triton_decode() if backend.name == "triton" else mla_decode_ref
        o = decode(q_latent, q_pe[:nd].contiguous(), cache, meta.decode_block_tables, meta.decode_context_lens, scale)
        out[:nd] = torch.einsum("bhr,hvr->bhv", o, w_uv)
    if t > nd:
        out[nd:] = mla_prefill_ref(q_nope[nd:], q_pe[nd:], cache, meta.prefill_block_tables,
                                   meta.prefill_cu_seqlens_q, meta.prefill_context_lens, scale, expand,
                                   w_uv.shape[1])
    return out
