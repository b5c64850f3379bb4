"""silu_and_mul: SwiGLU activation kernel against the reference."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.reference import silu_and_mul_ref
from pdserve.kernels.silu_and_mul import silu_and_mul
from tests.kernels.kernel_inputs import DEVICE, TOL, rel_error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [64, 1500])  # 1500: two column tiles, the second partial
def test_matches_reference(poison_empty, dtype, inter):
    x = torch.randn(5, 2 * inter, dtype=dtype, device=DEVICE) * 4
    out = silu_and_mul(x)
    ref = silu_and_mul_ref(x.double())
    assert out.shape == (5, inter) and out.dtype == dtype
    assert rel_error(out, ref) < TOL[dtype]


def test_row_strided_input_and_empty(poison_empty):
    x = torch.randn(3, 100, device=DEVICE)[:, :64]
    assert rel_error(silu_and_mul(x), silu_and_mul_ref(x)) < TOL[torch.float32]
    assert silu_and_mul(torch.randn(0, 8, device=DEVICE)).shape == (0, 4)


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="last dimension must be even"):
        silu_and_mul(torch.randn(2, 7, device=DEVICE))
    with pytest.raises(TypeError, match="x has dtype int32"):
        silu_and_mul(torch.ones(2, 8, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        silu_and_mul(torch.randn(8, 2, device=DEVICE).t())
