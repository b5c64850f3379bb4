"""Decode attention: one query token per sequence against its paged KV context."""

from __future__ import annotations

import torch


def paged_decode_attention_ref(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32, padded with any valid id
    context_lens: torch.Tensor,  # [B] int32, tokens in cache incl. the current one
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    # Batched over sequences: gather every sequence's blocks, pad to the longest context and
    # mask. Padding costs memory, not Python loops, which is what matters on CPU.
    B, Hq, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    max_len = int(context_lens.max())
    nblk = (max_len + block_size - 1) // block_size
    bt = block_tables[:, :nblk].long()
    k = k_cache[bt].reshape(B, nblk * block_size, Hkv, D)[:, :max_len]
    v = v_cache[bt].reshape(B, nblk * block_size, Hkv, D)[:, :max_len]
    group = Hq // Hkv
    k = k.repeat_interleave(group, dim=2).transpose(1, 2).float()  # [B, Hq, L, D]
    v = v.repeat_interleave(group, dim=2).transpose(1, 2).float()
    scores = torch.einsum("bhd,bhld->bhl", q.float(), k) * scale
    pos = torch.arange(max_len, device=q.device)
    scores.masked_fill_(pos[None, None, :] >= context_lens[:, None, None].long(), float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("bhl,bhld->bhd", probs, v).to(q.dtype)
