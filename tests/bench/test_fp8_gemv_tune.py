"""bench/fp8_gemv_tune.py's swapped per-channel candidate: the same product as the engine's
`_scaled_mm` call (torch's CPU `_scaled_mm` runs row-wise FP8; the GPU timings are the bench's)."""

import pytest
import torch

from pdserve.bench.fp8_gemv_tune import rowwise_swapped
from pdserve.kernels.reference import dequantize_fp8_ref, quantize_fp8_ref, quantize_fp8_rows_ref


@pytest.mark.parametrize("m", [16, 64])
def test_swapped_operands_give_the_engines_product(m):
    g = torch.Generator().manual_seed(m)
    w8, w_scale = quantize_fp8_rows_ref(torch.randn(96, 256, generator=g) * 0.02)
    xq, xs = quantize_fp8_ref(torch.randn(m, 256, generator=g))
    scale = w_scale.reshape(1, -1).contiguous()  # the engine's [1, N]
    engine = torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=scale, out_dtype=torch.bfloat16)
    out = rowwise_swapped(xq, xs, w8, scale)
    assert out.shape == (m, 96) and out.is_contiguous() and out.dtype == torch.bfloat16
    assert torch.equal(out, engine)
    ref = (xq.float() * xs) @ dequantize_fp8_ref(w8, w_scale).t()
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=1e-3)


def test_rows_not_a_multiple_of_16_are_refused():
    w8, w_scale = quantize_fp8_rows_ref(torch.randn(32, 64))
    xq, xs = quantize_fp8_ref(torch.randn(24, 64))
    with pytest.raises(ValueError, match="M must be a multiple of 16, got 24"):
        rowwise_swapped(xq, xs, w8, w_scale.reshape(1, -1))
