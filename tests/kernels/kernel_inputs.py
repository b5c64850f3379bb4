"""Inputs shaped like the engine's, and the error measure, for the kernel tests."""

from __future__ import annotations

import torch

# Tier 4 (a CUDA machine) runs the kernels compiled; CI runs them under the interpreter on CPU.
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"

# Relative-error bounds against a reference computed in fp32 or better from the same inputs.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def paged_kv(num_blocks: int, num_layers: int, block_size: int, hkv: int, d: int, dtype, layer: int = 1):
    """K/V caches laid out like the engine's: one [blocks, layers, 2, block_size, Hkv, D] tensor,
    so a layer's block is not contiguous with the next block (block stride > block bytes)."""
    cache = torch.randn(num_blocks, num_layers, 2, block_size, hkv, d, dtype=dtype, device=DEVICE)
    return cache, cache[:, layer, 0], cache[:, layer, 1]


def block_tables_for(context_lens: list[int], block_size: int, num_blocks: int, extra: int = 1) -> torch.Tensor:
    """Random distinct blocks per sequence, padded with a valid id; `extra` unused columns at the end."""
    need = [-(-c // block_size) for c in context_lens]
    width = max(need) + extra
    perm = torch.randperm(num_blocks)
    rows, used = [], 0
    for n in need:
        ids = perm[used : used + n].tolist()
        used += n
        rows.append(ids + [ids[0] if ids else 0] * (width - n))
    assert used <= num_blocks, "test bug: not enough blocks"
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


def bad_argument_inputs(num_queries: int):
    """Small valid inputs that an argument check test spoils one at a time: (k_cache, v_cache, q,
    block_tables, context_lens) for 2 sequences (contexts 3 and 5), 4 query heads on 2 KV heads
    of dim 16, block size 4, `num_queries` query tokens."""
    _, k_cache, v_cache = paged_kv(8, 1, 4, 2, 16, torch.float32, layer=0)
    q = torch.randn(num_queries, 4, 16, device=DEVICE)
    block_tables = torch.zeros(2, 3, dtype=torch.int32, device=DEVICE)
    context_lens = torch.tensor([3, 5], dtype=torch.int32, device=DEVICE)
    return k_cache, v_cache, q, block_tables, context_lens


def cos_sin_cache(max_pos: int, d: int) -> torch.Tensor:
    """The rotary table the engine builds (base 10000): [max_pos, d] = cos | sin, computed in float64."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], -1).float().to(DEVICE)


def fused_qkv(t: int, hq: int, hkv: int, d: int, dtype):
    """q, k, v as the engine has them: views into one [T, (Hq + 2 Hkv) * D] projection output."""
    qkv = torch.randn(t, (hq + 2 * hkv) * d, dtype=dtype, device=DEVICE)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


def qk_norm_weights(d: int, dtype, g: torch.Generator | None = None, eps: float = 1e-6):
    """A Qwen3-like qk_norm argument (q weight [D], k weight [D], eps): weights around 1, distinct
    per element and between q and k, so a kernel that mixes them up or drops one fails."""
    return tuple((1 + 0.5 * torch.randn(d, generator=g)).to(dtype).to(DEVICE) for _ in range(2)) + (eps,)


def as_double(qk_norm):
    """qk_norm's weights in float64, for a reference computed in float64."""
    return None if qk_norm is None else (qk_norm[0].double(), qk_norm[1].double(), qk_norm[2])


def assert_matches_separate_norm(fused: torch.Tensor, separate: torch.Tensor) -> None:
    """A kernel with the q/k norm fused against kernels/rms_norm.py followed by the same kernel
    without it: the same roundings, the sum of squares perhaps in another order (an fp32 ulp of
    rstd). In bf16 such an ulp almost never reaches a rounded value (skipping the norm's own
    roundings makes about half of them differ); in fp32 it shows in the last bits only."""
    if fused.dtype == torch.float32:
        assert rel_error(fused, separate.double()) < 1e-6
    else:
        assert (fused != separate).float().mean() < 0.01


def slots_of(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """The cache slot of each sequence's token at `positions` (one per row of `block_tables`)."""
    return torch.stack([block_tables[i, p // block_size].long() * block_size + p % block_size
                        for i, p in enumerate(positions.tolist())])


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, in float64; NaN anywhere in out fails outright."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert not torch.isnan(out).any(), "output has NaN: unwritten elements or broken math"
    o, r = out.double().cpu(), ref.double().cpu()
    return ((o - r).norm() / r.norm()).item()



def lora_packed(widths: list[int], ranks: list[int], max_rank: int, k: int, dtype, g: torch.Generator):
    """A packed LoRA linear's stacks as worker/lora/layer.py fills them: parts of `widths` output
    columns (q | k | v: k and v narrower under GQA), slot s an adapter of rank ranks[s] <= max_rank
    (zeros past it). Returns (a [S, K, parts * R], b [S, R, N], ends, per_part) where per_part[s][i]
    is part i's own (A [K, r], B [r, width]) of slot s: the unfused math to compare against."""
    ends = torch.tensor(widths).cumsum(0).tolist()
    a = torch.zeros(len(ranks), k, len(widths) * max_rank)
    b = torch.zeros(len(ranks), max_rank, ends[-1])
    per_part = []
    for s, r in enumerate(ranks):
        mine = []
        for i, (lo, hi) in enumerate(zip([0, *ends], ends)):
            pa = torch.randn(k, r, generator=g).to(dtype).float()
            pb = torch.randn(r, hi - lo, generator=g).to(dtype).float()
            a[s, :, i * max_rank:i * max_rank + r] = pa
            b[s, :r, lo:hi] = pb
            mine.append((pa, pb))
        per_part.append(mine)
    return a.to(dtype).to(DEVICE), b.to(dtype).to(DEVICE), ends, per_part


def lora_unfused(x: torch.Tensor, y0: torch.Tensor, slots: list[int], ends: list[int], per_part) -> torch.Tensor:
    """y0 + each part's own x @ A @ B per token, in fp32 (slot -1: y0's row as it is)."""
    y = y0.float().clone()
    for t, s in enumerate(slots):
        if s >= 0:
            for (lo, hi), (pa, pb) in zip(zip([0, *ends], ends), per_part[s]):
                y[t, lo:hi] += (x[t].float().cpu() @ pa @ pb).to(y.device)
    return y
