"""Block-128 FP8 through torch's scaled_mm (kernels/fp8_scaled_mm.py) and the FP8 linear's
choice of GEMM (worker/quantization/fp8_linear.fp8_gemm_path).

The call itself needs cuBLASLt on sm90 (torch's CPU scaled_mm has no block scaling): on CPU these
tests check what decides its inputs: the 1x128 activation scales the quantization kernel writes
token-major (under the interpreter, against the torch reference), the weight scale view, the
shape rules and the dispatch; on an sm90 GPU the probe and the real call against the reference."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.fp8_quant import quantize_fp8
from pdserve.kernels.fp8_scaled_mm import (
    block_linear,
    blockwise_recipes,
    check_activation_scales,
    probe_blockwise,
    scaled_mm_blockwise,
    scaled_mm_blockwise_ref,
    weight_ineligible,
    weight_scale_operand,
)
from pdserve.kernels.reference import FP8_MIN_SCALE, fp8_block_gemm_ref, quantize_fp8_blocks_ref, quantize_fp8_ref
from pdserve.worker.quantization.fp8_linear import SCALED_MM_BLOCK_MIN_M, fp8_gemm_path
from tests.kernels.kernel_inputs import DEVICE, ON_GPU, rel_error

SM90 = ON_GPU and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.parametrize("m,k", [(7, 512), (1, 384), (33, 200)])
def test_quantize_writes_token_major_scales(poison_empty, m, k):
    x = (torch.randn(m, k, device=DEVICE) * torch.logspace(-2, 2, k, device=DEVICE)).bfloat16()
    q, s = quantize_fp8(x, 128, mn_major_scales=True)
    q_ref, s_ref = quantize_fp8_ref(x, 128)
    groups = -(-k // 128)
    assert s.shape == (m, groups) and (m == 1 or s.stride() == (1, m))
    check_activation_scales(s, m, k)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert (q.float() != q_ref.float()).float().mean() < 0.01
    # The row-major layout (the Triton GEMM's) is refused by name.
    if m > 1:
        with pytest.raises(ValueError, match=rf"strides \(1, {m}\)"):
            check_activation_scales(quantize_fp8(x, 128)[1], m, k)


@pytest.mark.parametrize("group,tile,mn_major",
                         [(128, 256, True), (128, 256, False), (96, 4096, True), (64, 4096, False)])
def test_grouped_quantize_over_several_programs_per_row(poison_empty, monkeypatch, group, tile, mn_major):
    # GROUP_TILE 256: two 128-groups per program, five programs per row with a partial last group
    # and a partial last run; group 96 (not a power of 2) takes the one-program-per-group kernel.
    import pdserve.kernels.fp8_quant as fp8_quant

    monkeypatch.setattr(fp8_quant, "GROUP_TILE", tile)
    x = torch.randn(6, 1100, device=DEVICE) * torch.logspace(-3, 3, 1100, device=DEVICE)
    q, s = quantize_fp8(x, group, mn_major_scales=mn_major)
    q_ref, s_ref = quantize_fp8_ref(x, group)
    assert s.shape == s_ref.shape == (6, -(-1100 // group))
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert (q.float() != q_ref.float()).float().mean() < 0.01


def test_quantize_pads_rows_with_zeros(poison_empty):
    x = torch.randn(5, 300, device=DEVICE)
    q, s = quantize_fp8(x, 128, mn_major_scales=True, pad_rows_to=4)
    assert q.shape == (8, 300) and s.shape == (8, 3) and s.stride() == (1, 8)
    q_ref, s_ref = quantize_fp8_ref(x, 128)
    torch.testing.assert_close(s[:5], s_ref, rtol=1e-6, atol=0)
    assert (q[:5].float() != q_ref.float()).float().mean() < 0.01
    assert torch.all(q[5:].float() == 0) and torch.all(s[5:] == FP8_MIN_SCALE)
    with pytest.raises(ValueError, match="pad_rows_to needs a power-of-2 group_size"):
        quantize_fp8(x, None, pad_rows_to=4)


@pytest.mark.parametrize("m", [130, 128])
def test_block_linear_pads_and_slices(poison_empty, monkeypatch, m):
    # The whole path an FP8 block layer runs from 128 rows, with cuBLASLt's call replaced by its
    # reference (which reads the scales from memory as cuBLASLt does).
    import pdserve.kernels.fp8_scaled_mm as fp8_scaled_mm

    seen = []

    def fake(xq, xs, w8, scale_b, out_dtype):
        seen.append(xq.shape[0])
        return scaled_mm_blockwise_ref(xq, xs, w8, scale_b, out_dtype)

    monkeypatch.setattr(fp8_scaled_mm, "scaled_mm_blockwise", fake)
    x = torch.randn(m, 512, device=DEVICE)
    w8, ws = quantize_fp8_blocks_ref(torch.randn(256, 512, device=DEVICE) * 0.05)
    out = block_linear(x, w8, ws, torch.float32)
    xq, xs = quantize_fp8_ref(x, 128)
    pad = fp8_scaled_mm.PAD_M
    assert seen == [-(-m // pad) * pad] and out.shape == (m, 256) and out.is_contiguous()
    assert rel_error(out, fp8_block_gemm_ref(xq, xs, w8, ws, 128, torch.float64)) < 1e-2


def test_this_torch_names_the_deepseek_recipe():
    # torch >= 2.10 (the CI's 2.13, the GPU image's 2.11): scaled_mm with the two block recipes,
    # whose values are the ATen ScalingType codes 4 (1x128) and 5 (128x128).
    a, b = blockwise_recipes()
    assert (a.value, b.value) == (4, 5)


def test_weight_scale_operand_is_the_transposed_block_grid():
    ws = torch.rand(3, 8) + 0.1  # N = 384, K = 1024
    sb = weight_scale_operand(ws)
    assert sb.shape == (8, 3) and sb.stride() == (1, 8) and sb.data_ptr() == ws.data_ptr()
    with pytest.raises(ValueError, match="multiple of 4"):
        weight_scale_operand(torch.rand(3, 6))
    with pytest.raises(ValueError, match="row-major"):
        weight_scale_operand(torch.rand(8, 4).t())


@pytest.mark.parametrize("n,k,scale_rows,why", [
    (6144, 4096, 128, None), (4096, 14336, 128, None), (4096, 7168, 128, None),  # Llama-3.1-8B, TP 1/2
    (4096, 1792, 128, "not a multiple of 4"),  # down_proj at TP=8: K/128 = 14
    (384, 256, 1, "per-row scales"), (400, 512, 128, "multiples of 128"), (384, 200, 128, "multiples of 128"),
])
def test_which_weights_take_scaled_mm(n, k, scale_rows, why):
    got = weight_ineligible(n, k, scale_rows)
    assert (got is None) if why is None else (why in got)


def test_scale_layouts_give_the_block_gemm_product():
    # The operands as the linear passes them (token-major activation scales, the transposed
    # weight grid) mean the same product as the Triton GEMM's row-major ones.
    torch.manual_seed(0)
    m, n, k = 9, 256, 512
    xq, xs = quantize_fp8_ref(torch.randn(m, k) * torch.logspace(-2, 2, k), 128)
    w8, ws = quantize_fp8_blocks_ref(torch.randn(n, k) * torch.logspace(-2, 0, n)[:, None])
    xs_mn = xs.t().contiguous().t()
    check_activation_scales(xs_mn, m, k)
    got = scaled_mm_blockwise_ref(xq, xs_mn, w8, weight_scale_operand(ws), torch.float64)
    ref = fp8_block_gemm_ref(xq, xs, w8, ws, 128, torch.float64)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    # The Triton GEMM's row-major activation scales, read as cuBLASLt reads memory, are wrong.
    wrong = scaled_mm_blockwise_ref(xq, xs, w8, weight_scale_operand(ws), torch.float64)
    assert rel_error(wrong, ref) > 0.5


@pytest.mark.parametrize("m,block,ok,path", [
    (1, True, True, "gemv"), (16, False, False, "gemv"), (17, False, False, "rowwise"), (4096, False, True, "rowwise"),
    (17, True, True, "triton_block"), (SCALED_MM_BLOCK_MIN_M - 1, True, True, "triton_block"),
    (SCALED_MM_BLOCK_MIN_M, True, True, "scaled_mm_block"), (4096, True, False, "triton_block"),
])
def test_fp8_gemm_path(m, block, ok, path):
    assert fp8_gemm_path(m, block, ok) == path


def test_per_channel_layers_take_the_triton_gemm_below_its_rows(monkeypatch):
    from pdserve.worker.quantization import fp8_linear

    monkeypatch.setattr(fp8_linear, "TRITON_ROWWISE_MAX_M", 128)
    assert [fp8_gemm_path(m, False, False) for m in (16, 17, 127, 128)] == ["gemv", "triton_rowwise",
                                                                            "triton_rowwise", "rowwise"]
    assert fp8_gemm_path(40, True, False) == "triton_block"  # block layers keep their own
    assert fp8_linear.activation_format("triton_rowwise", None) == fp8_linear.activation_format("rowwise", None)


@pytest.mark.parametrize("block", [False, True])
def test_a_measured_64_row_tile_takes_the_gemv_to_64_rows(block, monkeypatch):
    from pdserve.kernels import fp8_gemv
    from pdserve.worker.quantization import fp8_linear

    w8a8 = "triton_block" if block else "rowwise"
    assert fp8_gemm_path(40, block, False, measured_rows=64) == "gemv"
    assert fp8_gemm_path(64, block, False, measured_rows=64) == "gemv"
    assert fp8_gemm_path(65, block, False, measured_rows=64) == w8a8
    assert fp8_gemm_path(17, block, False, measured_rows=0) == w8a8
    monkeypatch.setattr(fp8_linear, "FP8_GEMV_MEASURED_ROWS", False)  # the bench's baseline: 16 rows for every layer
    assert fp8_gemm_path(40, block, False, measured_rows=64) == w8a8
    # The table decides per card and shape: a 64-row key present, or not.
    monkeypatch.setattr(fp8_gemv, "_TABLE", {"cpu": {fp8_gemv.config_key(256, 512, block, 64): {}}})
    assert fp8_gemv.measured_batch_rows(torch.device("cpu"), 256, 512, block) == fp8_gemv.MAX_M == 64
    assert fp8_gemv.measured_batch_rows(torch.device("cpu"), 256, 512, not block) == 0
    assert fp8_gemv.measured_batch_rows(torch.device("cpu"), 512, 512, block) == 0


def test_the_committed_64_row_tiles_are_for_shapes_of_the_table():
    # A 17-64-row entry names a shape the card's one-row table has too (a typo would be a silent miss).
    from pdserve.kernels.fp8_gemv_configs import CONFIGS

    for card, table in CONFIGS.items():
        for key in table:
            if key.endswith(",64"):
                assert key[:-3] + ",1" in table, (card, key)


@pytest.mark.skipif(ON_GPU, reason="the CPU side of the probe")
def test_probe_refuses_the_cpu_and_the_linear_keeps_triton():
    from tests.kernels.test_fp8 import _qkv_layer

    assert probe_blockwise(torch.device("cpu"), torch.bfloat16) == (False, "not a CUDA device")
    layer, _ = _qkv_layer("block", "group")
    layer.weight.data.zero_()
    getattr(layer, "weight_scale_inv").data.fill_(1.0)
    layer.quant.process_weights_after_loading(layer, torch.bfloat16, kernels=True)
    assert layer.scaled_mm_block is False


@pytest.mark.skipif(not SM90, reason="cuBLASLt block scaling: sm90 only")
@pytest.mark.parametrize("m,n,k", [(128, 6144, 4096), (300, 4096, 14336)])
def test_scaled_mm_blockwise_on_sm90(m, n, k):
    ok, detail = probe_blockwise(torch.device("cuda"), torch.bfloat16)
    assert ok, detail
    x = torch.randn(m, k, device="cuda").bfloat16()
    w8, ws = quantize_fp8_blocks_ref(torch.randn(n, k, device="cuda") * 0.02)
    xq, xs = quantize_fp8(x, 128, mn_major_scales=True)
    out = scaled_mm_blockwise(xq, xs, w8, weight_scale_operand(ws.contiguous()), torch.bfloat16)
    ref = fp8_block_gemm_ref(xq, xs.contiguous(), w8, ws, 128, torch.float64)
    assert out.dtype == torch.bfloat16 and rel_error(out, ref) < 1e-2
    out = block_linear(x[:m - 3], w8, ws.contiguous(), torch.bfloat16)  # padded to a multiple of 4 rows
    assert out.shape == (m - 3, n) and rel_error(out, ref[:m - 3]) < 1e-2


@pytest.mark.skipif(ON_GPU, reason="the probe's decisions, with cuBLASLt's call replaced")
def test_probe_widens_the_row_padding_or_refuses(monkeypatch):
    import pdserve.kernels.fp8_scaled_mm as fp8_scaled_mm

    monkeypatch.setattr(fp8_scaled_mm, "PAD_M", fp8_scaled_mm.PAD_M)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def wants_16_rows(xq, xs, w8, scale_b, out_dtype):
        if xq.shape[0] % 16:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        return scaled_mm_blockwise_ref(xq, xs, w8, scale_b, out_dtype)

    monkeypatch.setattr(fp8_scaled_mm, "scaled_mm_blockwise", wants_16_rows)
    ok, detail = fp8_scaled_mm._run_probe(torch.device("cpu"), torch.float32)
    assert ok and "padded to a multiple of 16" in detail and fp8_scaled_mm.PAD_M == 16

    monkeypatch.setattr(fp8_scaled_mm, "scaled_mm_blockwise",
                        lambda xq, xs, w8, sb, dt: torch.zeros(xq.shape[0], w8.shape[0], dtype=dt))
    ok, detail = fp8_scaled_mm._run_probe(torch.device("cpu"), torch.float32)
    assert not ok and "wrong result at M=150" in detail and fp8_scaled_mm.PAD_M == 4
