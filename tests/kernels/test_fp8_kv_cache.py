"""An fp8 (e4m3) KV cache: the Triton writes quantize exactly as the reference does, and the
attention kernels dequantize in-kernel to the reference's result (--kv-cache-dtype fp8).

The reference (kernels/reference.py quantize_kv / dequantize_kv) is the oracle: stored = x /
scale, saturated to +-448, rounded to nearest even; read = stored * scale. Scales are per layer
and per tensor, passed as [1] fp32 tensors; None means 1.0 (vLLM without calibrated scales).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.kv_cache_write import kv_cache_write
from pdserve.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_rotary
from pdserve.kernels.paged_prefill_attention import paged_prefill_attention
from pdserve.kernels.reference import (
    FP8_KV_DTYPE,
    kv_cache_write_ref,
    paged_decode_attention_ref,
    paged_decode_attention_rotary_ref,
    paged_prefill_attention_ref,
    rotary_kv_write_ref,
)
from pdserve.kernels.rotary_kv_write import rotary_kv_write
from tests.kernels.kernel_inputs import (DEVICE, TOL, block_tables_for, cos_sin_cache, qk_norm_weights, rel_error,
                                        slots_of)

# (k_scale, v_scale): unit (no calibration), a power of two, and ones that are not.
SCALES = [(None, None), (0.5, 2.0), (0.37, 1.7)]


def _scale(x: float | None) -> torch.Tensor | None:
    return None if x is None else torch.tensor([x], dtype=torch.float32, device=DEVICE)


def fp8_cache(num_blocks: int, num_layers: int, block_size: int, hkv: int, d: int, layer: int = 1, spread: float = 3.0):
    """An engine-shaped fp8 cache ([blocks, layers, 2, bs, Hkv, D]) of random values, and one layer's K/V views."""
    cache = (torch.randn(num_blocks, num_layers, 2, block_size, hkv, d, device=DEVICE) * spread).to(FP8_KV_DTYPE)
    return cache, cache[:, layer, 0], cache[:, layer, 1]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _assert_fp8_close(got: torch.Tensor, want: torch.Tensor) -> None:
    # Two e4m3 steps of the value, plus bf16's error of the operands it was computed from (a
    # rotated value near zero comes from cancelling larger ones).
    g, w = got.float(), want.float()
    assert ((g - w).abs() <= w.abs() * 2**-2 + w.abs().max() * 2**-6).all()
    assert rel_error(g, w) < 2e-2


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", SCALES)
def test_write_quantizes_bit_for_bit_like_the_reference(src_dtype, scales):
    ks, vs = (_scale(s) for s in scales)
    block_size, hkv, d, t = 4, 3, 40, 30
    cache, k_cache, v_cache = fp8_cache(12, 3, block_size, hkv, d)
    key = torch.randn(t, hkv, d, device=DEVICE) * 50
    value = torch.randn(t, hkv, d, device=DEVICE) * 200
    # Past e4m3's range (saturates to +-448, not NaN), rounding that carries into the next
    # power of two (15.9 -> 16), subnormals, signed zero.
    key[0, 0, :8] = torch.tensor([1e4, -1e4, 15.9, 447.9, 2**-10, -3 * 2**-11, -0.0, 0.0])
    key, value = key.to(src_dtype), value.to(src_dtype)
    slots = torch.randperm(12 * block_size, device=DEVICE)[:t]
    slots[[3, 9]] = -1
    expected = cache.clone()
    kv_cache_write_ref(key, value, expected[:, 1, 0], expected[:, 1, 1], slots, ks, vs)

    kv_cache_write(key, value, k_cache, v_cache, slots.int(), ks, vs)

    assert torch.equal(_bits(cache), _bits(expected))  # every slot, every layer: the same bytes
    stored = expected[:, 1, 0][slots[0] // block_size, slots[0] % block_size, 0, :2].float()
    assert stored.abs().tolist() == [448.0, 448.0] and not expected.float().isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales,with_norm", [(SCALES[1], False), (SCALES[2], False), (SCALES[2], True)])
def test_rotary_write_quantizes_like_the_reference(dtype, scales, with_norm):
    torch.manual_seed(0)  # fixed inputs: the bf16 bound below is a measured one, not a margin over luck
    ks, vs = (_scale(s) for s in scales)
    hq, hkv, d, block_size, t = 6, 2, 32, 4, 9
    cs = cos_sin_cache(64, d)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEVICE).to(dtype) * 4
    q, k, v = (x.reshape(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], -1))
    bias = torch.randn((hq + 2 * hkv) * d, device=DEVICE).to(dtype)
    positions = torch.randint(0, 64, (t,), device=DEVICE)
    slots = torch.randperm(8 * block_size, device=DEVICE)[:t]
    cache, k_cache, v_cache = fp8_cache(8, 2, block_size, hkv, d)
    expected = cache.clone()
    qk_norm = qk_norm_weights(d, dtype) if with_norm else None
    slots[4] = -1
    q_ref = rotary_kv_write_ref(positions, q, k, v, cs, expected[:, 1, 0], expected[:, 1, 1], slots, bias, ks, vs,
                                qk_norm=qk_norm)

    q_out = rotary_kv_write(positions, q, k, v, cs, k_cache, v_cache, slots.int(), bias, ks, vs, qk_norm=qk_norm)

    # bf16 with the q/k norm: the reference rounds the bias add, x * rstd and the weighted norm to
    # bf16 op by op and rotates in bf16, the kernel rotates in fp32 (and the interpreter truncates
    # where a GPU rounds): up to 1.6% apart over 40 seeds on CPU, so 2.5e-2 as in test_fused_gemv.
    tol = 2.5e-2 if with_norm and dtype == torch.bfloat16 else TOL[dtype]
    assert rel_error(q_out, q_ref) < tol
    if dtype == torch.float32 and not with_norm:
        assert torch.equal(_bits(cache), _bits(expected))
    else:
        # The kernel adds the bias and rotates in fp32 and rounds once to bf16 (truncates, under
        # the interpreter); the reference does each op in bf16. Their bf16 k/v differ by an ulp
        # or so, which can land on the other side of an fp8 rounding boundary: a few values one
        # or two e4m3 steps (2^-3 relative each) apart, the cache as a whole within bf16's error.
        # The norm's rstd (1 / sqrt, the norm kernel's) and torch's rsqrt may differ by an fp32 ulp.
        _assert_fp8_close(cache[:, 1], expected[:, 1])
        assert torch.equal(_bits(cache[:, 0]), _bits(expected[:, 0]))  # the other layer untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("num_splits,fused", [(1, False), (3, True), (3, False)])
def test_decode_attention_dequantizes_like_the_reference(poison_empty, dtype, scales, num_splits, fused):
    ks, vs = (_scale(s) for s in scales)
    hq, hkv, d, block_size, ctx = 6, 2, 40, 5, [23, 1, 11, 30]
    _, k_cache, v_cache = fp8_cache(40, 2, block_size, hkv, d)
    block_tables = block_tables_for(ctx, block_size, 40, extra=2)
    context_lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(ctx), hq, d, dtype=dtype, device=DEVICE)
    sem = torch.zeros(len(ctx) * hkv, dtype=torch.int32, device=DEVICE) if fused else None
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, d**-0.5, ks, vs,
                                 num_splits=num_splits, semaphores=sem)
    ref = paged_decode_attention_ref(q.float(), k_cache, v_cache, block_tables, context_lens, d**-0.5, ks, vs)
    assert out.dtype == dtype
    assert rel_error(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits,with_norm", [(1, False), (3, False), (3, True)])
def test_decode_rotary_variant_writes_fp8_and_attends(poison_empty, dtype, num_splits, with_norm):
    torch.manual_seed(0)  # fixed inputs: bf16 with the norm measured 0.3-1.4% from the reference over 30 seeds
    ks, vs = _scale(0.37), _scale(1.7)
    hq, hkv, d, block_size, ctx = 6, 2, 32, 4, [9, 1, 16]
    cache, k_cache, v_cache = fp8_cache(20, 2, block_size, hkv, d)
    block_tables = block_tables_for(ctx, block_size, 20, extra=1)
    context_lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    b = len(ctx)
    qkv = torch.randn(b, (hq + 2 * hkv) * d, device=DEVICE).to(dtype)
    q, k, v = (x.reshape(b, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], -1))
    bias = torch.randn((hq + 2 * hkv) * d, device=DEVICE).to(dtype)
    positions = context_lens.long() - 1
    slots = slots_of(block_tables, positions, block_size)
    cs = cos_sin_cache(64, d)
    qk_norm = qk_norm_weights(d, dtype) if with_norm else None
    expected = cache.clone()
    ref = paged_decode_attention_rotary_ref(q, k, v, expected[:, 1, 0], expected[:, 1, 1], block_tables,
                                            context_lens, positions, slots, cs, d**-0.5, bias, ks, vs, qk_norm=qk_norm)
    sem = torch.zeros(b * hkv, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention_rotary(q, k, v, k_cache, v_cache, block_tables, context_lens, positions,
                                        slots.int(), cs, d**-0.5, bias, ks, vs, num_splits=num_splits, semaphores=sem,
                                        qk_norm=qk_norm)
    assert rel_error(out, ref) < 2 * TOL[dtype]
    if dtype == torch.float32 and not with_norm:
        assert torch.equal(_bits(cache), _bits(expected))  # the new tokens' K/V, quantized alike
    else:  # a bf16 ulp of the rotated k (or an fp32 ulp of rstd) may cross an fp8 rounding boundary (see above)
        _assert_fp8_close(cache, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scales", SCALES)
def test_prefill_attention_dequantizes_like_the_reference(poison_empty, dtype, scales):
    ks, vs = (_scale(s) for s in scales)
    hq, hkv, d, block_size = 4, 2, 32, 4
    ctx, new = [20, 7, 33], [20, 3, 17]  # a whole prompt, and chunks over cached prefixes
    _, k_cache, v_cache = fp8_cache(40, 2, block_size, hkv, d)
    block_tables = block_tables_for(ctx, block_size, 40)
    context_lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 20, 23, 40], dtype=torch.int32, device=DEVICE)
    assert cu.diff().tolist() == new
    q = torch.randn(40, hq, d, dtype=dtype, device=DEVICE)
    out = paged_prefill_attention(q, k_cache, v_cache, block_tables, cu, context_lens, d**-0.5, ks, vs)
    ref = paged_prefill_attention_ref(q.float(), k_cache, v_cache, block_tables, cu, context_lens, d**-0.5, ks, vs)
    assert rel_error(out, ref) < TOL[dtype]


def test_fp8_attention_stays_close_to_the_unquantized_one():
    # Not garbage: e4m3 keeps ~2^-4 relative precision per value, so attention over the
    # quantized cache is within a few percent of attention over the values it came from.
    hq, hkv, d, block_size, ctx = 4, 2, 64, 8, [50, 17]
    exact = torch.randn(20, 1, 2, block_size, hkv, d, device=DEVICE)
    quant = torch.zeros_like(exact, dtype=FP8_KV_DTYPE)
    slots = torch.arange(20 * block_size, device=DEVICE)
    kv_cache_write(exact[:, 0, 0].reshape(-1, hkv, d), exact[:, 0, 1].reshape(-1, hkv, d), quant[:, 0, 0],
                   quant[:, 0, 1], slots)
    block_tables = block_tables_for(ctx, block_size, 20)
    lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, hq, d, device=DEVICE)
    got = paged_decode_attention(q, quant[:, 0, 0], quant[:, 0, 1], block_tables, lens, d**-0.5)
    want = paged_decode_attention_ref(q, exact[:, 0, 0], exact[:, 0, 1], block_tables, lens, d**-0.5)
    assert 0 < rel_error(got, want) < 0.05


def test_scale_arguments_are_checked():
    _, k_cache, v_cache = fp8_cache(4, 1, 4, 2, 16, layer=0)
    plain = torch.zeros(4, 4, 2, 16, device=DEVICE)
    key = torch.randn(3, 2, 16, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match=r"kv_cache_write: k_scale/v_scale are for an fp8 KV cache"):
        kv_cache_write(key, key, plain, plain.clone(), slots, _scale(1.0), _scale(1.0))
    with pytest.raises(TypeError, match=r"kv_cache_write: k_scale has dtype float64"):
        kv_cache_write(key, key, k_cache, v_cache, slots, torch.ones(1, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match=r"v_scale has shape \[2\], expected \[1\]"):
        kv_cache_write(key, key, k_cache, v_cache, slots, _scale(1.0), torch.ones(2, device=DEVICE))
    q = torch.randn(1, 4, 16, device=DEVICE)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    lens = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match=r"paged_decode_attention: k_cache has dtype int8"):
        paged_decode_attention(q, k_cache.view(torch.int8), v_cache.view(torch.int8), bt, lens, 0.25)
