"""fused_moe with gpt-oss's expert math: biases, the clamped SwiGLU and MXFP4 weights (W4A16), on
both paths (decode GEMVs, sorted grouped GEMM), under expert parallelism, against fused_moe_ref on
the dequantized weights; fused_moe_ref on the packed weights is that same function.

MXFP4 weights are random bytes and exponents (every e2m1 code, scales 2^-9 .. 2^-3), not a
quantized Gaussian, so each code and both nibbles of a byte matter. H = 96 is three exponent
groups: the 64-wide K tiles end on a half-masked step (as gpt-oss's 2880 = 90 groups do).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from pdserve.kernels.fused_moe import (
    MX_UNSCALE,
    _decode_gate_up,
    _e2m1_pair,
    _e2m1_word,
    _e8m0,
    _mx_activations,
    fused_moe,
    fused_moe_routed,
    mx_activations,
    moe_decode_config,
)
from pdserve.kernels.moe_activation import SILU_AND_MUL, SwigluOAI
from pdserve.kernels.mxfp4 import dequantize_mxfp4
from pdserve.kernels.reference import fused_moe_ref, fused_moe_routed_ref
from tests.kernels.kernel_inputs import DEVICE, rel_error
from tests.kernels.test_fused_moe import moe_inputs

H, INTER, E_ROUTED, E_HELD, TOP_K = 96, 64, 8, 4, 2
SORTED_TILES = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, num_warps=4, num_stages=2)
DECODE_TILES = dict(GU_BLOCK_N=16, GU_BLOCK_K=64, GU_WARPS=4, DOWN_BLOCK_N=16, DOWN_BLOCK_K=64, DOWN_WARPS=4)
SWIGLU = SwigluOAI(alpha=1.702, limit=1.0)  # a small limit: the clamps cut a good share of gate and up


def mxfp4_experts(seed: int = 0):
    """Random MXFP4 w13 [E, 2I, H/2] / w2 [E, H, I/2] with their exponents, and the dequantized twins (fp32)."""
    g = torch.Generator().manual_seed(seed)

    def one(n, k):
        packed = torch.randint(0, 256, (E_HELD, n, k // 2), dtype=torch.uint8, generator=g)
        scales = torch.randint(118, 125, (E_HELD, n, k // 32), dtype=torch.uint8, generator=g)
        return packed.to(DEVICE), scales.to(DEVICE)

    (q13, s13), (q2, s2) = one(2 * INTER, H), one(H, INTER)
    return q13, s13, q2, s2, dequantize_mxfp4(q13, s13), dequantize_mxfp4(q2, s2)


def biases(dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(E_HELD, 2 * INTER, generator=g) * 0.5).to(DEVICE, dtype),
            (torch.randn(E_HELD, H, generator=g) * 0.5).to(DEVICE, dtype))


def routed_inputs(t: int, dtype, drop: float, offset: int = 0):
    """x [T, H] and a routing over 8 experts (some ids -1: held nowhere); the first token's two
    experts are held by the op that holds [offset, offset + 4), so the result is never all zero."""
    x, _, _, w, ids = moe_inputs(t, H, 8, E_ROUTED, TOP_K, dtype=dtype, seed=t, drop=drop)
    ids[0] = torch.tensor([offset + 2, offset + 1])
    return x, w, ids


# bf16 activations: the interpreter truncates fp32 -> bf16 (test_fused_moe.py's 2.5e-2); fp32: exact
# weights and fp32 accumulation leave ~1e-6.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2.5e-2}


@pytest.mark.parametrize("weights", ["mxfp4", "plain"])
@pytest.mark.parametrize("gpt_oss", [True, False], ids=["bias-swiglu", "silu"])
@pytest.mark.parametrize("path,t,offset,drop,dtype", [
    ("decode", 1, 0, 0.0, torch.float32), ("decode", 5, 4, 0.3, torch.bfloat16),
    ("sorted", 5, 0, 0.0, torch.bfloat16), ("sorted", 33, 4, 0.3, torch.float32),
])
def test_kernel_matches_reference(poison_empty, weights, gpt_oss, path, t, offset, drop, dtype):
    # This op holds experts [offset, offset + 4) of the 8 routed: ids of the other four (and -1)
    # contribute nothing.
    x, w, ids = routed_inputs(t, dtype, drop, offset)
    q13, s13, q2, s2, d13, d2 = mxfp4_experts()
    b13, b2 = biases(dtype) if gpt_oss else (None, None)
    act = SWIGLU if gpt_oss else SILU_AND_MUL
    if weights == "mxfp4":
        a, b, scales = q13, q2, dict(w13_scale=s13, w2_scale=s2)
    else:
        a, b, scales = d13.to(dtype), d2.to(dtype), {}
    out = fused_moe(x, a, b, w, ids, config=SORTED_TILES if path == "sorted" else DECODE_TILES, path=path,
                    expert_offset=offset, w13_bias=b13, w2_bias=b2, activation=act, **scales)
    double = {k: v.double() for k, v in (("w13_bias", b13), ("w2_bias", b2)) if v is not None}
    ref = fused_moe_ref(x.double(), d13.double(), d2.double(), w, ids, expert_offset=offset, activation=act, **double)
    assert out.shape == x.shape and out.dtype == dtype and not out.isnan().any()
    assert rel_error(out, ref) < TOLERANCE[dtype]
    none_held = ((ids < offset) | (ids >= offset + E_HELD)).all(dim=1)
    assert (out[none_held] == 0).all()  # a token with none of its experts here gets exact zeros


@triton.jit
def _decode_kernel(q_ptr, s_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    lo, hi = _e2m1_pair(tl.load(q_ptr + i).to(tl.int32))
    scale = _e8m0(tl.load(s_ptr + i).to(tl.int32))
    tl.store(out_ptr + 2 * i, lo * scale)
    tl.store(out_ptr + 2 * i + 1, hi * scale)


def test_in_kernel_decoding_of_every_byte_and_exponent_is_exact():
    # The kernels' decoders (fused_moe._e2m1_pair, _e8m0) on all 256 bytes under exponents from 2^-126
    # to 2^123 equal the reference codec bit for bit.
    exps = torch.tensor([1, 100, 126, 127, 128, 140, 200, 250], dtype=torch.uint8)
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(len(exps)).to(DEVICE)
    scales = exps.repeat_interleave(256).to(DEVICE)
    out = torch.empty(2 * packed.numel(), device=DEVICE)
    _decode_kernel[(1,)](packed, scales, out, N=packed.numel())
    ref = dequantize_mxfp4(packed.view(-1, 16), exps.repeat_interleave(256 // 16).view(-1, 1).to(DEVICE))
    assert torch.equal(out.view(-1, 32), ref)


def test_reference_on_packed_weights_is_the_dequantized_reference():
    x, w, ids = routed_inputs(7, torch.float32, 0.2, offset=4)
    q13, s13, q2, s2, d13, d2 = mxfp4_experts()
    b13, b2 = biases(torch.float32)
    kw = dict(expert_offset=4, w13_bias=b13, w2_bias=b2, activation=SWIGLU)
    assert torch.equal(fused_moe_ref(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2, **kw),
                       fused_moe_ref(x, d13, d2, w, ids, **kw))


@pytest.mark.parametrize("path,t", [("decode", 2), ("sorted", 5)])
def test_a_wrong_decoding_of_the_bytes_fails_the_tolerance(path, t):
    # The check above can fail: swapped nibbles, or exponents read one off, move the result far
    # outside the tolerance, while the right decoding is within it.
    x, w, ids = routed_inputs(t, torch.float32, 0.0)
    q13, s13, q2, s2, d13, d2 = mxfp4_experts()
    cfg = SORTED_TILES if path == "sorted" else DECODE_TILES
    ref = fused_moe_ref(x.double(), d13.double(), d2.double(), w, ids, expert_offset=0, activation=SWIGLU)

    def err(a13, a2, e13, e2):
        out = fused_moe(x, a13, a2, w, ids, config=cfg, path=path, w13_scale=e13, w2_scale=e2, activation=SWIGLU)
        return rel_error(out, ref)

    assert err(q13, q2, s13, s2) < TOLERANCE[torch.float32]
    swap = (q13 >> 4) | (q13 << 4), (q2 >> 4) | (q2 << 4)
    assert err(*swap, s13, s2) > 100 * TOLERANCE[torch.float32]
    assert err(q13, q2, s13 + 1, s2) > 100 * TOLERANCE[torch.float32]


@pytest.mark.parametrize("t", [1, 5, 33])
def test_routed_layer_op_with_gpt_oss_experts(poison_empty, t):
    # The model's call: fused_moe_routed from the router's logits with packed weights, biases and
    # the clamped SwiGLU, default tiles (decode path at 1 token, routing + sort in one launch
    # above), against fused_moe_routed_ref given the very same arguments.
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, H, generator=g).to(DEVICE, torch.bfloat16)
    logits = (torch.randn(t, E_ROUTED, generator=g) * 2).to(DEVICE, torch.bfloat16)
    q13, s13, q2, s2, _, _ = mxfp4_experts()
    b13, b2 = biases(torch.bfloat16)
    kw = dict(expert_offset=4, w13_bias=b13, w2_bias=b2, activation=SWIGLU, w13_scale=s13, w2_scale=s2)
    out = fused_moe_routed(x, q13, q2, logits, TOP_K, True, **kw)
    ref = fused_moe_routed_ref(x.double(), q13, q2, logits, TOP_K, True, **dict(kw, w13_bias=b13.double(),
                                                                                w2_bias=b2.double()))
    assert (out.cpu().double() - ref.cpu()).norm() <= TOLERANCE[torch.bfloat16] * ref.norm()
    assert not out.isnan().any()


def test_mxfp4_arguments_are_checked():
    x, w, ids = routed_inputs(3, torch.bfloat16, 0.0)
    q13, s13, q2, s2, _, _ = mxfp4_experts()
    ok = dict(w13_scale=s13, w2_scale=s2)
    with pytest.raises(ValueError, match="e4m3 weights take w13_scale and w2_scale"):
        fused_moe(x, q13, q2, w, ids)
    with pytest.raises(ValueError, match="w13_scale has shape"):
        fused_moe(x, q13, q2, w, ids, w13_scale=s13[:, :, :2], w2_scale=s2)
    with pytest.raises(TypeError, match="w2_scale has dtype float32"):
        fused_moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2.float())
    with pytest.raises(ValueError, match="w2 has shape"):
        fused_moe(x, q13, q2[:, :, :16], w, ids, **ok)
    with pytest.raises(ValueError, match="H a multiple of 32"):
        fused_moe(x[:, :80], q13[:, :, :40], q2[:, :80], w, ids, w13_scale=s13[:, :, :2], w2_scale=s2[:, :80])
    with pytest.raises(ValueError, match="block is for FP8"):
        fused_moe(x, q13, q2, w, ids, block=(128, 128), **ok)
    with pytest.raises(ValueError, match="multiples of 32 for MXFP4"):
        fused_moe(x, q13, q2, w, ids, config=dict(SORTED_TILES, BLOCK_K=16), **ok)
    with pytest.raises(ValueError, match="w13_bias has shape"):
        fused_moe(x, q13, q2, w, ids, w13_bias=torch.zeros(E_HELD, INTER, device=DEVICE), **ok)
    with pytest.raises(TypeError, match="activation must be"):
        fused_moe(x, q13, q2, w, ids, activation="swiglu", **ok)
    with pytest.raises(ValueError, match="limit must be > 0"):
        SwigluOAI(1.702, 0.0)


@pytest.mark.skipif(DEVICE == "cpu", reason="real sizes compiled on a GPU (tools/gpu/moe.sh runs this file there)")
@pytest.mark.parametrize("t", [1, 4, 16, 64])
def test_gpt_oss_20b_layer_on_the_gpu(t):
    # gpt-oss-20b's expert layer (E=32, k=4, H=I=2880: 90 exponent groups, default tiles' last K
    # steps masked) through the model's op: decode path (1, 4, 16), routing + sort in one launch (64);
    # bit-stable, and a CUDA graph replays it to the same bits.
    e, h, inter = 32, 2880, 2880
    g = torch.Generator(device=DEVICE).manual_seed(t)

    def rand_mx(n, k):
        return (torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=DEVICE, generator=g),
                torch.randint(119, 124, (e, n, k // 32), dtype=torch.uint8, device=DEVICE, generator=g))

    (q13, s13), (q2, s2) = rand_mx(2 * inter, h), rand_mx(h, inter)
    b13 = torch.randn(e, 2 * inter, device=DEVICE, generator=g).bfloat16() * 0.1
    b2 = torch.randn(e, h, device=DEVICE, generator=g).bfloat16() * 0.1
    x = torch.randn(t, h, device=DEVICE, generator=g).bfloat16()
    logits = torch.randn(t, e, device=DEVICE, generator=g).bfloat16()
    act = SwigluOAI(1.702, 7.0)
    kw = dict(w13_bias=b13, w2_bias=b2, activation=act, w13_scale=s13, w2_scale=s2)
    out = fused_moe_routed(x, q13, q2, logits, 4, True, **kw)
    ref = fused_moe_routed_ref(x.float(), q13, q2, logits, 4, True, **dict(kw, w13_bias=b13.float(),
                                                                          w2_bias=b2.float()))
    assert rel_error(out, ref) < 1e-2
    assert torch.equal(out, fused_moe_routed(x, q13, q2, logits, 4, True, **kw))  # bit-stable
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe_routed(x, q13, q2, logits, 4, True, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fused_moe_routed(x, q13, q2, logits, 4, True, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, out)


@triton.jit
def _word_decode_kernel(q_ptr, s_ptr, out_ptr, WORDS: tl.constexpr):
    # The kernels' word decoder (_e2m1_word, then 2^126 and the exponent, as the sorted GEMM's
    # tiles) on WORDS int32 words; one exponent per 4 words (a 32-input group).
    w = tl.arange(0, WORDS)
    q = tl.load(q_ptr + w)
    f = _e8m0(tl.load(s_ptr + w // 4).to(tl.int32))
    for j in tl.static_range(8):
        tl.store(out_ptr + 8 * w + j, _e2m1_word(q, j) * MX_UNSCALE * f)


def test_word_decoder_of_every_byte_in_every_position_is_exact():
    # Every byte value in each of a word's 4 byte positions, under exponents from 2^-126 to 2^1:
    # bit for bit the reference codec (the subnormal code 0.5 included: on a GPU this checks that
    # nothing flushes it to zero).
    exps = torch.tensor([1, 60, 100, 118, 121, 124, 127, 128], dtype=torch.uint8)
    byte = torch.arange(256, dtype=torch.int32)
    packed = torch.stack([torch.roll(byte, 64 * p) for p in range(4)], dim=1).to(torch.uint8).reshape(-1)  # 1 KiB
    packed = packed.repeat(len(exps))  # one 32-input group = 16 bytes = 4 words
    scales = exps.repeat_interleave(1024 // 16)
    words = packed.view(torch.int32).to(DEVICE)
    out = torch.empty(2 * packed.numel(), device=DEVICE)
    _word_decode_kernel[(1,)](words, scales.to(DEVICE), out, WORDS=words.numel())
    ref = dequantize_mxfp4(packed.view(-1, 16), scales.view(-1, 1))
    assert torch.equal(out.view(-1, 32).cpu(), ref)


def test_sorted_one_dot_variant_matches_reference(poison_empty):
    # MX_ONE_DOT: a K step's 8 nibble tiles joined into one operand in input order (one dot a step);
    # fp32 for the tight tolerance (a misordered join is far outside it).
    dtype = torch.float32
    x, w, ids = routed_inputs(33, dtype, 0.3, offset=4)
    q13, s13, q2, s2, d13, d2 = mxfp4_experts()
    b13, b2 = biases(dtype)
    out = fused_moe(x, q13, q2, w, ids, config=dict(SORTED_TILES, MX_ONE_DOT=True), path="sorted", expert_offset=4,
                    w13_scale=s13, w2_scale=s2, w13_bias=b13, w2_bias=b2, activation=SWIGLU)
    ref = fused_moe_ref(x.double(), d13.double(), d2.double(), w, ids, expert_offset=4, activation=SWIGLU,
                        w13_bias=b13.double(), w2_bias=b2.double())
    assert rel_error(out, ref) < TOLERANCE[dtype]


def test_decode_prefetch_variant_matches_reference(poison_empty):
    # GU_PREFETCH: the gate|up GEMV loads step k + 1's words before step k's FMAs (H = 96 with
    # 64-wide steps: a half-masked last step, and a prefetch past the end that reads nothing).
    x, w, ids = routed_inputs(5, torch.float32, 0.3, offset=4)
    q13, s13, q2, s2, d13, d2 = mxfp4_experts()
    b13, b2 = biases(torch.float32)
    out = fused_moe(x, q13, q2, w, ids, config=dict(DECODE_TILES, GU_PREFETCH=True), path="decode", expert_offset=4,
                    w13_scale=s13, w2_scale=s2, w13_bias=b13, w2_bias=b2, activation=SWIGLU)
    ref = fused_moe_ref(x.double(), d13.double(), d2.double(), w, ids, expert_offset=4, activation=SWIGLU,
                        w13_bias=b13.double(), w2_bias=b2.double())
    assert rel_error(out, ref) < TOLERANCE[torch.float32]


# The decode path's memory-parallel variants (moe_decode_config's knobs): K split over programs
# with fp32 partials summed in a fixed order by a finish launch (gate|up: GU_SPLIT_K, then bias,
# activation, weight; down: DOWN_SPLIT_K, one program per expert slot and share of I), x in
# nibble-major order (GU_X_NM). H = I = 96 with 64-wide steps: 2 steps, the last half-masked, so
# a split of 2 ends on the masked step and a split of 3 leaves a program with no step at all.
@pytest.mark.parametrize("knobs,t,offset,drop", [
    (dict(DOWN_SPLIT_K=1), 1, 0, 0.0),
    (dict(DOWN_SPLIT_K=2, GU_SPLIT_K=2, GU_X_NM=True), 5, 4, 0.3),
    (dict(DOWN_SPLIT_K=3, GU_SPLIT_K=3, GU_PREFETCH=True, GU_X_NM=True), 3, 4, 0.3),
    (dict(DOWN_SPLIT_K=3, GU_SPLIT_K=3), 3, 4, 0.3),
    # strips wider than the rows left (I = 64 in 128-row gate|up strips, H = 96 in 64-row down strips):
    # the whole steps leave the words of rows past the end undefined, never stored
    (dict(GU_BLOCK_N=128, DOWN_BLOCK_N=64, DOWN_SPLIT_K=2, GU_X_NM=True), 2, 4, 0.3),
], ids=["down1", "split2-xnm", "split3-prefetch-xnm", "split3", "rows-past-the-end"])
def test_decode_split_variants_match_reference(poison_empty, knobs, t, offset, drop):
    x, w, ids = routed_inputs(t, torch.float32, drop, offset)
    q13, s13, q2, s2, d13, d2 = mxfp4_experts()
    b13, b2 = biases(torch.float32)
    out = fused_moe(x, q13, q2, w, ids, config=dict(DECODE_TILES, **knobs), path="decode", expert_offset=offset,
                    w13_scale=s13, w2_scale=s2, w13_bias=b13, w2_bias=b2, activation=SWIGLU)
    ref = fused_moe_ref(x.double(), d13.double(), d2.double(), w, ids, expert_offset=offset, activation=SWIGLU,
                        w13_bias=b13.double(), w2_bias=b2.double())
    assert rel_error(out, ref) < TOLERANCE[torch.float32]
    none_held = ((ids < offset) | (ids >= offset + E_HELD)).all(dim=1)
    assert (out[none_held] == 0).all()
    if "DOWN_SPLIT_K" in knobs:  # the in-launch sum: the finish launch's bits
        here = fused_moe(x, q13, q2, w, ids, config=dict(DECODE_TILES, **knobs, DOWN_REDUCE_HERE=True), path="decode",
                         expert_offset=offset, w13_scale=s13, w2_scale=s2, w13_bias=b13, w2_bias=b2,
                         activation=SWIGLU)
        assert torch.equal(here, out)


def test_decode_split_knobs_are_checked():
    x, w, ids = routed_inputs(2, torch.float32, 0.0)
    q13, s13, q2, s2, _, _ = mxfp4_experts()
    for bad in (dict(GU_SPLIT_K=0), dict(DOWN_SPLIT_K=-1), dict(DOWN_SPLIT_K=True)):
        with pytest.raises(ValueError, match="must be an int"):
            fused_moe(x, q13, q2, w, ids, config=dict(DECODE_TILES, **bad), path="decode", w13_scale=s13,
                      w2_scale=s2)


# The sorted path on tl.dot_scaled (MX_DOT_SCALED, the default MXFP4 tiles with bf16 / fp16
# activations): Triton decodes the packed bytes for the tensor cores; 64- and 128-wide K steps (the
# 8-dot path's least is 128), H = 96 ends on a half-masked step.
@pytest.mark.parametrize("block_k,t,offset,drop", [(64, 33, 4, 0.3), (128, 5, 0, 0.0)])
def test_sorted_dot_scaled_matches_reference(poison_empty, block_k, t, offset, drop):
    dtype = torch.bfloat16
    x, w, ids = routed_inputs(t, dtype, drop, offset)
    q13, s13, q2, s2, d13, d2 = mxfp4_experts()
    b13, b2 = biases(dtype)
    cfg = dict(SORTED_TILES, BLOCK_K=block_k, MX_DOT_SCALED=True)
    out = fused_moe(x, q13, q2, w, ids, config=cfg, path="sorted", expert_offset=offset, w13_scale=s13,
                    w2_scale=s2, w13_bias=b13, w2_bias=b2, activation=SWIGLU)
    ref = fused_moe_ref(x.double(), d13.double(), d2.double(), w, ids, expert_offset=offset, activation=SWIGLU,
                        w13_bias=b13.double(), w2_bias=b2.double())
    assert rel_error(out, ref) < TOLERANCE[dtype]
    none_held = ((ids < offset) | (ids >= offset + E_HELD)).all(dim=1)
    assert (out[none_held] == 0).all()


def test_dot_scaled_knob_is_checked_and_fp32_keeps_the_integer_decoders(poison_empty):
    x, w, ids = routed_inputs(2, torch.float32, 0.0)
    q13, s13, q2, s2, d13, d2 = mxfp4_experts()
    with pytest.raises(ValueError, match="MX_DOT_SCALED must be True or False"):
        fused_moe(x, q13, q2, w, ids, config=dict(SORTED_TILES, MX_DOT_SCALED=1), path="sorted", w13_scale=s13,
                  w2_scale=s2)
    with pytest.raises(ValueError, match="BLOCK_K of 128 unless MX_DOT_SCALED runs"):  # fp32 x: the 8 dots run
        fused_moe(x, q13, q2, w, ids, config=dict(SORTED_TILES, BLOCK_K=64, MX_DOT_SCALED=True), path="sorted",
                  w13_scale=s13, w2_scale=s2)
    # fp32 activations have no scaled-dot format: the default tiles (MX_DOT_SCALED) keep the exact
    # integer decoders running, to fp32's tolerance.
    out = fused_moe(x, q13, q2, w, ids, path="sorted", w13_scale=s13, w2_scale=s2)
    assert rel_error(out, fused_moe_ref(x.double(), d13.double(), d2.double(), w, ids)) < TOLERANCE[torch.float32]


def _gpt_oss_20b_layer(t: int):
    """gpt-oss-20b's expert layer at its real sizes (90 exponent groups), random MXFP4 experts and
    biases, t tokens routed to 4 experts each (one slot held nowhere)."""
    e, h, inter = 32, 2880, 2880
    g = torch.Generator(device=DEVICE).manual_seed(t)
    q13 = torch.randint(0, 256, (e, 2 * inter, h // 2), dtype=torch.uint8, device=DEVICE, generator=g)
    s13 = torch.randint(119, 124, (e, 2 * inter, h // 32), dtype=torch.uint8, device=DEVICE, generator=g)
    q2 = torch.randint(0, 256, (e, h, inter // 2), dtype=torch.uint8, device=DEVICE, generator=g)
    s2 = torch.randint(119, 124, (e, h, inter // 32), dtype=torch.uint8, device=DEVICE, generator=g)
    b13 = torch.randn(e, 2 * inter, device=DEVICE, generator=g).bfloat16() * 0.1
    b2 = torch.randn(e, h, device=DEVICE, generator=g).bfloat16() * 0.1
    x = torch.randn(t, h, device=DEVICE, generator=g).bfloat16()
    w, ids = torch.softmax(torch.randn(t, 4, device=DEVICE, generator=g), -1), torch.randperm(e, device=DEVICE)[:4]
    ids = torch.stack([torch.roll(ids, i) for i in range(t)]).int()
    ids[0, 1] = -1  # an expert held nowhere
    return x, q13, s13, q2, s2, b13, b2, w, ids


@pytest.mark.skipif(DEVICE == "cpu", reason="real sizes compiled on a GPU (tools/gpu/mxfp4_decode.sh)")
@pytest.mark.parametrize("t,path,cfg", [
    (1, "decode", dict(GU_BLOCK_N=16, GU_BLOCK_K=512, GU_WARPS=4, DOWN_BLOCK_N=16, DOWN_BLOCK_K=256, DOWN_WARPS=8,
                       GU_X_NM=True, GU_SPLIT_K=3, DOWN_SPLIT_K=2)),
    (16, "decode", dict(GU_BLOCK_N=16, GU_BLOCK_K=512, GU_WARPS=4, DOWN_BLOCK_N=16, DOWN_BLOCK_K=256, DOWN_WARPS=8,
                        GU_X_NM=True, GU_SPLIT_K=3, DOWN_SPLIT_K=2)),
    (64, "sorted", dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, MX_DOT_SCALED=True)),
    (64, "sorted", dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3, MX_DOT_SCALED=True)),
], ids=["split-1", "split-16", "dot-scaled-16rows", "dot-scaled-64rows"])
def test_decode_split_variants_on_gpt_oss_20b_layer(t, path, cfg):
    # The split / nibble-major decode variants and the sorted tl.dot_scaled tiles at gpt-oss-20b's real layer (the
    # 512-wide gate|up steps split 3 ways end on a masked step): close to the reference, bit-stable,
    # and a CUDA graph replays them to the same bits (the partial buffers are sized by shapes alone).
    x, q13, s13, q2, s2, b13, b2, w, ids = _gpt_oss_20b_layer(t)
    act = SwigluOAI(1.702, 7.0)
    kw = dict(w13_scale=s13, w2_scale=s2, w13_bias=b13, w2_bias=b2, activation=act, config=cfg, path=path)
    out = fused_moe(x, q13, q2, w, ids, **kw)
    ref = fused_moe_ref(x.float(), q13, q2, w, ids, w13_scale=s13, w2_scale=s2, w13_bias=b13.float(),
                        w2_bias=b2.float(), activation=act)
    assert rel_error(out, ref) < 1e-2
    assert torch.equal(out, fused_moe(x, q13, q2, w, ids, **kw))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_moe(x, q13, q2, w, ids, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fused_moe(x, q13, q2, w, ids, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, out)


def test_decode_knobs_by_batch_size(monkeypatch):
    # MXFP4_DECODE_KNOBS: the first entry whose largest T fits joins the default tiles; none = plain.
    import pdserve.kernels.fused_moe as fm

    plain = fm.moe_decode_config(4, 2880, mxfp4=True)
    assert fm.moe_decode_config(4, 2880, mxfp4=True, tokens=1) == plain  # the table ships empty
    monkeypatch.setattr(fm, "MXFP4_DECODE_KNOBS", ((1, dict(DOWN_SPLIT_K=3)), (8, dict(GU_X_NM=True))))
    assert fm.moe_decode_config(4, 2880, mxfp4=True, tokens=1) == dict(plain, DOWN_SPLIT_K=3)
    assert fm.moe_decode_config(4, 2880, mxfp4=True, tokens=8) == dict(plain, GU_X_NM=True)
    assert fm.moe_decode_config(4, 2880, mxfp4=True, tokens=9) == plain
    # bf16: MXFP4's table does not apply; one token takes the split down pass, FP8 and 2+ tokens do not.
    bf16 = fm.moe_decode_config(4, 2880)
    assert fm.moe_decode_config(4, 2880, tokens=2) == bf16
    assert fm.moe_decode_config(4, 2880, tokens=1) == dict(bf16, **fm.BF16_ONE_TOKEN_DOWN)
    assert "DOWN_SPLIT_K" not in fm.moe_decode_config(4, 2880, fp8=True, tokens=1)


@triton.jit
def _round_kernel(v_ptr, out_ptr, cast_ptr, N: tl.constexpr, ROUND: tl.constexpr):
    # The pre-scaled path (_mx_activations with ROUND) beside the plain one: the fp32 values stored
    # into a tensor of the activation dtype (the intermediate rows as they were written before).
    v = tl.load(v_ptr + tl.arange(0, N))
    tl.store(out_ptr + tl.arange(0, N), _mx_activations(v, ROUND))
    tl.store(cast_ptr + tl.arange(0, N), v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pre_scaled_activations_round_as_the_activation_dtype(dtype):
    # What the MXFP4 GEMVs read (_mx_activations): fp32 values rounded to the activation dtype (ROUND)
    # then times 2^64 equal the values a row of that dtype holds (the same kernel's own cast, so the
    # interpreter's truncation and the GPU's rounding both count) times 2^64; values near rounding
    # boundaries, signed zeros and fp16's largest.
    g = torch.Generator().manual_seed(3)
    v = torch.cat([torch.randn(4096, generator=g) * 10.0 ** torch.randint(-6, 4, (4096,), generator=g),
                   torch.tensor([0.0, -0.0, 1.0 + 2.0 ** -8, 1.0 + 2.0 ** -9, 1.0 + 3 * 2.0 ** -9, 65504.0])])
    v = torch.cat([v, torch.zeros(8192 - v.numel())]).to(DEVICE)
    out, cast = torch.empty_like(v), torch.empty(v.shape, dtype=dtype, device=DEVICE)
    rounding = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: None}[dtype]
    _round_kernel[(1,)](v, out, cast, N=v.numel(), ROUND=rounding)
    assert torch.equal(out, cast.float() * 2.0 ** 64)
    assert dtype == torch.float32 or not torch.equal(cast.float(), v)  # the rounding happened


@pytest.mark.parametrize("nibble_major", [True, False])
def test_mx_activations_are_x_times_2_64_in_nibble_major_order(nibble_major):
    # x [T, K] (bf16, rows with a stride) -> fp32 times 2^64; nibble-major: input 32g + 8w + J at place 32g + 4J + w.
    x = torch.randn(3, 2 * 2880, dtype=torch.bfloat16, device=DEVICE)[:, :2880]
    out = mx_activations(x, nibble_major)
    ref = x.float() * 2.0 ** 64
    if nibble_major:
        ref = ref.reshape(3, 90, 4, 8).transpose(2, 3).reshape(3, 2880)
    assert out.dtype == torch.float32 and torch.equal(out, ref)


def test_decode_intermediate_rows_hold_bf16_values(poison_empty):
    # The MXFP4 gate|up pass writes fp32 rows pre-scaled by 2^64, each value a bf16 one (ROUND): the
    # down pass reads what a bf16 row would give it.
    x, w, ids = routed_inputs(3, torch.bfloat16, 0.0)
    q13, s13, _, _, _, _ = mxfp4_experts()
    b13, _ = biases(torch.bfloat16)
    cfg = dict(DECODE_TILES, GU_X_NM=True)
    inter = _decode_gate_up(x, q13, w.reshape(-1).contiguous(), ids, 0, cfg, s13, None, b13, SWIGLU)
    held = ((ids >= 0) & (ids < E_HELD)).reshape(-1)
    values = inter[held] / 2.0 ** 64
    assert inter.dtype == torch.float32 and values.abs().max() > 0
    assert torch.equal(values, values.to(torch.bfloat16).float())


def test_decode_rows_are_batch_invariant(poison_empty):
    # A token's decode result is the same bits alone and in a batch (fixed summation order, no atomics),
    # with the default MXFP4 decode config's knobs (x nibble-major, the down pass split).
    x, w, ids = routed_inputs(5, torch.bfloat16, 0.3)
    q13, s13, q2, s2, _, _ = mxfp4_experts()
    b13, b2 = biases(torch.bfloat16)
    cfg = dict(moe_decode_config(TOP_K, INTER, mxfp4=True), **DECODE_TILES)
    kw = dict(config=cfg, path="decode", w13_scale=s13, w2_scale=s2, w13_bias=b13, w2_bias=b2, activation=SWIGLU)
    batch = fused_moe(x, q13, q2, w, ids, **kw)
    for i in range(x.shape[0]):
        assert torch.equal(fused_moe(x[i:i + 1], q13, q2, w[i:i + 1], ids[i:i + 1], **kw), batch[i:i + 1])
