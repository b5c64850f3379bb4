"""fused_moe with FP8 (e4m3) expert weights (W8A16): both paths (sorted grouped GEMM, decode GEMVs),
each scale format, expert parallelism, equal the reference on the dequantized weights; the
reference's own FP8 path is the dequantized weights exactly.

Block scales use a small block (16 rows x 32 columns) so that tiny shapes have several row and
column groups, partial ones at the edges (inter 40: gate's third block row has 8 rows, and up's
blocks start at its own first row); the kernels take the block shape as a parameter.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.fused_moe import fused_moe, fused_moe_routed
from pdserve.kernels.reference import (FP8_MAX, dequantize_moe_fp8_ref, fused_moe_ref, fused_moe_routed_ref,
                                       quantize_moe_fp8_ref)
from tests.kernels.kernel_inputs import DEVICE, rel_error
from tests.kernels.test_fused_moe import moe_inputs

BLOCK = (16, 32)
SORTED_TILES = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=2)
DECODE_TILES = dict(GU_BLOCK_N=16, GU_BLOCK_K=32, GU_WARPS=4, DOWN_BLOCK_N=16, DOWN_BLOCK_K=32, DOWN_WARPS=4)


def quantize_experts(w13: torch.Tensor, w2: torch.Tensor, fmt: str):
    """Stacked experts -> (e4m3 w13, e4m3 w2, w13_scale, w2_scale, block) in fused_moe's layout."""
    if fmt != "tensor":
        block = BLOCK if fmt == "block" else None
        return (*quantize_moe_fp8_ref(w13, w2, block), block)

    def one(w):  # per tensor: its one scale in every row, as models/moe.py stores it
        s = (w.abs().amax() / FP8_MAX).float()
        return (w.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s.expand(w.shape[0], 1)

    inter = w13.shape[1] // 2
    q13, s13, q2, s2 = [], [], [], []
    for e in range(w13.shape[0]):
        parts = [one(w13[e, :inter]), one(w13[e, inter:]), one(w2[e])]
        q13.append(torch.cat([parts[0][0], parts[1][0]]))
        s13.append(torch.cat([parts[0][1], parts[1][1]]))
        q2.append(parts[2][0])
        s2.append(parts[2][1])
    return torch.stack(q13), torch.stack(q2), torch.stack(s13).contiguous(), torch.stack(s2).contiguous(), None


def dequantized(q13, q2, s13, s2, block):
    return (torch.stack([dequantize_moe_fp8_ref(q13[e], s13[e], block, parts=2) for e in range(q13.shape[0])]),
            torch.stack([dequantize_moe_fp8_ref(q2[e], s2[e], block) for e in range(q2.shape[0])]))


@pytest.mark.parametrize("fmt", ["block", "channel", "tensor"])
@pytest.mark.parametrize("path,t,drop,offset", [("sorted", 13, 0.0, 0), ("decode", 3, 0.3, 4)])
def test_fp8_kernel_matches_dequantized_reference(poison_empty, fmt, path, t, drop, offset):
    # 8 experts in the routing; this op holds [offset, offset + 4) of them when offset > 0 (expert
    # parallelism), ids of -1 (drop) held nowhere. h 64 = two K groups of the block scales.
    x, w13, w2, w, ids = moe_inputs(t, 64, 40, 8, 2, dtype=torch.bfloat16, drop=drop)
    held = slice(offset, offset + 4) if offset else slice(None)
    q13, q2, s13, s2, block = quantize_experts(w13[held].float(), w2[held].float(), fmt)
    tiles = SORTED_TILES if path == "sorted" else DECODE_TILES
    out = fused_moe(x, q13, q2, w, ids, config=tiles, expert_offset=offset, path=path, w13_scale=s13, w2_scale=s2,
                    block=block)
    d13, d2 = dequantized(q13, q2, s13, s2, block)
    ref = fused_moe_ref(x.double(), d13.double(), d2.double(), w, ids, expert_offset=offset)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    # bf16 activations and dequantized weights; the interpreter truncates fp32 -> bf16 (test_fused_moe's 2.5e-2).
    assert rel_error(out, ref) < 2.5e-2
    if drop:
        assert (out[(ids < 0).all(dim=1)] == 0).all()
    # The reference's FP8 path is the reference on the weights dequantized to x's dtype, exactly.
    xf = x.float()
    assert torch.equal(fused_moe_ref(xf, q13, q2, w, ids, offset, s13, s2, block),
                       fused_moe_ref(xf, d13, d2, w, ids, expert_offset=offset))


@pytest.mark.parametrize("fmt", ["block", "channel"])
def test_fp8_decode_down_split_matches_dequantized_reference(poison_empty, fmt):
    # The split down pass (DOWN_SPLIT_K) on FP8 weights: each step's sums scaled by its group (block)
    # or row (channel) scale, as the one-program down pass does.
    x, w13, w2, w, ids = moe_inputs(3, 64, 64, 4, 2, dtype=torch.bfloat16, drop=0.3)
    q13, q2, s13, s2, block = quantize_experts(w13.float(), w2.float(), fmt)
    out = fused_moe(x, q13, q2, w, ids, config=dict(DECODE_TILES, DOWN_SPLIT_K=2), path="decode", w13_scale=s13,
                    w2_scale=s2, block=block)
    d13, d2 = dequantized(q13, q2, s13, s2, block)
    assert rel_error(out, fused_moe_ref(x.double(), d13.double(), d2.double(), w, ids)) < 2.5e-2
    here = fused_moe(x, q13, q2, w, ids, config=dict(DECODE_TILES, DOWN_SPLIT_K=2, DOWN_REDUCE_HERE=True),
                     path="decode", w13_scale=s13, w2_scale=s2, block=block)
    assert torch.equal(here, out)  # the partials summed in the launch, in the finish launch's order


def test_fp8_routed_op_and_default_tiles(poison_empty):
    # The model's op with the default tiles (decode at 2 tokens; 6: routing + sort in one launch),
    # real 128 x 128 blocks: K tiles of the defaults stay within a scale group.
    for t in (2, 6):
        x, w13, w2, _, _ = moe_inputs(t, 256, 64, 4, 2, seed=t)
        logits = torch.randn(t, 4, generator=torch.Generator().manual_seed(t)).to(DEVICE)
        q13, q2, s13, s2 = quantize_moe_fp8_ref(w13, w2, (128, 128))
        fp8 = dict(w13_scale=s13, w2_scale=s2, block=(128, 128))
        out = fused_moe_routed(x.bfloat16(), q13, q2, logits, 2, True, **fp8)
        ref = fused_moe_routed_ref(x.double(), q13, q2, logits, 2, True, **fp8)
        assert rel_error(out, ref) < 2.5e-2


def test_fp8_arguments_are_checked():
    x, w13, w2, w, ids = moe_inputs(3, 64, 40, 4, 2)
    q13, q2, s13, s2, block = quantize_experts(w13, w2, "block")
    with pytest.raises(ValueError, match="e4m3 weights take w13_scale and w2_scale"):
        fused_moe(x, q13, q2, w, ids)
    with pytest.raises(ValueError, match="w13_scale has shape"):
        fused_moe(x, q13, q2, w, ids, w13_scale=s13[:, :3], w2_scale=s2, block=block)
    with pytest.raises(ValueError, match=r"K tiles \[64\] must divide the scales' 32 columns"):
        fused_moe(x, q13, q2, w, ids, config=dict(SORTED_TILES, BLOCK_K=64), w13_scale=s13, w2_scale=s2, block=block)
    with pytest.raises(TypeError, match="w2 has dtype"):
        fused_moe(x, q13, w2, w, ids, w13_scale=s13, w2_scale=s2, block=block)
