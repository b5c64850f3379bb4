"""The CPU engine's native element-wise stages (kernels/cpu_pointwise.c through cpu_pointwise.py)
= the torch references on bf16 rows: RMSNorm with and without the residual, rotate-half rotary on
q and k views of one qkv row (the engine's strides), SiLU-and-mul; a decode's few rows and a
prompt's many (split over threads). Outputs equal the references' except where an fp32
reduction or exp differs in its last bit and flips a bf16 rounding: at most one bf16 step, rarely."""

from __future__ import annotations

import shutil

import pytest
import torch

from pdserve.kernels import cpu_native
from pdserve.kernels.cpu_pointwise import rms_norm_cpu, rotary_cpu, silu_and_mul_cpu
from pdserve.kernels.reference import rms_norm_ref, rotary_ref, silu_and_mul_ref

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the kernels")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bits but for a rare one-step bf16 difference."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    g, w = got.float(), want.float()
    assert ((g - w).abs() <= w.abs() * 2**-7 + 1e-30).all()
    assert (got != want).float().mean() < 0.01


def test_the_kernels_build_here():
    assert cpu_native.pointwise() is not None


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(rows, with_residual):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * 576, generator=g) * 3).bfloat16()[:, :576]  # rows strided, as a view's
    w = (torch.rand(576, generator=g) + 0.5).bfloat16()
    r = torch.randn(rows, 576, generator=g).bfloat16() if with_residual else None
    out, res = rms_norm_cpu(x, w, 1e-5, r)
    ref, ref_res = rms_norm_ref(x, w, 1e-5, r)
    _close(out, ref)
    if with_residual:
        assert torch.equal(res, ref_res)  # one bf16 add: exact
    else:
        assert res is None


@pytest.mark.parametrize("rows", [1, 5, 200])
def test_rotary_matches_reference_on_views_of_one_qkv_row(rows):
    g = torch.Generator().manual_seed(rows)
    hq, hkv, d = 9, 3, 64
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=g).bfloat16()
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(rows, hq, d), k.view(rows, hkv, d)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    angles = torch.arange(4096).float()[:, None] * inv[None, :]
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1)
    positions = torch.randint(0, 4096, (rows,), generator=g)
    before = qkv.clone()
    qo, ko = rotary_cpu(positions, q, k, cos_sin)
    qr, kr = rotary_ref(positions, q, k, cos_sin)
    assert torch.equal(qo, qr) and torch.equal(ko, kr)  # every rounding where the reference's is: exact
    assert torch.equal(qkv, before)  # new tensors: the projection's output is not written


@pytest.mark.parametrize("rows", [1, 3, 130])
def test_silu_and_mul_matches_reference(rows):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 2 * 1536, generator=g) * 4).bfloat16()
    x[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0]).bfloat16()  # exp's clamps, signed zero
    _close(silu_and_mul_cpu(x), silu_and_mul_ref(x))


def test_other_dtypes_run_the_references():
    x, w = torch.randn(3, 64), torch.rand(64)
    out, _ = rms_norm_cpu(x, w, 1e-6)
    assert torch.equal(out, rms_norm_ref(x, w, 1e-6)[0])
    assert torch.equal(silu_and_mul_cpu(x), silu_and_mul_ref(x))
