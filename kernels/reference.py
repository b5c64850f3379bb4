"""Plain-torch references of every kernel in pdserve.kernels: the CPU path and the tests' oracle.

This module imports torch only, never Triton, so the CPU engine (`pdserve up` installs no Triton)
runs on it; each Triton kernel beside it in this package is tested against its reference here.
Shapes follow the KV-cache layout in pdserve.kernels' docstring.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels.launch import FP8_E4M3_MAX, FP8_KV_DTYPE  # torch only, no Triton
from pdserve.kernels.moe_activation import SILU_AND_MUL, MoeActivation, SwigluOAI, check_activation
from pdserve.kernels.mxfp4 import dequantize_mxfp4

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
    *,
    sinks: torch.Tensor | None = None,  # [Hq]: one extra logit per head in the softmax's denominator
    window: int = 0,  # > 0: only the last `window` positions (the query's included) are attended
) -> torch.Tensor:  # [B, Hq, D]
    # Batched over sequences: gather every sequence's blocks, pad to the longest context and
    # mask. Padding costs memory, not Python loops, which is what matters on CPU. The query heads
    # are viewed as [Hkv, group] rather than the KV heads repeated group times: the same sums
    # without a copy of K and V per query head (3.7x faster at 8 sequences of 500 tokens, CPU).
    B, Hq, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    max_len = int(context_lens.max())
    nblk = (max_len + block_size - 1) // block_size
    bt = block_tables[:, :nblk].long()
    k = dequantize_kv(k_cache[bt].reshape(B, nblk * block_size, Hkv, D)[:, :max_len], k_scale)  # [B, L, Hkv, D]
    v = dequantize_kv(v_cache[bt].reshape(B, nblk * block_size, Hkv, D)[:, :max_len], v_scale)
    qg = q.float().reshape(B, Hkv, Hq // Hkv, D)
    scores = torch.einsum("bkgd,blkd->bkgl", qg, k) * scale  # [B, Hkv, group, L]
    pos = torch.arange(max_len, device=q.device)
    ctx = context_lens[:, None, None, None].long()
    scores.masked_fill_(pos >= ctx, float("-inf"))
    if window > 0:  # the query sits at ctx - 1; transformers keeps keys at positions > query - window
        scores.masked_fill_(pos < ctx - window, float("-inf"))
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.reshape(Hkv, Hq // Hkv, 1))
    return torch.einsum("bkgl,blkd->bkgd", probs, v).reshape(B, Hq, D).to(q.dtype)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim; `sinks` (broadcast to scores[..., :1]) joins each row's
    denominator as one more logit whose value row is zero (gpt-oss), as transformers computes it:
    the sink concatenated to the scores, the softmax, the sink's column dropped."""
    if sinks is None:
        return scores.softmax(dim=-1)
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, sink], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    return combined.softmax(dim=-1)[..., :-1]


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
    *,
    sinks: torch.Tensor | None = None,  # [Hq], as paged_decode_attention_ref's
    window: int = 0,  # > 0: each query attends to the positions > its own - window
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
        lo = max(ctx - n - window + 1, 0) if window > 0 else 0  # the first key any query sees
        k = k_cache[bt].reshape(-1, Hkv, k_cache.shape[3])[lo:ctx]
        v = v_cache[bt].reshape(-1, Hkv, v_cache.shape[3])[lo:ctx]
        k = dequantize_kv(k.repeat_interleave(group, dim=1).transpose(0, 1), k_scale)  # [Hq, ctx - lo, D]
        v = dequantize_kv(v.repeat_interleave(group, dim=1).transpose(0, 1), v_scale)
        qi = q[s:e].transpose(0, 1).float()  # [Hq, n, D]
        scores = (qi @ k.transpose(1, 2)) * scale  # [Hq, n, ctx - lo]
        q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        k_pos = torch.arange(lo, ctx, device=q.device)[None, :]
        hidden = k_pos > q_pos
        if window > 0:
            hidden |= k_pos <= q_pos - window
        scores.masked_fill_(hidden, float("-inf"))
        probs = softmax_with_sinks(scores, None if sinks is None else sinks.reshape(-1, 1, 1))
        out[s:e] = (probs @ v).transpose(0, 1).to(q.dtype)
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


def rotary_interleaved_ref(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D] fp32: cos in [:, :D/2], sin in [:, D/2:]
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's rope over interleaved pairs (x0, x1), (x2, x3), ..., pair i turned by frequency i,
    written as transformers' DeepSeek-V3 writes it: the pairs' first elements, then their second
    ones. (V2's complex form keeps each pair in place: the same values permuted alike in q and k,
    so every q.k and the model's output are the same.)"""
    def pairs_split(x: torch.Tensor) -> torch.Tensor:  # then it is rotate-half rope
        return torch.cat([x[..., 0::2], x[..., 1::2]], -1)

    return rotary_ref(positions, pairs_split(q), pairs_split(k), cos_sin_cache)


def clamped_swiglu_ref(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """gpt-oss's expert activation on [gate | up] halves, as transformers' GptOssExperts computes it
    (there on interleaved columns, which the loader separates): gate clamped above at `limit`, up
    to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


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
    *,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,  # (q weight [D], k weight [D], eps)
) -> torch.Tensor:  # rotated q [T, Hq, D]; rotated k and v land in the cache
    """The decode layer's q/k/v epilogue: bias, Qwen3's per-head q/k RMSNorm (if `qk_norm`),
    rotary, KV write (what the Triton kernels fuse)."""
    if bias is not None:
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        bq, bk, bv = bias.split([hq * d, hkv * d, hkv * d])
        q, k, v = q + bq.view(hq, d), k + bk.view(hkv, d), v + bv.view(hkv, d)
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        q, k = rms_norm_ref(q, q_weight, eps)[0], rms_norm_ref(k, k_weight, eps)[0]
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
    *,
    sinks: torch.Tensor | None = None,  # [Hq], as paged_decode_attention_ref's
    window: int = 0,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,  # as rotary_kv_write_ref's
) -> torch.Tensor:  # [B, Hq, D]
    """A decode layer's attention from the projection's output: epilogue, then paged attention."""
    q = rotary_kv_write_ref(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, bias, k_scale, v_scale,
                            qk_norm=qk_norm)
    return paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale,
                                      sinks=sinks, window=window)


def moe_activation_ref(gate_up: torch.Tensor, activation: MoeActivation) -> torch.Tensor:  # [T, 2I] -> [T, I]
    if isinstance(activation, SwigluOAI):
        return clamped_swiglu_ref(gate_up, activation.alpha, activation.limit)
    return silu_and_mul_ref(gate_up)


def fused_moe_ref(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: expert e's gate rows then its up rows (uint8 [E, 2I, H/2]: MXFP4)
    w2: torch.Tensor,  # [E, H, I] (uint8 [E, H, I/2]: MXFP4)
    topk_weights: torch.Tensor,  # [T, k] fp32, the router's weights
    topk_ids: torch.Tensor,  # [T, k] int expert ids; -1 or outside the held range: not computed here
    expert_offset: int = 0,  # w13[i] / w2[i] are expert expert_offset + i (expert parallelism)
    w13_scale: torch.Tensor | None = None,  # e4m3 w13 / w2: fp32 scales (fused_moe's layout); uint8
    w2_scale: torch.Tensor | None = None,  #   w13 / w2: MXFP4 exponents [E, 2I, H/32], [E, H, I/32]
    block: tuple[int, int] | None = None,
    w13_bias: torch.Tensor | None = None,  # [E, 2I] (gate | up) and [E, H]: biased experts (gpt-oss)
    w2_bias: torch.Tensor | None = None,
    activation: MoeActivation = SILU_AND_MUL,  # kernels/moe_activation.py
) -> torch.Tensor:  # [T, H]: sum over k of weight * (down(act(gate_up x + b13)) + b2); 0 where no expert is held
    """The MoE layer as the fused kernel computes it: the T*k (token, expert) assignments sorted by
    expert, one GEMM per expert over its contiguous run of rows (gate|up, its bias, the activation,
    down, its bias, then the router weight), results written back to their assignment's row and
    summed over k. Quantized weights: each expert used is dequantized to x's dtype, as the
    kernel's tiles are: FP8 (e4m3) by dequantize_moe_fp8_ref, MXFP4 (uint8) by dequantize_mxfp4."""
    check_activation("fused_moe_ref", activation)
    T, H = x.shape
    k, E = topk_ids.shape[1], w13.shape[0]
    ids = topk_ids.reshape(-1).long() - expert_offset
    ids = torch.where((ids < 0) | (ids >= E), E, ids)  # not held here: sorted last, never computed
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=E + 1).tolist()  # one host read: this is the CPU path
    acc = torch.promote_types(x.dtype, torch.float32)  # the weight is applied in fp32 (or better)
    weights = topk_weights.reshape(-1, 1).to(acc)
    out = x.new_zeros(T * k, H)
    start = 0
    for e in range(E):
        rows = order[start:start + counts[e]]
        start += counts[e]
        if rows.numel() == 0:
            continue
        w13_e, w2_e = w13[e], w2[e]
        if w13.dtype == torch.uint8:
            w13_e = dequantize_mxfp4(w13_e, w13_scale[e], x.dtype)
            w2_e = dequantize_mxfp4(w2_e, w2_scale[e], x.dtype)
        elif w13_scale is not None:
            w13_e = dequantize_moe_fp8_ref(w13_e, w13_scale[e], block, parts=2).to(x.dtype)
            w2_e = dequantize_moe_fp8_ref(w2_e, w2_scale[e], block).to(x.dtype)
        gate_up = x[rows // k] @ w13_e.t()
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[e]
        y = moe_activation_ref(gate_up, activation) @ w2_e.t()
        if w2_bias is not None:
            y = y + w2_bias[e]
        out[rows] = (y.to(acc) * weights[rows]).to(x.dtype)
    return out.view(T, k, H).sum(dim=1)


def fused_moe_loop_ref(x, w13, w2, topk_weights, topk_ids, expert_offset: int = 0) -> torch.Tensor:
    """The same function written the obvious way (transformers' structure): for each expert, find
    the tokens that chose it and add their weighted outputs. The oracle of fused_moe_ref."""
    acc = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros_like(x, dtype=acc)
    for e in range(w13.shape[0]):
        token, slot = torch.where(topk_ids == e + expert_offset)
        if token.numel() == 0:
            continue
        gate, up = (x[token] @ w13[e].t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[e].t()
        out.index_add_(0, token, y.to(acc) * topk_weights[token, slot, None].to(acc))
    return out.to(x.dtype)


def fused_moe_routed_ref(x, w13, w2, router_logits, top_k: int, renormalize: bool,
                         expert_offset: int = 0, **fp8) -> torch.Tensor:
    """The MoE layer from the router's logits: moe_route_ref then fused_moe_ref (the CPU twin of
    kernels/fused_moe.py's fused_moe_routed, which may route and sort in one launch). `fp8`:
    fused_moe_ref's keywords: w13_scale, w2_scale, block (FP8 or MXFP4 weights), w13_bias,
    w2_bias, activation (gpt-oss)."""
    weights, ids = moe_route_ref(router_logits, top_k, renormalize)
    return fused_moe_ref(x, w13, w2, weights, ids, expert_offset=expert_offset, **fp8)


def moe_route_ref(
    router_logits: torch.Tensor,  # [T, E], the router linear's output (model dtype)
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] fp32, expert ids [T, k] int64
    """Top-k routing as transformers computes it for Qwen2/3-MoE and Mixtral: softmax over all E
    in fp32, the k largest probabilities, divided by their sum when `renormalize`
    (Mixtral always; Qwen's norm_topk_prob)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_grouped_route_ref(
    router_logits: torch.Tensor,  # [T, E] fp32 (DeepSeek's router runs in fp32)
    top_k: int,
    scoring: str,  # "sigmoid" (DeepSeek-V3) | "softmax" (V2)
    n_group: int = 1,  # expert groups; 1: no group limit
    topk_group: int = 1,  # groups a token may choose from
    group_score: str = "top2_sum",  # a group's score: its two best summed (V3) | its best (V2)
    correction_bias: torch.Tensor | None = None,  # [E]: added to the scores for the choice only (V3)
    renormalize: bool = False,  # the k weights divided by their sum (+ 1e-20, as transformers)
    scaling: float = 1.0,  # routed_scaling_factor
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] fp32, expert ids [T, k] int64
    """DeepSeekMoE's group-limited top-k as transformers computes it: scores, the `topk_group`
    best groups kept (V3 masks the others' biased scores with -inf, V2 its scores with 0), the k
    best kept experts, weighted by their unbiased scores."""
    logits = router_logits.float()
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, n_group, e // n_group)
        gs = grouped.topk(2, dim=-1)[0].sum(dim=-1) if group_score == "top2_sum" else grouped.amax(dim=-1)
        keep = torch.zeros_like(gs).scatter_(1, gs.topk(topk_group, dim=-1, sorted=False)[1], 1)
        keep = keep[:, :, None].expand(t, n_group, e // n_group).reshape(t, e).bool()
        choice = choice.masked_fill(~keep, float("-inf") if group_score == "top2_sum" else 0.0)
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


# --- Multi-head latent attention (DeepSeek-V2/V3) over a latent KV cache --------------------------
# The cache holds, per token and layer, one vector [kv_lora_rank latent | rope key]
# ([num_blocks, block_size, 1, R + P]: worker/attention/kv_spec.py). Prefill expands the latents
# of the context into per-head keys and values (as transformers computes); decode attends in the
# latent space with the key up-projection folded into the query and the value one applied to the
# output, reading R + P values per cached token instead of H (N + P + V).


def mla_cache_write_ref(
    latent: torch.Tensor,  # [T, R + P]
    cache: torch.Tensor,  # [num_blocks, block_size, 1, R + P] (strided view)
    slot_mapping: torch.Tensor,  # [T] int; -1 = skip
    kv_scale: torch.Tensor | None = None,  # [1] fp32, an fp8 cache's scale (None = 1)
) -> None:
    block_size = cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    cache[slots // block_size, slots % block_size, 0] = quantize_kv(latent[keep], cache.dtype, kv_scale)


def mla_decode_ref(
    q_latent: torch.Tensor,  # [B, H, R]: q_nope times the key up-projection (absorbed)
    q_pe: torch.Tensor,  # [B, H, P]: the roped query part
    cache: torch.Tensor,  # [num_blocks, block_size, 1, R + P]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, incl. the current token
    scale: float,
    kv_scale: torch.Tensor | None = None,  # [1] fp32, an fp8 cache's scale (None = 1)
) -> torch.Tensor:  # [B, H, R]: attention-weighted latents (times the value up-projection = output)
    """One query token per sequence, attending over its cached latents as multi-query attention
    with key = [latent | rope key] (R + P) and value = latent (R), shared by every head. An fp8
    cache's rows are dequantized (times kv_scale) first: the latent is both key and value, so one
    scale serves both."""
    b, h, r = q_latent.shape
    block_size = cache.shape[1]
    max_len = int(context_lens.max())
    nblk = -(-max_len // block_size)
    c = dequantize_kv(cache[block_tables[:, :nblk].long()].reshape(b, nblk * block_size, -1)[:, :max_len], kv_scale)
    q = torch.cat([q_latent, q_pe], dim=-1).float()
    scores = torch.einsum("bhd,bld->bhl", q, c) * scale
    scores.masked_fill_(torch.arange(max_len, device=q.device) >= context_lens[:, None, None].long(), float("-inf"))
    return torch.einsum("bhl,blr->bhr", scores.softmax(dim=-1), c[..., :r]).to(q_latent.dtype)


def mla_prefill_ref(
    q_nope: torch.Tensor,  # [T, H, N]
    q_pe: torch.Tensor,  # [T, H, P], roped
    cache: torch.Tensor,  # [num_blocks, block_size, 1, R + P]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B+1] int32
    context_lens: torch.Tensor,  # [B] int32: cached tokens incl. this chunk's
    scale: float,
    expand,  # latents [L, R] -> (k_nope [L, H, N], v [L, H, V]): the kv_b up-projection
    v_head_dim: int,
    kv_scale: torch.Tensor | None = None,  # [1] fp32, an fp8 cache's scale (None = 1)
) -> torch.Tensor:  # [T, H, V]
    """Causal attention of each chunk over its whole context (cached prefix and the chunk), with
    the context's latents (dequantized, for an fp8 cache) expanded into per-head keys and values."""
    t, h, _ = q_nope.shape
    r = cache.shape[-1] - q_pe.shape[-1]
    block_size = cache.shape[1]
    out = q_nope.new_empty(t, h, v_head_dim)
    cu = cu_seqlens_q.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        s, e = cu[i], cu[i + 1]
        n = e - s
        if n == 0:
            continue
        c = cache[block_tables[i, :-(-ctx // block_size)].long()].reshape(-1, cache.shape[-1])[:ctx]
        c = c.to(q_nope.dtype) if c.dtype != FP8_KV_DTYPE else dequantize_kv(c, kv_scale).to(q_nope.dtype)
        k_nope, v = expand(c[:, :r])
        k = torch.cat([k_nope, c[:, None, r:].expand(ctx, h, -1)], dim=-1).float()
        q = torch.cat([q_nope[s:e], q_pe[s:e]], dim=-1).float()
        scores = torch.einsum("nhd,lhd->hnl", q, k) * scale
        hidden = torch.arange(ctx, device=q.device)[None, :] > torch.arange(ctx - n, ctx, device=q.device)[:, None]
        scores.masked_fill_(hidden, float("-inf"))
        out[s:e] = torch.einsum("hnl,lhv->nhv", scores.softmax(dim=-1), v.float()).to(q_nope.dtype)
    return out


# --- FP8 (e4m3) quantization and scaled GEMMs: worker/quantization/fp8_linear.py --------------
# Scales multiply: value = fp8 * scale. A row's (or group's) scale is its absolute maximum over
# 448, the largest finite e4m3 value, so the quantized row fills the e4m3 range.
FP8_MAX = 448.0
FP8_MIN_SCALE = 1e-12 / FP8_MAX  # an all-zero row gets this scale, not 0 (no division by zero)


def quantize_fp8_ref(x: torch.Tensor, group_size: int | None = None,
                            static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M, G]): one scale per row and `group_size` columns
    (None: the whole row, G = 1; the last group may be partial), or the static per-tensor scale
    [1] written for every row (G = 1)."""
    m, k = x.shape
    xf = x.float()
    if static_scale is not None:
        scale = static_scale.float().reshape(1, 1).expand(m, 1)
        full = scale
    else:
        g = k if group_size is None else group_size
        ng = -(-k // g)
        padded = F.pad(xf.abs(), (0, ng * g - k)).view(m, ng, g)
        scale = padded.amax(dim=-1).div(FP8_MAX).clamp(min=FP8_MIN_SCALE)
        full = scale.repeat_interleave(g, dim=1)[:, :k]
    q = (xf / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.contiguous()



def quantize_fp8_layout_ref(x: torch.Tensor, group_size: int | None = None, mn_major_scales: bool = False,
                            pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8_ref in the layout kernels/fp8_quant.quantize_fp8 writes for a GEMM: rows
    padded with zeros to a multiple of `pad_rows_to` (their scale the minimum), scales [M', G]
    token-major (strides (1, M')) when `mn_major_scales`."""
    m = x.shape[0]
    padded = -(-m // pad_rows_to) * pad_rows_to
    q, s = quantize_fp8_ref(F.pad(x, (0, 0, 0, padded - m)) if padded != m else x, group_size)
    return q, (s.t().contiguous().t() if mn_major_scales else s)


def rms_norm_fp8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                     group_size: int | None = None, mn_major_scales: bool = False, pad_rows_to: int = 1,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """rms_norm_fp8.py: RMSNorm (rms_norm_ref, in x's dtype) then its output quantized for an
    FP8 GEMM (quantize_fp8_layout_ref); (e4m3, scales, new residual)."""
    h, residual = rms_norm_ref(x, weight, eps, residual)
    q, s = quantize_fp8_layout_ref(h, group_size, mn_major_scales, pad_rows_to)
    return q, s, residual


def silu_and_mul_fp8_ref(x: torch.Tensor, group_size: int | None = None, mn_major_scales: bool = False,
                         pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul_fp8.py: SiLU·mul (silu_and_mul_ref) then quantized for an FP8 GEMM."""
    return quantize_fp8_layout_ref(silu_and_mul_ref(x), group_size, mn_major_scales, pad_rows_to)

def quantize_fp8_rows_ref(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per output channel) quantization of a weight [N, K] -> (e4m3 [N, K], fp32 [N])."""
    q, s = quantize_fp8_ref(w)
    return q, s.reshape(-1)


def dequantize_fp8_ref(w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """e4m3 [N, K] with per-row scales [N] or per-row block scales [N, ceil(K / block_k)] -> fp32."""
    if block is None:
        return w8.float() * scale.float().reshape(-1, 1)
    return w8.float() * scale.float().repeat_interleave(block[1], dim=1)[:, :w8.shape[1]]


def dequantize_moe_fp8_ref(w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                           parts: int = 1) -> torch.Tensor:
    """One expert's e4m3 matrix [parts * N, K] (w13: gate rows then up rows, parts = 2) and its
    scales in fused_moe's layout -> fp32: [parts * N, 1] one per row (block None), or for block
    (bn, bk) [parts * ceil(N / bn), ceil(K / bk)], each part's blocks starting at its first row."""
    n = w8.shape[0] // parts
    if block is None:
        return dequantize_fp8_ref(w8, scale.reshape(-1))
    rows = torch.cat([s.repeat_interleave(block[0], dim=0)[:n] for s in scale.chunk(parts)])
    return dequantize_fp8_ref(w8, rows, block)


def quantize_moe_fp8_ref(w13: torch.Tensor, w2: torch.Tensor, block: tuple[int, int] | None = None):
    """Stacked experts w13 [E, 2I, H], w2 [E, H, I] -> (e4m3 w13, e4m3 w2, w13_scale, w2_scale) in
    fused_moe's layout: one scale per row (block None: per-channel), or per block with gate and up
    each quantized alone, as a checkpoint stores them (bench/moe.py's FP8 weights)."""
    if block is None:
        q13, s13 = quantize_fp8_rows_ref(w13.reshape(-1, w13.shape[-1]))
        q2, s2 = quantize_fp8_rows_ref(w2.reshape(-1, w2.shape[-1]))
        return q13.view(w13.shape), q2.view(w2.shape), s13.view(*w13.shape[:2], 1), s2.view(*w2.shape[:2], 1)
    inter = w13.shape[1] // 2
    q13, s13, q2, s2 = [], [], [], []
    for gate_up, down in zip(w13, w2):
        (gq, gs), (uq, us) = (quantize_fp8_blocks_ref(gate_up[p * inter:(p + 1) * inter], block) for p in (0, 1))
        dq, ds = quantize_fp8_blocks_ref(down, block)
        q13.append(torch.cat([gq, uq]))
        s13.append(torch.cat([gs, us]))
        q2.append(dq)
        s2.append(ds)
    return torch.stack(q13), torch.stack(q2), torch.stack(s13), torch.stack(s2)


def fp8_scaled_mm_ref(xq: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """torch._scaled_mm with row-wise scales: (xq * x_scale[M, 1]) @ (w8 * w_scale[N])^T."""
    out = (xq.float() @ w8.float().t()) * x_scale.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)
    return out.to(out_dtype)


def fp8_block_gemm_ref(xq: torch.Tensor, x_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
                       scale_rows: int, out_dtype: torch.dtype, block_k: int = 128) -> torch.Tensor:
    """Block-scaled GEMM: xq [M, K] e4m3 with scales [M, ceil(K/block_k)] (per token and
    column group), w8 [N, K] e4m3 with scales [ceil(N/scale_rows), ceil(K/block_k)]."""
    k = xq.shape[1]
    xs = x_scale.float().repeat_interleave(block_k, dim=1)[:, :k]
    ws = w_scale.float().repeat_interleave(scale_rows, dim=0)[:w8.shape[0]].repeat_interleave(block_k, dim=1)[:, :k]
    return ((xq.float() * xs) @ (w8.float() * ws).t()).to(out_dtype)


def fp8_gemv_ref(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, scale_rows: int | None = None,
                 block_k: int = 128) -> torch.Tensor:
    """fp8_gemv.py: x (unquantized) @ (w8 * scales)^T in fp32, in x's dtype. Scales per output
    channel ([N] / [1, N]) when scale_rows is None, else [ceil(N/scale_rows), ceil(K/block_k)]."""
    n, k = w8.shape
    if scale_rows is None:
        w = w8.float() * w_scale.float().reshape(-1, 1)
    else:
        ws = w_scale.float().repeat_interleave(scale_rows, dim=0)[:n].repeat_interleave(block_k, dim=1)[:, :k]
        w = w8.float() * ws
    return (x.float() @ w.t()).to(x.dtype)


def quantize_fp8_blocks_ref(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] -> (e4m3 [N, K], fp32 scales [ceil(N/bn), ceil(K/bk)]): one scale per
    block (edge blocks partial), as DeepSeek-V3 / Qwen3-FP8 checkpoints store `weight_scale_inv`."""
    (n, k), (bn, bk) = w.shape, block
    nb, kb = -(-n // bn), -(-k // bk)
    padded = F.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))
    scale = padded.abs().view(nb, bn, kb, bk).amax(dim=(1, 3)).div(FP8_MAX).clamp(min=FP8_MIN_SCALE)
    full = scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def rms_norm_gemv_ref(
    x: torch.Tensor,  # [M, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    residual: torch.Tensor | None = None,  # [M, K]; if given, x + residual is normalised
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fused_gemv(prologue="rms_norm"): RMSNorm then the linear; (out [M, N], new residual)."""
    h, residual = rms_norm_ref(x, norm_weight, eps, residual)
    return F.linear(h, weight, bias), residual


def silu_mul_gemv_ref(
    x: torch.Tensor,  # [M, 2K]: [gate | up]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """fused_gemv(prologue="silu_mul"): SwiGLU then the linear (the down projection)."""
    return F.linear(silu_and_mul_ref(x), weight, bias)


# LoRA (worker/lora/): each token runs its own adapter's low-rank term, picked by its slot in
# the stacked adapter weights (-1: none). The references compute every slot's product and keep
# the token's own, so that no step reads the slots on the host (CUDA graphs, no syncs); that
# costs the number of slots times the one product, which the CPU path's small models afford.


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, K], a [S, K, R] (slot s's A transposed), slots [T] -> x[t] @ a[slots[t]] as fp32
    [T, R]; rows of slot -1 are zero."""
    t, (s, k, r) = x.shape[0], a.shape
    every = (x.float() @ a.float().permute(1, 0, 2).reshape(k, s * r)).view(t, s, r)
    own = every.gather(1, slots.clamp(min=0).long().view(t, 1, 1).expand(t, 1, r)).squeeze(1)
    return own * (slots >= 0).unsqueeze(1)


def _by_slice(expand, y: torch.Tensor, u: torch.Tensor, b: torch.Tensor, ends) -> torch.Tensor:
    """A packed output's expand (kernels/lora.py): slice i's columns [ends[i-1], ends[i]) take
    u's columns [i * R, (i + 1) * R) through b's rows [0, R) of those columns. `expand(y, u, b)`
    adds one slice (y and b views of its columns)."""
    if ends is None:
        return expand(y, u, b)
    r = b.shape[1]
    for i, (lo, hi) in enumerate(zip([0, *ends], ends)):
        expand(y[:, lo:hi], u[..., i * r:(i + 1) * r], b[:, :, lo:hi])
    return y


def lora_expand_ref(y: torch.Tensor, u: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                    ends=None) -> torch.Tensor:
    """y [T, N] += u [T, R] @ b[slots[t]] (b [S, R, N]) in place, summed in fp32 and rounded once
    into y's dtype; rows of slot -1 are left as they are. Returns y. `ends`: a packed output's
    slices (u [T, slices * R]; see _by_slice)."""

    def one(y, u, b):
        t, (s, r, n) = y.shape[0], b.shape
        onehot = F.one_hot(slots.clamp(min=0).long(), s).float() * (slots >= 0).unsqueeze(1)  # [T, S]
        spread = (onehot.unsqueeze(-1) * u.float().unsqueeze(1)).reshape(t, s * r)
        y.copy_((y.float() + spread @ b.float().reshape(s * r, n)).to(y.dtype))
        return y

    return _by_slice(one, y, u, b, ends)


# The same two halves by segment (kernels/lora_sgmv.py): runs of tokens that share one adapter,
# starts [G + 1] and slots [G]. Only each segment's own product is computed; the bounds are read
# on the host, which the eager steps that use segments have built there (no sync on the CPU).


def lora_shrink_sgmv_ref(x: torch.Tensor, a: torch.Tensor, starts: torch.Tensor, seg_slots: torch.Tensor,
                         max_len: int = 0) -> torch.Tensor:
    """x [T, K], a [S, K, R] -> [T, R] fp32: x[t] @ a[slot of t's segment]; base segments' rows zero.
    `max_len` is the kernel's grid bound, unused here."""
    u = torch.zeros(x.shape[0], a.shape[2], dtype=torch.float32, device=x.device)
    bounds = starts.tolist()
    for g, slot in enumerate(seg_slots.tolist()):
        if slot >= 0 and bounds[g + 1] > bounds[g]:
            u[bounds[g]:bounds[g + 1]] = x[bounds[g]:bounds[g + 1]].float() @ a[slot].float()
    return u


def lora_expand_sgmv_ref(y: torch.Tensor, u: torch.Tensor, b: torch.Tensor, starts: torch.Tensor,
                         seg_slots: torch.Tensor, max_len: int = 0, ends=None) -> torch.Tensor:
    """y [T, N] += u [T, R] @ b[slot of t's segment] in place, summed in fp32 and rounded once into
    y's dtype; base segments' rows left as they are. Returns y. `ends`: as lora_expand_ref's."""
    bounds = starts.tolist()

    def one(y, u, b):
        for g, slot in enumerate(seg_slots.tolist()):
            s, e = bounds[g], bounds[g + 1]
            if slot >= 0 and e > s:
                y[s:e] = (y[s:e].float() + u[s:e].float() @ b[slot].float()).to(y.dtype)
        return y

    return _by_slice(one, y, u, b, ends)
