"""mla_decode: the Triton absorbed-MLA decode kernel against reference.mla_decode_ref (under the
interpreter on CPU), on a strided per-layer view of a latent cache."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.mla_decode import mla_decode
from pdserve.kernels.reference import mla_decode_ref
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
