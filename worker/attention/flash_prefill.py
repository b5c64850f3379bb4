"""Prefill attention on torch's FlashAttention (`torch.nn.attention.varlen.varlen_attn`), opt-in.

The Triton prefill kernel (kernels/paged_prefill_attention.py) reads K/V through the block tables
and runs at 55-60% of FlashAttention on contiguous K/V (docs/kernels.md); on Llama-3.1-8B's offline
1024/128 it is the one part of the GPU's time not at its hardware rate (0.37 of 8.56 s on an H100:
docs/results/engine/2026-12-07-h100-issue50-rows.md), and it grows with the prompt. This path
gathers each prefill row's whole context (cached prefix, earlier chunks and the step's own
tokens, already written to the cache) into contiguous K/V with one gather per tensor, then
runs FlashAttention over `cu_seqlens`: causal with the mask aligned to the bottom right, so a
chunk's queries sit at the end of their context as in the paged kernel. The gather's slots come
from the host at plan time (`flash_inputs`), so nothing here syncs.

Taken by the Triton backend where `PDSERVE_FLASH_PREFILL=1` and the step allows it: bf16 / fp16,
an unquantized cache, no attention sinks, no sliding window (those layers keep the Triton kernel),
a step whose gathered K/V fit half the profiled activation peak (ModelRunner._flash_max_keys),
and a torch whose FlashAttention runs on the card (probed once at start). Off by default until
it is measured on a GPU (`bash tools/gpu/flash_prefill.sh`). FlashAttention runs on CUDA only: on CPU the
tests swap in `varlen_attention_ref`, the same contract in torch.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger(__name__)

ENABLED = os.environ.get("PDSERVE_FLASH_PREFILL", "0").strip() in ("1", "true", "on")


@dataclass(frozen=True)
class FlashPrefill:
    """A step's prefill rows as FlashAttention reads them (AttentionMetadata.flash)."""

    # Each row's context, row after row ([sum(context_lens)] int64): the cache block and the
    # position in it of every key (a layer's cache view strides over the other layers' blocks).
    kv_blocks: torch.Tensor
    kv_offsets: torch.Tensor
    cu_seqlens_k: torch.Tensor  # [rows + 1] int32: offsets of the rows' contexts in kv_blocks
    max_q: int  # the longest chunk of queries
    max_k: int  # the longest context


def flash_inputs(tables: list[list[int]], context_lens: list[int], cu_seqlens_q: list[int], block_size: int,
                 to_device) -> FlashPrefill:
    """FlashPrefill from the host's plan: `tables` each prefill row's block ids (padded),
    `context_lens` its context's length after the step, `cu_seqlens_q` its chunk's offsets;
    `to_device(data, dtype)` uploads a list or array (the runner's one copy per input)."""
    blocks = [np.repeat(np.asarray(table[:-(-n // block_size)], dtype=np.int64), block_size)[:n]
              for table, n in zip(tables, context_lens)]
    offsets = np.arange(max(context_lens, default=0), dtype=np.int64) % block_size
    cu_k = np.zeros(len(context_lens) + 1, dtype=np.int32)
    np.cumsum(context_lens, out=cu_k[1:])
    chunks = np.diff(np.asarray(cu_seqlens_q))
    empty = np.zeros(0, np.int64)
    return FlashPrefill(to_device(np.concatenate(blocks) if blocks else empty, torch.int64),
                        to_device(np.concatenate([offsets[:n] for n in context_lens]) if blocks else empty,
                                  torch.int64),
                        to_device(cu_k, torch.int32), int(chunks.max(initial=0)), int(max(context_lens, default=0)))


def varlen_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         cu_seqlens_k: torch.Tensor, scale: float) -> torch.Tensor:
    """FlashAttention's varlen contract in torch (fp32 math): row i's queries q[cu_q[i]:cu_q[i+1]]
    are the last of its keys k[cu_k[i]:cu_k[i+1]] (causal, bottom-right aligned); GQA by head groups."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        n, ctx = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if n == 0:
            continue
        qi = q[cq[i]:cq[i + 1]].transpose(0, 1).float()  # [Hq, n, D]
        ki = k[ck[i]:ck[i + 1]].repeat_interleave(group, dim=1).transpose(0, 1).float()
        vi = v[ck[i]:ck[i + 1]].repeat_interleave(group, dim=1).transpose(0, 1).float()
        scores = (qi @ ki.transpose(1, 2)) * scale
        hidden = torch.arange(ctx, device=q.device)[None, :] > torch.arange(ctx - n, ctx, device=q.device)[:, None]
        scores.masked_fill_(hidden, float("-inf"))
        out[cq[i]:cq[i + 1]] = (scores.softmax(-1) @ vi).transpose(0, 1).to(q.dtype)
    return out


@functools.cache
def _varlen_attn():
    """torch's varlen FlashAttention as f(q, k, v, cu_q, cu_k, max_q, max_k, scale) -> out, or None
    where this torch has none. Its causal switch moved between releases (`is_causal`, then
    `window_size=(-1, 0)`): both are bottom-right aligned."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    gqa = {"enable_gqa": True} if "enable_gqa" in params else {}

    def attend(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, **causal, **gqa)

    return attend


def flash_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, flash: FlashPrefill, scale: float) -> torch.Tensor:
    """q [T, Hq, D] (the step's prefill rows) over the contexts `flash` names in the caches
    [blocks, block_size, Hkv, D] -> [T, Hq, D]."""
    k = k_cache[flash.kv_blocks, flash.kv_offsets]  # [sum(context_lens), Hkv, D], contiguous
    v = v_cache[flash.kv_blocks, flash.kv_offsets]
    return _varlen_attn()(q, k, v, cu_seqlens_q, flash.cu_seqlens_k, flash.max_q, flash.max_k, scale)


def flash_available(device: torch.device, dtype: torch.dtype, head_dim: int, kv_heads: int) -> bool:
    """Whether this torch's FlashAttention runs here for this cache's heads (two query heads to
    one KV head: GQA): one small call, at start."""
    attend = _varlen_attn()
    if device.type != "cuda" or attend is None or dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        q = torch.zeros(32, 2 * kv_heads, head_dim, dtype=dtype, device=device)
        kv = torch.zeros(48, kv_heads, head_dim, dtype=dtype, device=device)
        cu_q = torch.tensor([0, 16, 32], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 16, 48], dtype=torch.int32, device=device)
        attend(q, kv, kv, cu_q, cu_k, 16, 32, head_dim ** -0.5)
        torch.cuda.synchronize(device)
        return True
    except Exception as e:  # an old card, a torch built without it: the Triton kernel serves
        log.warning("flash prefill: unavailable here (%s: %s); the Triton prefill kernel serves", type(e).__name__, e)
        return False
