"""rotary: rotate-half RoPE kernel against the reference."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.reference import rotary_ref
from pdserve.kernels.rotary import rotary
from tests.kernels.kernel_inputs import DEVICE, TOL, cos_sin_cache, rel_error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 64), (6, 2, 40), (3, 1, 96)])
def test_matches_reference(poison_empty, dtype, hq, hkv, d):
    t = 9
    cache = cos_sin_cache(300, d)
    positions = torch.randint(0, 300, (t,), device=DEVICE)
    q = torch.randn(t, hq, d, dtype=dtype, device=DEVICE)
    k = torch.randn(t, hkv, d, dtype=dtype, device=DEVICE)
    q_out, k_out = rotary(positions, q, k, cache)
    # float64 reference from the same inputs: the bf16 ref rounds cos/sin and partial products.
    q_ref, k_ref = rotary_ref(positions, q.double(), k.double(), cache.double())
    assert q_out.dtype == k_out.dtype == dtype
    assert rel_error(q_out, q_ref) < TOL[dtype]
    assert rel_error(k_out, k_ref) < TOL[dtype]


def test_strided_views_offused_qkv(poison_empty):
    # The engine slices q and k out of one qkv projection: row strides exceed heads * D.
    qkv = torch.randn(5, 4 + 2 + 2, 32, device=DEVICE)
    q, k = qkv[:, :4], qkv[:, 4:6]
    positions = torch.tensor([0, 1, 2, 100, 7], dtype=torch.int32, device=DEVICE)
    cache = cos_sin_cache(128, 32)
    q_out, k_out = rotary(positions, q, k, cache)
    q_ref, k_ref = rotary_ref(positions, q, k, cache)
    assert rel_error(q_out, q_ref) < TOL[torch.float32]
    assert rel_error(k_out, k_ref) < TOL[torch.float32]
    assert torch.equal(q_out[0], q[0])  # position 0 is the identity rotation


def test_rejects_bad_arguments():
    q = torch.randn(3, 4, 32, device=DEVICE)
    k = torch.randn(3, 2, 32, device=DEVICE)
    pos = torch.arange(3, device=DEVICE)
    cache = cos_sin_cache(16, 32)
    with pytest.raises(ValueError, match="head_dim must be even, got 31"):
        rotary(pos, q[..., :31], k[..., :31], cache[:, :31])
    with pytest.raises(ValueError, match=r"cos_sin_cache has shape \[16, 16\], expected \[\*, 32\]"):
        rotary(pos, q, k, cache[:, :16])
    with pytest.raises(TypeError, match="positions has dtype float32"):
        rotary(pos.float(), q, k, cache)
    with pytest.raises(TypeError, match="k has dtype bfloat16, expected one of float32"):
        rotary(pos, q, k.bfloat16(), cache)
    with pytest.raises(ValueError, match=r"k has shape \[2, 2, 32\], expected \[3, \*, 32\]"):
        rotary(pos, q, k[:2], cache)
