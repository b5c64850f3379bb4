"""mla_decode and mla_cache_write: the Triton absorbed-MLA decode kernel and the latent cache write
against reference.mla_decode_ref / mla_cache_write_ref (under the interpreter on CPU), on a strided
per-layer view of a latent cache, of the model's dtype or fp8 (--kv-cache-dtype fp8)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.mla_cache_write import mla_cache_write
from pdserve.kernels.mla_decode import MlaDecodeConfig, mla_decode, mla_decode_config
from pdserve.kernels.reference import FP8_KV_DTYPE, mla_cache_write_ref, mla_decode_ref
from tests.kernels.kernel_inputs import DEVICE, TOL, block_tables_for, rel_error


# (heads, R, P, block size, context lengths): heads not a multiple of the head block, R and P
# padded to powers of two, 1-token and multi-tile contexts; splits past the tiles leave empty ones.
@pytest.mark.parametrize("h,r,p,bs,ctx,splits", [
    (4, 32, 8, 4, [1, 23, 9], 1),
    (20, 48, 16, 5, [37, 2], 3),
    (4, 32, 8, 4, [5, 40], 7),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(h, r, p, bs, ctx, splits, dtype):
    torch.manual_seed(0)
    num_blocks = sum(-(-c // bs) for c in ctx) + 3
    # Two layers per block, one entry of one "head": the layer's view is strided like the engine's.
    cache = torch.randn(num_blocks, 2, 1, bs, 1, r + p, dtype=dtype, device=DEVICE)[:, 1, 0]
    block_tables = block_tables_for(ctx, bs, num_blocks)
    context_lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(ctx), h, r, dtype=dtype, device=DEVICE)
    q_pe = torch.randn(len(ctx), h, p, dtype=dtype, device=DEVICE)
    scale = (r + p) ** -0.5
    out = mla_decode(q, q_pe, cache, block_tables, context_lens, scale, num_splits=splits)
    ref = mla_decode_ref(q.float(), q_pe.float(), cache.float(), block_tables, context_lens, scale)
    assert out.dtype == dtype and out.shape == (len(ctx), h, r)
    assert rel_error(out, ref) < TOL[dtype]


def test_refuses_a_cache_of_the_wrong_width():
    q, q_pe = torch.zeros(1, 4, 32), torch.zeros(1, 4, 8)
    with pytest.raises(ValueError, match=r"mla_decode: cache has shape \[2, 4, 1, 41\]"):
        mla_decode(q, q_pe, torch.zeros(2, 4, 1, 41), torch.zeros(1, 2, dtype=torch.int32),
                   torch.ones(1, dtype=torch.int32), 0.1)


def _latent_cache(num_blocks: int, bs: int, width: int, dtype) -> torch.Tensor:
    # Two layers per block, one entry of one "head": the layer's view is strided like the engine's.
    return (torch.randn(num_blocks, 2, 1, bs, 1, width, device=DEVICE) * 3).to(dtype)[:, 1, 0]


# fp8: the kernel reads the same e4m3 bytes as the reference, widened exactly; the one scale
# (None = 1, a power of two, an arbitrary one) multiplies scores and output.
@pytest.mark.parametrize("kv_scale", [None, 0.5, 0.37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_matches_reference(dtype, kv_scale):
    torch.manual_seed(1)
    h, r, p, bs, ctx = 20, 48, 16, 4, [37, 2, 9]
    num_blocks = sum(-(-c // bs) for c in ctx) + 2
    cache = _latent_cache(num_blocks, bs, r + p, FP8_KV_DTYPE)
    block_tables = block_tables_for(ctx, bs, num_blocks)
    context_lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(ctx), h, r, dtype=dtype, device=DEVICE) * 0.1
    q_pe = torch.randn(len(ctx), h, p, dtype=dtype, device=DEVICE) * 0.1
    s = None if kv_scale is None else torch.tensor([kv_scale], device=DEVICE)
    scale = (r + p) ** -0.5
    out = mla_decode(q, q_pe, cache, block_tables, context_lens, scale, num_splits=3, kv_scale=s)
    ref = mla_decode_ref(q.float(), q_pe.float(), cache, block_tables, context_lens, scale, kv_scale=s)
    assert out.dtype == dtype and rel_error(out, ref) < TOL[dtype]
    # The scale really multiplies: the same bytes read with scale 1 give another answer.
    if kv_scale is not None:
        assert rel_error(ref, mla_decode_ref(q.float(), q_pe.float(), cache, block_tables, context_lens, scale)) > 0.01


@pytest.mark.parametrize("cache_dtype,src_dtype,kv_scale", [
    (torch.float32, torch.float32, None), (torch.bfloat16, torch.bfloat16, None),
    (FP8_KV_DTYPE, torch.float32, None), (FP8_KV_DTYPE, torch.float32, 0.37), (FP8_KV_DTYPE, torch.bfloat16, 0.37)])
def test_cache_write_matches_reference_bit_for_bit(cache_dtype, src_dtype, kv_scale):
    torch.manual_seed(2)
    bs, width, t = 4, 40, 11
    s = None if kv_scale is None else torch.tensor([kv_scale], device=DEVICE)
    # Past e4m3's range (saturates), subnormal and signed-zero values among ordinary ones.
    latent = (torch.randn(t, width, device=DEVICE) * 40).to(src_dtype)
    latent[0, :4] = torch.tensor([1000.0, -1000.0, 1e-4, -0.0])
    slots = torch.tensor([5, -1, 0, 17, 3, -1, 22, 9, 12, 1, 30], device=DEVICE)
    got = _latent_cache(9, bs, width, cache_dtype)
    want = got.clone()
    mla_cache_write(latent, got, slots, s)
    mla_cache_write_ref(latent, want, slots, s)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_cache_write_refuses_a_scale_for_an_unquantized_cache():
    with pytest.raises(ValueError, match="mla_cache_write: k_scale/v_scale are for an fp8 KV cache"):
        mla_cache_write(torch.zeros(1, 8, device=DEVICE), torch.zeros(2, 4, 1, 8, device=DEVICE),
                        torch.zeros(1, dtype=torch.int64, device=DEVICE), torch.ones(1, device=DEVICE))


# Every tile shape the sweep tries (bench/deepseek.py SWEEP_TILES' heads and tokens), one split
# (written in the output's dtype, no merge) and many (the merge kernel; some splits empty), with
# heads past the last head block.
@pytest.mark.parametrize("block_h,block_n", [(16, 16), (32, 32), (64, 64)])
@pytest.mark.parametrize("splits", [1, 6, None])
def test_every_tile_matches_reference(block_h, block_n, splits):
    torch.manual_seed(3)
    h, r, p, bs, ctx = 40, 32, 16, 4, [70, 3]
    num_blocks = sum(-(-c // bs) for c in ctx) + 1
    cache = _latent_cache(num_blocks, bs, r + p, torch.float32)
    block_tables = block_tables_for(ctx, bs, num_blocks)
    context_lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(ctx), h, r, device=DEVICE) * 0.1
    q_pe = torch.randn(len(ctx), h, p, device=DEVICE) * 0.1
    out = mla_decode(q, q_pe, cache, block_tables, context_lens, 0.2, num_splits=splits,
                     config=MlaDecodeConfig(block_h=block_h, block_n=block_n))
    ref = mla_decode_ref(q, q_pe, cache, block_tables, context_lens, 0.2)
    assert rel_error(out, ref) < TOL[torch.float32]


def test_the_default_tile_takes_deepseek_heads_in_two_blocks():
    assert mla_decode_config(128).block_h == 64 and mla_decode_config(16).block_h == 16
    assert mla_decode_config(20).block_h == 32
