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


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, in float64; NaN anywhere in out fails outright."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert not torch.isnan(out).any(), "output has NaN: unwritten elements or broken math"
    o, r = out.double().cpu(), ref.double().cpu()
    return ((o - r).norm() / r.norm()).item()


# Tolerances against a reference computed in fp32 or better from the same (rounded) inputs.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
