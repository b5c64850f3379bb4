"""Prefill attention over paged KV: variable-length query chunks, causal, with a cached prefix.

Sequence i has `context_lens[i]` tokens in the cache (already written, the new ones
included); its `n_i = cu_seqlens_q[i+1] - cu_seqlens_q[i]` queries are the last n_i of them.
"""

from __future__ import annotations

import torch


def paged_prefill_attention_ref(
    q: torch.Tensor,  # [T, Hq, D], T = cu_seqlens_q[-1]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B+1] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    out = torch.empty_like(q)
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // Hkv
    cu = cu_seqlens_q.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        s, e = cu[i], cu[i + 1]
        n = e - s
        if n == 0:
            continue
        nblk = (ctx + block_size - 1) // block_size
        bt = block_tables[i, :nblk].long()
        k = k_cache[bt].reshape(-1, Hkv, k_cache.shape[3])[:ctx]
        v = v_cache[bt].reshape(-1, Hkv, v_cache.shape[3])[:ctx]
        k = k.repeat_interleave(group, dim=1).transpose(0, 1).float()  # [Hq, ctx, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1).float()
        qi = q[s:e].transpose(0, 1).float()  # [Hq, n, D]
        scores = (qi @ k.transpose(1, 2)) * scale  # [Hq, n, ctx]
        q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        scores.masked_fill_(k_pos > q_pos, float("-inf"))
        out[s:e] = (scores.softmax(-1) @ v).transpose(0, 1).to(q.dtype)
    return out
