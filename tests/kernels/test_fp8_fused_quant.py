"""RMSNorm and SiLU·mul that quantize their output for the FP8 GEMM after them
(kernels/rms_norm_fp8.py, kernels/silu_and_mul_fp8.py) against the two launches they replace
(rms_norm / silu_and_mul, then fp8_quant.quantize_fp8) and the torch references.

The fused kernels must write exactly what the separate pass writes (same e4m3 codes, same scales,
same layout, same padding rows): the engine's outputs must not change with the fusion. So the
comparisons with the separate kernels are bit for bit, on the GPU too. Against the references:
bit for bit on CPU; on the GPU one e4m3 code may differ where x / scale lands within a rounding
of a tie (the GPU's fp32 division), as tests/kernels/test_fp8.py allows the quantizer itself."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.fp8_quant import quantize_fp8
from pdserve.kernels.reference import (
    FP8_MIN_SCALE,
    quantize_fp8_layout_ref,
    rms_norm_fp8_ref,
    rms_norm_ref,
    silu_and_mul_fp8_ref,
)
from pdserve.kernels.rms_norm import rms_norm
from pdserve.kernels.rms_norm_fp8 import rms_norm_fp8
from pdserve.kernels.silu_and_mul import silu_and_mul
from pdserve.kernels.silu_and_mul_fp8 import silu_and_mul_fp8
from tests.kernels.kernel_inputs import DEVICE, ON_GPU

FP8 = torch.float8_e4m3fn

# (group_size, mn_major_scales, pad_rows_to): what each FP8 GEMM path reads (fp8_linear.py):
# per-token (_scaled_mm), 1x128 row-major (the Triton block GEMM), 1x128 token-major with rows
# padded to 4 (cuBLASLt's block scaling).
LAYOUTS = [(None, False, 1), (128, False, 1), (128, True, 4)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal values (e4m3 codes compared as bytes; NaN would fail) and equal layout."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == FP8:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def _within_one_code(q: torch.Tensor, q_ref: torch.Tensor) -> bool:
    """Every e4m3 value the same or its neighbour (the same sign: adjacent codes differ by 1)."""
    return bool(((q.view(torch.uint8).int() - q_ref.view(torch.uint8).int()).abs() <= 1).all())


def _assert_layout(s: torch.Tensor, m_padded: int, groups: int, mn_major: bool) -> None:
    assert s.shape == (m_padded, groups) and s.dtype == torch.float32
    if mn_major and m_padded > 1 and groups > 1:
        assert s.stride() == (1, m_padded)
    elif not mn_major:
        assert s.stride() == (groups, 1)


def _assert_near_reference(q, s, q_ref, s_ref) -> None:
    if ON_GPU:
        torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
        assert (q.float() != q_ref.float()).float().mean() < 0.01
    else:
        assert _same(s.contiguous(), s_ref.contiguous()) and _same(q, q_ref)


# bf16 (the engine's dtype) at several widths, 320 / 96 / 1000 not powers of 2; fp32 at one.
SHAPES = [(7, 256, torch.bfloat16), (5, 320, torch.bfloat16), (3, 96, torch.bfloat16), (18, 1000, torch.bfloat16),
          (5, 320, torch.float32)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("t,hidden,dtype", SHAPES)
def test_rms_norm_fp8_equals_norm_then_quantize(poison_empty, layout, dtype, with_residual, t, hidden):
    group, mn_major, pad = layout
    g = torch.Generator(device="cpu").manual_seed(hidden + t)
    x = (torch.randn(t, hidden, generator=g) * torch.logspace(-1, 1, hidden)).to(DEVICE, dtype)
    x[t // 2] = 0  # an all-zero row (no residual): the minimum scale, no division by zero
    weight = (torch.rand(hidden, generator=g) + 0.5).to(DEVICE, dtype)
    residual = (torch.randn(t, hidden, generator=g) * 2).to(DEVICE, dtype) if with_residual else None
    x_before = x.clone()

    out = torch.empty(t, hidden, dtype=dtype, device=DEVICE)
    q, s, new_res = rms_norm_fp8(x, weight, 1e-5, residual, group, mn_major, pad, out=out)
    ref_out, ref_res = rms_norm(x, weight, 1e-5, residual)
    q_sep, s_sep = quantize_fp8(ref_out, group, mn_major_scales=mn_major, pad_rows_to=pad)

    m_padded, groups = -(-t // pad) * pad, 1 if group is None else -(-hidden // group)
    assert q.dtype == FP8 and q.shape == (m_padded, hidden)
    _assert_layout(s, m_padded, groups, mn_major)
    assert _same(out, ref_out)  # the norm itself: rms_norm's numbers
    assert _same(q, q_sep) and _same(s, s_sep) and s.stride() == s_sep.stride()
    if with_residual:
        assert _same(new_res, ref_res) and new_res.dtype == dtype
    else:
        assert new_res is None
    if m_padded > t:  # padding rows: zero codes, the minimum scale (what quantize_fp8 pads with)
        assert (q[t:].float() == 0).all() and (s[t:] == FP8_MIN_SCALE).all()
    # The quantization alone against its reference, on the kernel's own norm output.
    _assert_near_reference(q, s, *quantize_fp8_layout_ref(ref_out, group, mn_major, pad))
    # The whole reference: its norm (rsqrt, torch's sum order; under the interpreter also its fp32
    # -> bf16 rounding) may round a value of the row to the
    # neighbouring bf16 (fp32: float) number twice (normed, then times the weight), and so move a
    # scale and some codes by as much.
    q_ref, s_ref, res_ref = rms_norm_fp8_ref(x, weight, 1e-5, residual, group, mn_major, pad)
    torch.testing.assert_close(s, s_ref, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=0)  # 2 bf16 ulps
    assert _within_one_code(q, q_ref)
    if with_residual:
        # (Triton's interpreter rounds fp32 -> bf16 its own way: a bf16 ulp apart at most.)
        torch.testing.assert_close(new_res, res_ref)
    assert torch.equal(x, x_before)  # inputs are not modified


def test_rms_norm_fp8_without_kept_output_writes_the_same(poison_empty):
    x = torch.randn(9, 384, device=DEVICE).bfloat16()
    w = torch.rand(384, device=DEVICE).bfloat16()
    res = torch.randn(9, 384, device=DEVICE).bfloat16()
    q, s, new_res = rms_norm_fp8(x, w, 1e-6, res, 128)
    q2, s2, new_res2 = rms_norm_fp8(x, w, 1e-6, res, 128, out=torch.empty_like(x))
    assert _same(q, q2) and _same(s, s2) and _same(new_res, new_res2)


def test_rms_norm_fp8_fp32_weight_quantizes_the_promoted_output(poison_empty):
    # HF keeps some norm weights in fp32: bf16 x * fp32 weight -> an fp32 output, which is what
    # the separate pass would quantize (not a bf16 rounding of it).
    x, res = torch.randn(6, 200, device=DEVICE).bfloat16(), torch.randn(6, 200, device=DEVICE).bfloat16()
    w = torch.rand(200, device=DEVICE) + 0.5
    q, s, new_res = rms_norm_fp8(x, w, 1e-6, res)
    out, ref_res = rms_norm(x, w, 1e-6, res)
    assert out.dtype == torch.float32 and new_res.dtype == torch.bfloat16 and _same(new_res, ref_res)
    q_sep, s_sep = quantize_fp8(out)
    assert _same(q, q_sep) and _same(s, s_sep)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("t,inter,dtype", SHAPES)
def test_silu_and_mul_fp8_equals_silu_then_quantize(poison_empty, layout, dtype, t, inter):
    group, mn_major, pad = layout
    g = torch.Generator(device="cpu").manual_seed(inter + t)
    x = (torch.randn(t, 2 * inter, generator=g) * 3).to(DEVICE, dtype)
    x[t - 1] = 0  # silu(0) * 0 = 0: the minimum scale
    x_before = x.clone()

    q, s = silu_and_mul_fp8(x, group, mn_major, pad)
    y = silu_and_mul(x)
    q_sep, s_sep = quantize_fp8(y, group, mn_major_scales=mn_major, pad_rows_to=pad)

    m_padded, groups = -(-t // pad) * pad, 1 if group is None else -(-inter // group)
    assert q.dtype == FP8 and q.shape == (m_padded, inter)
    _assert_layout(s, m_padded, groups, mn_major)
    assert _same(q, q_sep) and _same(s, s_sep) and s.stride() == s_sep.stride()
    assert (s[t - 1] == FP8_MIN_SCALE).all() and (q[t - 1].float() == 0).all()
    _assert_near_reference(q, s, *quantize_fp8_layout_ref(y, group, mn_major, pad))
    # The torch reference rounds silu(gate) to the dtype before the product (the kernel keeps fp32
    # throughout), so in bf16 a few values, and so codes and scales, may differ by a rounding.
    q_ref, s_ref = silu_and_mul_fp8_ref(x, group, mn_major, pad)
    torch.testing.assert_close(s, s_ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=0)
    assert _within_one_code(q, q_ref)
    assert torch.equal(x, x_before)


def test_fused_quant_kernels_handle_zero_rows_and_reject_bad_arguments():
    x = torch.zeros(0, 256, device=DEVICE).bfloat16()
    q, s, _ = rms_norm_fp8(x, torch.ones(256, device=DEVICE).bfloat16(), 1e-6)
    assert q.shape == (0, 256) and s.shape == (0, 1)
    q, s = silu_and_mul_fp8(torch.zeros(0, 512, device=DEVICE).bfloat16(), 128)
    assert q.shape == (0, 256) and s.shape == (0, 2)
    with pytest.raises(ValueError, match="power of 2"):
        rms_norm_fp8(torch.ones(2, 256, device=DEVICE), torch.ones(256, device=DEVICE), 1e-6, group_size=100)
    with pytest.raises(ValueError, match="power of 2"):
        silu_and_mul_fp8(torch.ones(2, 512, device=DEVICE), group_size=96)
    with pytest.raises(ValueError, match="must be even"):
        silu_and_mul_fp8(torch.ones(2, 5, device=DEVICE))
    with pytest.raises(ValueError, match="residual has shape"):
        rms_norm_fp8(torch.ones(2, 256, device=DEVICE), torch.ones(256, device=DEVICE), 1e-6,
                     torch.ones(3, 256, device=DEVICE))


def test_rms_norm_fp8_reference_is_norm_then_quantize_reference():
    # The reference the CPU engine's fused path runs (TORCH_OPS) is the two references composed.
    x, w, r = torch.randn(5, 200).bfloat16(), torch.rand(200).bfloat16(), torch.randn(5, 200).bfloat16()
    q, s, res = rms_norm_fp8_ref(x, w, 1e-6, r, 128, True, 4)
    h, res2 = rms_norm_ref(x, w, 1e-6, r)
    q2, s2 = quantize_fp8_layout_ref(h, 128, True, 4)
    assert _same(q, q2) and torch.equal(s, s2) and s.stride() == (1, 8) and torch.equal(res, res2)


# -- the FP8 linear given its input quantized by the norm before it ---------------------------------

def _loaded_qkv_layer(weight: str, activation: str):
    """A fused q/k/v FP8 layer (K=256, N=512) with random e4m3 weights, on the kernel path."""
    from tests.kernels.test_fp8 import _qkv_layer

    layer, fp8 = _qkv_layer(weight, activation)
    g = torch.Generator(device="cpu").manual_seed(1)
    for part, rows in (("q", 256), ("k", 128), ("v", 128)):
        w8 = (torch.randn(rows, 256, generator=g) * 50).clamp(-448, 448).to(FP8).to(DEVICE)
        s = (torch.rand(rows // 128, 2, generator=g) if weight == "block" else torch.rand(()) * 0.01 + 1e-3)
        layer.weight_loader(layer.weight, w8, part)
        layer.weight_loader(getattr(layer, fp8.scale_name), s.to(DEVICE), part)
        if activation == "static":
            layer.weight_loader(layer.input_scale, torch.tensor(0.02), part)
    layer.quant.process_weights_after_loading(layer, torch.bfloat16, kernels=True)
    return layer


@pytest.mark.parametrize("weight,activation", [("channel", "token"), ("block", "group")])
@pytest.mark.parametrize("m", [17, 40] + ([130] if ON_GPU else []))
def test_linear_given_norm_quantized_input_equals_linear_quantizing_itself(weight, activation, m):
    from pdserve.worker.quantization.fp8_activations import Fp8Activations
    from pdserve.worker.quantization.fp8_linear import activation_format, fp8_input_format

    layer = _loaded_qkv_layer(weight, activation)
    g = torch.Generator(device="cpu").manual_seed(m)
    x = (torch.randn(m, 256, generator=g) * 2).to(DEVICE, torch.bfloat16)
    res = torch.randn(m, 256, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.rand(256, generator=g) + 0.5).to(DEVICE, torch.bfloat16)
    fmt = fp8_input_format(layer, m)
    path = layer.quant._path(layer, m)
    assert path != "gemv" and fmt == activation_format(path, 128 if weight == "block" else None)
    q, s, new_res = rms_norm_fp8(x, w, 1e-5, res, **fmt.kwargs())
    fused = layer(Fp8Activations(q, s, m, fmt, torch.bfloat16))
    h, ref_res = rms_norm(x, w, 1e-5, res)
    separate = layer(h)  # the linear quantizes h itself
    assert fused.shape == separate.shape == (m, 512) and fused.dtype == torch.bfloat16
    assert torch.equal(fused, separate) and torch.equal(new_res, ref_res)
    # The same for SiLU·mul's output into this layer (K = 256: a down_proj-like input).
    gu = (torch.randn(m, 512, generator=g) * 3).to(DEVICE, torch.bfloat16)
    q, s = silu_and_mul_fp8(gu, **fmt.kwargs())
    assert torch.equal(layer(Fp8Activations(q, s, m, fmt, torch.bfloat16)), layer(silu_and_mul(gu)))


def test_which_rows_and_layers_get_quantized_input(monkeypatch):
    # Decided from shapes and load-time facts only (no sync: CUDA graphs capture the branch).
    from pdserve.kernels import fp8_scaled_mm
    from pdserve.worker.quantization import fp8_linear
    from pdserve.worker.quantization.fp8_activations import Fp8ActFormat, Fp8Activations

    channel, block = _loaded_qkv_layer("channel", "token"), _loaded_qkv_layer("block", "group")
    fmt = fp8_linear.fp8_input_format
    assert fmt(channel, fp8_linear.FP8_GEMV_MAX_M) is None  # decode sizes: the GEMV reads bf16
    assert fmt(channel, fp8_linear.FP8_GEMV_MAX_M + 1) == Fp8ActFormat(None, False, 1)
    assert fmt(block, 17) == Fp8ActFormat(128, False, 1)  # the Triton block GEMM
    monkeypatch.setattr(block, "scaled_mm_block", True)  # as if the sm90 probe passed
    m = fp8_linear.SCALED_MM_BLOCK_MIN_M
    assert fmt(block, m - 1) == Fp8ActFormat(128, False, 1)
    assert fmt(block, m) == Fp8ActFormat(128, True, fp8_scaled_mm.PAD_M)  # cuBLASLt: token-major, padded
    assert fmt(_loaded_qkv_layer("channel", "static"), 100) is None  # a static scale: quantized in the linear
    assert fmt(torch.nn.Linear(4, 4), 100) is None  # not quantized
    monkeypatch.setattr(fp8_linear, "FUSED_ACT_QUANT", False)  # PDSERVE_FP8_FUSED_QUANT=0
    assert fmt(channel, 100) is None and fmt(block, 100) is None
    # Input quantized for another path is refused, not misread.
    q, s = silu_and_mul_fp8(torch.randn(40, 512, device=DEVICE), 128)
    with pytest.raises(ValueError, match="activations quantized as"):
        channel(Fp8Activations(q, s, 40, Fp8ActFormat(128, False, 1), torch.bfloat16))


@pytest.mark.skipif(
    not (ON_GPU and torch.cuda.get_device_capability()[0] == 9), reason="cuBLASLt block scaling: sm90 only"
)
@pytest.mark.parametrize("m", [128, 130])  # 130: rows padded to PAD_M
def test_cublaslt_block_gemm_given_fused_quantized_input_equals_block_linear(m):
    # What an FP8 block layer of K/128 a multiple of 4 runs from SCALED_MM_BLOCK_MIN_M rows
    # (fp8_scaled_mm.block_linear, quantizing itself) against the same GEMM on the norm's and the
    # SiLU·mul's token-major, padded output.
    from pdserve.kernels import fp8_scaled_mm
    from pdserve.kernels.reference import quantize_fp8_blocks_ref

    ok, why = fp8_scaled_mm.probe_blockwise(torch.device("cuda"), torch.bfloat16)
    if not ok:
        pytest.skip(f"cuBLASLt block scaling unavailable: {why}")
    g = torch.Generator(device="cpu").manual_seed(m)
    w8, ws = quantize_fp8_blocks_ref(torch.randn(256, 512, generator=g).to(DEVICE))
    ws = ws.contiguous()
    x = torch.randn(m, 512, generator=g).to(DEVICE, torch.bfloat16)
    res = torch.randn(m, 512, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.rand(512, generator=g) + 0.5).to(DEVICE, torch.bfloat16)
    q, s, _ = rms_norm_fp8(x, w, 1e-5, res, 128, True, fp8_scaled_mm.PAD_M)
    h, _ = rms_norm(x, w, 1e-5, res)
    fused = fp8_scaled_mm.block_linear_quantized(q, s, m, w8, ws, torch.bfloat16)
    assert fused.shape == (m, 256) and torch.equal(fused, fp8_scaled_mm.block_linear(h, w8, ws, torch.bfloat16))
    gu = (torch.randn(m, 1024, generator=g) * 3).to(DEVICE, torch.bfloat16)
    q, s = silu_and_mul_fp8(gu, 128, True, fp8_scaled_mm.PAD_M)
    assert torch.equal(fp8_scaled_mm.block_linear_quantized(q, s, m, w8, ws, torch.bfloat16),
                       fp8_scaled_mm.block_linear(silu_and_mul(gu), w8, ws, torch.bfloat16))
