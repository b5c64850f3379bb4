"""The GPU attention backend: the same paged dispatch as the torch reference, on Triton kernels.

Selected automatically on CUDA (worker/attention/selector.py); on CPU it runs under TRITON_INTERPRET=1 in the
tests, which check it produces the torch backend's greedy tokens. Every launcher reads only
shapes on the host, never index values, so a decode step through this backend can be captured
in a CUDA graph (worker/executor/cuda_graphs.py).

`forward_rotary` takes q/k/v straight from the qkv projection. A decode token's whole attention
is then one launch: the decode kernel adds the bias, normalises q and k per head (Qwen3's
q/k RMSNorm, where the model passes `qk_norm`), rotates them, writes k and v into the cache and
attends, its split merge fused in (the backend lends it the arrival counters). Prefill tokens
get one epilogue kernel (bias + q/k norm + rotary + KV write) before prefill attention.
"""

from __future__ import annotations

import torch

from pdserve.kernels.arrivals import MAX_COUNTERS, strip_counters
from pdserve.kernels.kv_cache_write import kv_cache_write
from pdserve.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_rotary
from pdserve.kernels.paged_prefill_attention import paged_prefill_attention
from pdserve.kernels.rotary_kv_write import rotary_kv_write
from pdserve.worker.attention.backend import AttentionMetadata, PagedBackend


class TritonAttentionBackend(PagedBackend):
    name = "triton"
    write = staticmethod(kv_cache_write)
    decode = staticmethod(paged_decode_attention)
    prefill = staticmethod(paged_prefill_attention)

    # False: v4's launches (a separate reduce; rotary + KV write before decode attention),
    # kept for same-run before/after benchmarks (bench/profile_decode.py).
    fuse_decode_merge = True
    fuse_decode_rotary = True
    # Qwen3's q/k RMSNorm inside the rotary epilogue (forward_rotary's `qk_norm`). Read when the
    # model is built; False: two norm launches a layer before it (bench/moe.py's same-run baseline).
    fuse_qk_norm = True
    # The small-batch GEMV path of models/llama.py (kernels/fused_gemv.py: steps of <= 8 tokens
    # run their RMSNorm inside the qkv and gate/up GEMVs and SiLU·mul inside down_proj's). Read
    # when the model is built (llama.gemv_mode): None, the default, takes it for the shapes
    # fused_gemv.MEASURED says it wins on this card (tools/gpu/gemv.sh measures a card; none
    # measured: cuBLAS throughout); True for every shape (tests, benches); False never.
    fused_gemv: bool | None = None

    @staticmethod
    def semaphores(rows: int, device: torch.device) -> torch.Tensor | None:
        """The decode kernel's split-arrival counters for `rows` = batch * KV heads: the device's
        shared ones (kernels/arrivals.py; every launch leaves them zero, and the layers' launches
        are ordered on one stream). None past their size: a second launch merges the splits."""
        return strip_counters(device) if rows <= MAX_COUNTERS else None

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, scale: float, sinks: torch.Tensor | None = None,
                window: int = 0) -> torch.Tensor:
        # q: [T, Hq, D] (rotated); k, v: [T, Hkv, D] -> [T, Hq, D]. sinks / window: as the torch
        # backend's (gpt-oss); the kernels take them as constexpr-switched options.
        k_cache, v_cache = self.kv_cache.layer(layer)
        meta = meta.for_layer(self.kv_cache, layer)
        ks, vs = self.kv_cache.layer_scales(layer)  # an fp8 cache's scales; None otherwise
        kv_cache_write(k, v, k_cache, v_cache, meta.slot_mapping, ks, vs)
        return self._attend(q, k_cache, v_cache, meta, scale, ks, vs, sinks=sinks, window=window)

    def forward_rotary(self, layer: int, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, cos_sin: torch.Tensor, bias: torch.Tensor | None,
                       meta: AttentionMetadata, scale: float, sinks: torch.Tensor | None = None,
                       window: int = 0, qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None
                       ) -> torch.Tensor:
        """`forward` for q/k/v straight out of the projection (bias not yet added, not normalised,
        not rotated). `qk_norm`: (q weight, k weight, eps) of a per-head RMSNorm before rotary."""
        k_cache, v_cache = self.kv_cache.layer(layer)
        meta = meta.for_layer(self.kv_cache, layer)
        ks, vs = self.kv_cache.layer_scales(layer)
        nd, total = meta.num_decode_tokens, q.shape[0]
        extra = dict(sinks=sinks, window=window)
        if nd == 0 or not self.fuse_decode_rotary:
            q = rotary_kv_write(positions, q, k, v, cos_sin, k_cache, v_cache, meta.slot_mapping, bias, ks, vs,
                                qk_norm=qk_norm)
            return self._attend(q, k_cache, v_cache, meta, scale, ks, vs, **extra)
        # Decode rows: epilogue and attention in one launch, in mixed steps too (so a mixed step
        # meets the same kernel variants as the graphs: nothing to compile mid-traffic).
        sem = self.semaphores(nd * k_cache.shape[2], q.device) if self.fuse_decode_merge else None
        dec = paged_decode_attention_rotary(q[:nd], k[:nd], v[:nd], k_cache, v_cache, meta.decode_block_tables,
                                            meta.decode_context_lens, positions[:nd], meta.slot_mapping[:nd],
                                            cos_sin, scale, bias, ks, vs, semaphores=sem, qk_norm=qk_norm, **extra)
        if nd == total:
            return dec
        qp = rotary_kv_write(positions[nd:], q[nd:], k[nd:], v[nd:], cos_sin, k_cache, v_cache,
                             meta.slot_mapping[nd:], bias, ks, vs, qk_norm=qk_norm)
        pre = paged_prefill_attention(qp, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_cu_seqlens_q,
                                      meta.prefill_context_lens, scale, ks, vs, **extra)
        return torch.cat([dec, pre])

    def _attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, ks=None, vs=None,
                **extra) -> torch.Tensor:
        # Unlike the shared dispatch, a step that is all decode or all prefill returns the
        # kernel's output as is: copying it into a separate `out` would add a write and a read
        # of [T, Hq, D] per layer.
        nd, total = meta.num_decode_tokens, q.shape[0]
        if nd == total:
            return self._decode(q, k_cache, v_cache, meta, scale, ks, vs, **extra)
        if nd == 0:
            return paged_prefill_attention(q, k_cache, v_cache, meta.prefill_block_tables,
                                           meta.prefill_cu_seqlens_q, meta.prefill_context_lens, scale, ks, vs, **extra)
        out = torch.empty_like(q)
        out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale, ks, vs, **extra)
        out[nd:] = paged_prefill_attention(q[nd:], k_cache, v_cache, meta.prefill_block_tables,
                                           meta.prefill_cu_seqlens_q, meta.prefill_context_lens, scale, ks, vs, **extra)
        return out

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, ks=None, vs=None,
                **extra) -> torch.Tensor:
        sem = self.semaphores(q.shape[0] * k_cache.shape[2], q.device) if self.fuse_decode_merge else None
        return paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                      scale, ks, vs, semaphores=sem, **extra)
