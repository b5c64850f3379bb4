"""Plain-torch references of every kernel in pdserve.kernels: the CPU path and the tests' oracle.

This module imports torch only, never Triton, so the CPU engine (`pdserve up` installs no Triton)
runs on it; each Triton kernel beside it in this package is tested against its reference here.
Shapes follow the KV-cache layout in pdserve.kernels' docstring.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.launch import FP8_E4M3_MAX, FP8_KV_DTYPE  # torch only, no Triton

# An fp8 KV cache holds float8 e4m3 ("fn": finite, no inf) values x / scale, one scale per layer
# for K and one for V (per-tensor, as vLLM's k_scale / v_scale). Values past e4m3's largest
# finite number saturate to it: a cast alone would give NaN. The Triton kernels quantize and
# dequantize with exactly these steps, so the reference is their oracle bit for bit.


def quantize_kv(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """K or V rows as the cache stores them: cast, or (fp8) divided by the scale, saturated, cast."""
    if cache_dtype != FP8_KV_DTYPE:
        return x.to(cache_dtype)
    x = x.float() if scale is None else x.float() / scale.float()
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Cache rows as fp32 values: fp8 ones times their scale."""
    if x.dtype != FP8_KV_DTYPE or scale is None:
        return x.float()
    return x.float() * scale.float()

def kv_cache_write_ref(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] (strided view)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int, slot = block_id * block_size + offset; -1 = skip
    k_scale: torch.Tensor | None = None,  # [1] fp32, an fp8 cache's K scale (None = 1)
    v_scale: torch.Tensor | None = None,
) -> None:
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = quantize_kv(key[keep], k_cache.dtype, k_scale)
    v_cache[blocks, offsets] = quantize_kv(value[keep], v_cache.dtype, v_scale)


def paged_decode_attention_ref(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32, padded with any valid id
    context_lens: torch.Tensor,  # [B] int32, tokens in cache incl. the current one
    scale: float,
    k_scale: torch.Tensor | None = None,  # [1] fp32, an fp8 cache's K scale (None = 1)
    v_scale: torch.Tensor | None = None,
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
    k = dequantize_kv(k.repeat_interleave(group, dim=2).transpose(1, 2), k_scale)  # [B, Hq, L, D]
    v = dequantize_kv(v.repeat_interleave(group, dim=2).transpose(1, 2), v_scale)
    scores = torch.einsum("bhd,bhld->bhl", q.float(), k) * scale
    pos = torch.arange(max_len, device=q.device)
    scores.masked_fill_(pos[None, None, :] >= context_lens[:, None, None].long(), float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("bhl,bhld->bhd", probs, v).to(q.dtype)


def paged_prefill_attention_ref(
    q: torch.Tensor,  # [T, Hq, D], T = cu_seqlens_q[-1]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B+1] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    k_scale: torch.Tensor | None = None,  # [1] fp32, an fp8 cache's K scale (None = 1)
    v_scale: torch.Tensor | None = None,
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
        k = dequantize_kv(k.repeat_interleave(group, dim=1).transpose(0, 1), k_scale)  # [Hq, ctx, D]
        v = dequantize_kv(v.repeat_interleave(group, dim=1).transpose(0, 1), v_scale)
        qi = q[s:e].transpose(0, 1).float()  # [Hq, n, D]
        scores = (qi @ k.transpose(1, 2)) * scale  # [Hq, n, ctx]
        q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        scores.masked_fill_(k_pos > q_pos, float("-inf"))
        out[s:e] = (scores.softmax(-1) @ v).transpose(0, 1).to(q.dtype)
    return out


def rms_norm_ref(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, H]; if given, x + residual is normalised
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (normed, new_residual); new_residual = x + residual (None if no residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    # Same op order as Hugging Face's LlamaRMSNorm, so fp32 results match bit for bit.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), residual


def rotary_ref(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D] fp32: cos in [:, :D/2], sin in [:, D/2:]
) -> tuple[torch.Tensor, torch.Tensor]:
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions.long()]
    cos = torch.cat([cs[:, :half], cs[:, :half]], -1)[:, None, :]
    sin = torch.cat([cs[:, half:], cs[:, half:]], -1)[:, None, :]

    def rot(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half], x[..., half:]
        rotated = torch.cat([-x2, x1], -1)
        return (x * cos.to(x.dtype) + rotated * sin.to(x.dtype)).to(x.dtype)

    return rot(q), rot(k)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_kv_write_ref(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D] fp32, as rotary_ref
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] (strided view)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int; -1 = skip
    bias: torch.Tensor | None = None,  # [(Hq + 2 Hkv) * D], the qkv projection's bias (q | k | v)
    k_scale: torch.Tensor | None = None,  # [1] fp32, an fp8 cache's scales (None = 1)
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # rotated q [T, Hq, D]; rotated k and v land in the cache
    """The decode layer's q/k/v epilogue: bias, rotary, KV write (what the Triton kernel fuses)."""
    if bias is not None:
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        bq, bk, bv = bias.split([hq * d, hkv * d, hkv * d])
        q, k, v = q + bq.view(hq, d), k + bk.view(hkv, d), v + bv.view(hkv, d)
    q, k = rotary_ref(positions, q, k, cos_sin_cache)
    kv_cache_write_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def paged_decode_attention_rotary_ref(
    q: torch.Tensor,  # [B, Hq, D], straight from the projection (no bias, not rotated)
    k: torch.Tensor,  # [B, Hkv, D]
    v: torch.Tensor,  # [B, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, the new token included
    positions: torch.Tensor,  # [B] int, context_lens - 1
    slot_mapping: torch.Tensor,  # [B] int; -1 = not written
    cos_sin_cache: torch.Tensor,  # [max_pos, D] fp32
    scale: float,
    bias: torch.Tensor | None = None,  # [(Hq + 2 Hkv) * D]
    k_scale: torch.Tensor | None = None,  # [1] fp32, an fp8 cache's scales (None = 1)
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [B, Hq, D]
    """A decode layer's attention from the projection's output: epilogue, then paged attention."""
    q = rotary_kv_write_ref(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, bias, k_scale, v_scale)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
