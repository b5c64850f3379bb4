"""The GPU attention backend: the same paged dispatch as the torch reference, on Triton kernels.

Selected automatically on CUDA (`make_backend`); on CPU it runs under TRITON_INTERPRET=1 in the
tests, which check it produces the torch backend's greedy tokens. Every launcher reads only
shapes on the host, never index values, so a decode step through this backend can be captured
in a CUDA graph (worker/cuda_graphs.py).
"""

from __future__ import annotations

import torch

from pdserve.kernels.kv_cache_write import kv_cache_write
from pdserve.kernels.paged_decode_attention import paged_decode_attention
from pdserve.kernels.paged_prefill_attention import paged_prefill_attention
from pdserve.worker.attention import AttentionMetadata, _PagedBackend


class TritonAttentionBackend(_PagedBackend):
    name = "triton"
    write = staticmethod(kv_cache_write)
    decode = staticmethod(paged_decode_attention)
    prefill = staticmethod(paged_prefill_attention)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq, D]. Unlike the shared dispatch, a step that
        # is all decode or all prefill returns the kernel's output as is: copying it into a
        # separate `out` would add a write and a read of [T, Hq, D] per layer.
        k_cache, v_cache = self.kv_cache.layer(layer)
        kv_cache_write(k, v, k_cache, v_cache, meta.slot_mapping)
        nd, total = meta.num_decode_tokens, q.shape[0]
        if nd == total:
            return paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables,
                                          meta.decode_context_lens, scale)
        if nd == 0:
            return paged_prefill_attention(q, k_cache, v_cache, meta.prefill_block_tables,
                                           meta.prefill_cu_seqlens_q, meta.prefill_context_lens, scale)
        out = torch.empty_like(q)
        out[:nd] = paged_decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables,
                                          meta.decode_context_lens, scale)
        out[nd:] = paged_prefill_attention(q[nd:], k_cache, v_cache, meta.prefill_block_tables,
                                           meta.prefill_cu_seqlens_q, meta.prefill_context_lens, scale)
        return out
