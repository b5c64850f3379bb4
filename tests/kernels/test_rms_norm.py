"""rms_norm: fused residual-add + RMSNorm kernel against the reference."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.reference import rms_norm_ref
from pdserve.kernels.rms_norm import rms_norm
from tests.kernels.kernel_inputs import DEVICE, TOL, rel_error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [64, 96])  # 96: not a power of two, tail masked
def test_matches_reference(poison_empty, dtype, with_residual, hidden):
    x = torch.randn(7, hidden, dtype=dtype, device=DEVICE) * 3
    weight = torch.randn(hidden, dtype=dtype, device=DEVICE)
    residual = torch.randn(7, hidden, dtype=dtype, device=DEVICE) if with_residual else None
    x_before = x.clone()
    out, new_res = rms_norm(x, weight, 1e-6, residual)
    ref, ref_res = rms_norm_ref(x.double(), weight.double(), 1e-6, None if residual is None else residual.double())
    assert out.dtype == dtype
    assert rel_error(out, ref) < TOL[dtype]
    if with_residual:
        assert new_res.dtype == dtype
        assert rel_error(new_res, ref_res) < TOL[dtype]
    else:
        assert new_res is None
    assert torch.equal(x, x_before)  # inputs are not modified


def test_fp32_weight_promotes_like_reference(poison_empty):
    # HF keeps the norm weight in fp32 for some models: bf16 x * fp32 weight -> fp32 output.
    x = torch.randn(3, 32, dtype=torch.bfloat16, device=DEVICE)
    weight = torch.randn(32, device=DEVICE)
    out, _ = rms_norm(x, weight, 1e-5)
    ref, _ = rms_norm_ref(x, weight, 1e-5)
    assert out.dtype == ref.dtype == torch.float32
    assert rel_error(out, ref) < 1e-2


def test_row_strided_input(poison_empty):
    x = torch.randn(4, 80, device=DEVICE)[:, :48]  # rows 80 apart, 48 used
    weight = torch.randn(48, device=DEVICE)
    out, _ = rms_norm(x, weight, 1e-6)
    assert rel_error(out, rms_norm_ref(x, weight, 1e-6)[0]) < TOL[torch.float32]


def test_rejects_bad_arguments():
    x = torch.randn(4, 32, device=DEVICE)
    w = torch.randn(32, device=DEVICE)
    with pytest.raises(ValueError, match=r"rms_norm: weight has shape \[16\], expected \[32\]"):
        rms_norm(x, w[:16], 1e-6)
    with pytest.raises(TypeError, match="residual has dtype bfloat16, expected one of float32"):
        rms_norm(x, w, 1e-6, x.bfloat16())
    with pytest.raises(ValueError, match="x must be contiguous in its last dimension"):
        rms_norm(x.t().contiguous().t(), w, 1e-6)
    with pytest.raises(ValueError, match="eps must be > 0"):
        rms_norm(x, w, 0.0)
    with pytest.raises(ValueError, match=r"x has shape \[4, 32, 1\], expected \[\*, \*\]"):
        rms_norm(x[..., None], w, 1e-6)
