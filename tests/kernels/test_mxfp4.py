"""kernels/mxfp4.py: the reference codec of gpt-oss's MXFP4 experts, checked against the format
as transformers decodes it (low nibble first, E8M0 scales biased by 127)."""

import pytest
import torch

from pdserve.kernels.mxfp4 import FP4_VALUES, checkpoint_view, dequantize_mxfp4, quantize_mxfp4


def _transformers_dequant(blocks, scales):
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    # transformers returns [E, K, N] (it transposes for its own forward); ours stays [E, N, K].
    return mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)


def test_every_code_and_scale_decodes_as_transformers_does():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (2, 3, 64), dtype=torch.uint8, generator=g)  # K = 128
    scales = torch.randint(100, 150, (2, 3, 4), dtype=torch.uint8, generator=g)
    ours = dequantize_mxfp4(packed, scales)
    assert torch.equal(ours, _transformers_dequant(checkpoint_view(packed), scales))
    one = dequantize_mxfp4(torch.tensor([[0x21] + [0] * 15], dtype=torch.uint8),
                           torch.tensor([[128]], dtype=torch.uint8))
    assert one[0, :2].tolist() == [2 * FP4_VALUES[1], 2 * FP4_VALUES[2]]  # low nibble first, scale 2^1


def test_quantize_round_trips_representable_values_and_bounds_the_error():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(4, 8, 96, generator=g)
    packed, scales = quantize_mxfp4(w)
    assert packed.shape == (4, 8, 48) and scales.shape == (4, 8, 3)
    twin = dequantize_mxfp4(packed, scales)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(twin)), twin)  # the twin is a fixed point
    # e2m1 has a relative step of at most 1/2 of the value's binade; per block, the error is within
    # half the largest step (scale * 1) of that block.
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)
    assert (twin - w).abs().le(step * 1.0 + 1e-6).all()


@pytest.mark.parametrize("packed, scales", [
    (torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8)),
    (torch.zeros(2, 16, dtype=torch.int8), torch.zeros(2, 1, dtype=torch.uint8)),
])
def test_mismatched_tensors_are_refused(packed, scales):
    with pytest.raises(ValueError, match="MXFP4"):
        dequantize_mxfp4(packed, scales)
