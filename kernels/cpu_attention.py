"""Paged attention for the CPU engine: the references' math (reference.py), laid out for the CPU.

The references are the oracle and read clearly; these compute the same sums in fewer, larger
ops, which is what a CPU step's time goes to at batch 8-32:

- decode: a sequence's blocks are gathered with one `index_select` over the block dimension
  (each block is one contiguous span of the cache; advanced indexing copies element-wise and
  was 5x slower), then turned into fp32 [B, Hkv, L, D] in the same pass, so the scores and the
  weighted sum are each one batched matmul over (sequence, KV head) with the query heads of a
  KV head as the matmul's rows. The reference's einsums permuted K and V again inside. A large
  batch runs in chunks of sequences whose fp32 K and V stay within the CPU's caches
  (DECODE_CHUNK_BYTES): at 32 sequences of 272 tokens one pass over the batch (13 MB of fp32 K
  and V per layer) took 2x the time of four passes of 8.
- prefill: torch's fused CPU attention (scaled_dot_product_attention: blockwise, no [Hq, n, L]
  score tensor, KV heads shared by their query heads) per sequence, with the causal mask of a
  chunk that follows cached tokens. A model with attention sinks keeps the reference.

Math in fp32 as the references do (scores and softmax), whatever the cache's element type.

A bf16 decode (no sinks, no window) runs the native kernel instead (cpu_native.py,
cpu_decode_attention.c) where this machine could build it: the same fp32 math reading K and V
straight from the cache blocks, no gathered copy. Other element types (fp32: the equality tests'
bit-for-bit path; fp8) keep the torch ops.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_native
from pdserve.kernels.reference import (
    FP8_KV_DTYPE,
    kv_cache_write_ref,
    paged_prefill_attention_ref,
    quantize_kv,
    softmax_with_sinks,
)

# The gathered fp32 K and V of one chunk of a decode batch: a few MB, within the caches' reach
# (8 sequences of 272 tokens, SmolLM2's 3 KV heads of 64, are 3.3 MB).
DECODE_CHUNK_BYTES = 4 << 20


def kv_cache_write_cpu(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int; -1 = skip
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """= kv_cache_write_ref. A bf16 cache: one native call (row copies, slot -1 skipped). Else,
    when no row is skipped (every decode step), the rows are written as they are: the reference's
    boolean mask costs three `nonzero` passes per layer."""
    if _native_write_fits(key, value, k_cache, v_cache, k_scale, v_scale):
        lib = cpu_native.library()
        if lib is not None:
            slots = slot_mapping if slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() \
                else slot_mapping.to(torch.int64).contiguous()
            cs = k_cache.stride()
            lib.kv_write_bf16(key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0),
                              value.stride(1), slots.data_ptr(), key.shape[0], k_cache.data_ptr(), v_cache.data_ptr(),
                              cs[0], cs[1], cs[2], key.shape[1], key.shape[2], k_cache.shape[1])
            return
    slots = slot_mapping.long()
    if slots.numel() == 0 or int(slots.min()) < 0:
        kv_cache_write_ref(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = quantize_kv(key, k_cache.dtype, k_scale)
    v_cache[blocks, offsets] = quantize_kv(value, v_cache.dtype, v_scale)


def _native_write_fits(key, value, k_cache, v_cache, k_scale, v_scale) -> bool:
    return (key.dtype == value.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16 and k_scale is None
            and v_scale is None and key.dim() == 3 and key.shape == value.shape and key.stride(-1) == 1
            and value.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
            and key.device.type == "cpu")


def _gathered(cache: torch.Tensor, blocks: torch.Tensor, B: int, scale: torch.Tensor | None) -> torch.Tensor:
    """[B * nblk] block ids -> fp32 [B, Hkv, nblk * block_size, D], one copy per step and layer."""
    _, bs, Hkv, D = cache.shape
    rows = cache.index_select(0, blocks).view(B, -1, Hkv, D).transpose(1, 2)
    out = torch.empty(rows.shape, dtype=torch.float32)
    out.copy_(rows)
    if cache.dtype == FP8_KV_DTYPE and scale is not None:  # as dequantize_kv
        out.mul_(scale.float())
    return out


def paged_decode_attention_cpu(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32, padded with any valid id
    context_lens: torch.Tensor,  # [B] int32, tokens in cache incl. the current one
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:  # [B, Hq, D]
    """= paged_decode_attention_ref (its arguments and masks)."""
    if sinks is None and window == 0 and _native_fits(q, k_cache, v_cache):
        lib = cpu_native.library()
        if lib is not None:
            return _decode_native(lib, q, k_cache, v_cache, block_tables, context_lens, scale)
    B, _, D = q.shape
    per_seq = 2 * 4 * k_cache.shape[2] * D * int(context_lens.max())  # one sequence's fp32 K and V
    chunk = max(1, DECODE_CHUNK_BYTES // max(1, per_seq))
    if B > chunk:
        parts = [slice(i, i + chunk) for i in range(0, B, chunk)]
        return torch.cat([_decode(q[p], k_cache, v_cache, block_tables[p], context_lens[p], scale, k_scale, v_scale,
                                  sinks, window) for p in parts])
    return _decode(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale, sinks, window)



def _native_fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (q.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16 and q.shape[-1] % 16 == 0
            and q.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
            and q.shape[1] % k_cache.shape[2] == 0)


def _decode_native(lib, q, k_cache, v_cache, block_tables, context_lens, scale):
    """The native kernel over the batch, split over torch's intra-op threads (ctypes drops the GIL)."""
    B, Hq, D = q.shape
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    tables = block_tables if block_tables.dtype == torch.int32 and block_tables.stride(-1) == 1 \
        else block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty(B, Hq, D, dtype=torch.float32)
    # Scratch per call: the scores of the longest context the tables can hold, the queries, a row.
    need = Hq * (tables.shape[1] * bs + D) + Hkv * D
    cs = k_cache.stride()

    def run(lo: int, hi: int) -> None:
        lib.paged_decode_bf16(q[lo].data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                              cs[0], cs[1], cs[2], tables[lo].data_ptr(), tables.stride(0), lens[lo].data_ptr(),
                              hi - lo, Hq, Hkv, D, bs, scale, out[lo].data_ptr(),
                              cpu_native.scratch_floats(need).data_ptr())

    cpu_native.run_balanced(lens, min(B, cpu_native.threads()), run)
    return out.to(q.dtype)


def _decode(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale, sinks, window):
    B, Hq, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    nblk = (int(context_lens.max()) + block_size - 1) // block_size
    blocks = block_tables[:, :nblk].reshape(-1).long()
    k = _gathered(k_cache, blocks, B, k_scale)  # [B, Hkv, L, D], L = nblk * block_size
    v = _gathered(v_cache, blocks, B, v_scale)
    qg = q.float().reshape(B, Hkv, group, D)
    scores = torch.matmul(qg, k.transpose(2, 3)).mul_(scale)  # [B, Hkv, group, L]
    pos = torch.arange(k.shape[2])
    ctx = context_lens.long()[:, None, None, None]
    hidden = pos >= ctx
    if window > 0:  # the query sits at ctx - 1: keys at positions > query - window stay
        hidden |= pos < ctx - window
    scores.masked_fill_(hidden, float("-inf"))
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.reshape(Hkv, group, 1))
    return torch.matmul(probs, v).reshape(B, Hq, D).to(q.dtype)


def paged_prefill_attention_cpu(
    q: torch.Tensor,  # [T, Hq, D], T = cu_seqlens_q[-1]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor,  # [B+1] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:  # [T, Hq, D]
    """= paged_prefill_attention_ref (its arguments and masks)."""
    if sinks is None and window == 0 and cpu_native.step_invariant() and _native_fits(q, k_cache, v_cache):
        lib = cpu_native.library()
        if lib is not None:
            return _prefill_native(lib, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale)
    if sinks is not None:  # no sink logit in the fused op
        return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale,
                                           k_scale, v_scale, sinks=sinks, window=window)
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    cu = cu_seqlens_q.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        s, e = cu[i], cu[i + 1]
        n = e - s
        if n == 0:
            continue
        nblk = (ctx + block_size - 1) // block_size
        lo = max(ctx - n - window + 1, 0) if window > 0 else 0  # the first key any query sees
        blocks = block_tables[i, :nblk].long()
        k = _gathered(k_cache, blocks, 1, k_scale)[:, :, lo:ctx]  # [1, Hkv, ctx - lo, D]
        v = _gathered(v_cache, blocks, 1, v_scale)[:, :, lo:ctx]
        qi = q[s:e].float().transpose(0, 1)[None]  # [1, Hq, n, D]
        mask = None
        if window > 0 or ctx - lo != n:  # the plain causal square is SDPA's is_causal
            q_pos = torch.arange(ctx - n, ctx)[:, None]
            k_pos = torch.arange(lo, ctx)[None, :]
            mask = k_pos <= q_pos
            if window > 0:
                mask &= k_pos > q_pos - window
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                           enable_gqa=True)
        out[s:e] = o[0].transpose(0, 1).to(q.dtype)
    return out


def _prefill_native(lib, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale):
    """A prompt chunk's attention as the decode kernel's, one query token at a time: query i of a
    sequence with `ctx` tokens cached (its chunk's `n` included) reads the first ctx - n + i + 1
    keys, the causal mask. Each query's sums are then the ones a decode step (or any other chunking
    of the prompt) computes for that token: cpu_native.step_invariant. The chunk's K and V are in
    the cache already (PagedBackend.forward writes them first)."""
    tables, lens = _query_plan(q.shape[0], block_tables, cu_seqlens_q, context_lens)
    return _decode_native(lib, q, k_cache, v_cache, tables, lens, scale)


_plan_memo: list = [None]  # (copies of the metadata tensors, (tables, lens)), swapped whole: threads share it


def _query_plan(T: int, block_tables, cu_seqlens_q, context_lens):
    """Each query token's block table and key count. Every layer of a step passes the same
    metadata, so the plan is made once a step (compared by value: 3 small equality checks
    cost less than the plan, and no tensor's identity or version is trusted)."""
    key = (block_tables, cu_seqlens_q, context_lens)
    memo = _plan_memo[0]
    if memo is not None and all(torch.equal(a, b) for a, b in zip(memo[0], key)):  # (False on other shapes)
        return memo[1]
    counts = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(len(counts)), counts, output_size=T)
    first = (context_lens.long() - counts)[seq]  # keys cached before each query's chunk
    lens = (first + torch.arange(T) - cu_seqlens_q[:-1].long()[seq] + 1).to(torch.int32)
    tables = block_tables.index_select(0, seq).to(torch.int32).contiguous()
    _plan_memo[0] = (tuple(t.clone() for t in key), (tables, lens))
    return tables, lens
