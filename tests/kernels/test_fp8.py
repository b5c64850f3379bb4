"""FP8 kernels against their references: activation quantization (fp8_quant.py), the 128x128
block-scaled GEMM (fp8_block_gemm.py), and the FP8 linear method's GPU path end to end (the
quantization kernel, then torch._scaled_mm or the block GEMM) on a fused q/k/v layer.

Under the interpreter torch._scaled_mm runs on CPU (torch >= 2.10 has a CPU implementation of
row-wise scaling), so the whole kernel path of a layer is exercised here, not only on a GPU."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.fp8_block_gemm import fp8_block_gemm
from pdserve.kernels.fp8_quant import quantize_fp8
from pdserve.kernels.reference import (
    dequantize_fp8_ref,
    fp8_block_gemm_ref,
    fp8_gemv_ref,
    fp8_scaled_mm_ref,
    quantize_fp8_ref,
)
from tests.kernels.kernel_inputs import DEVICE, ON_GPU, rel_error

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,group", [(3, 200, None), (5, 300, 128), (1, 128, 128), (4, 64, None)])
def test_quantize_matches_reference(poison_empty, dtype, m, k, group):
    x = (torch.randn(m, k, device=DEVICE) * torch.logspace(-2, 2, k, device=DEVICE)).to(dtype)
    if m > 1:
        x[-1] = 0  # an all-zero row gets the minimum scale, not a division by zero
    q, s = quantize_fp8(x, group_size=group)
    q_ref, s_ref = quantize_fp8_ref(x, group)
    assert q.dtype == FP8 and s.shape == s_ref.shape == (m, 1 if group is None else -(-k // group))
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    # Equal e4m3 codes, up to one code where x / scale lands within float rounding of a tie.
    assert (q.float() != q_ref.float()).float().mean() < 0.01
    assert rel_error(q.float(), q_ref.float()) < 1e-2


@pytest.mark.parametrize("static", [False, True])
def test_quantize_wide_rows_loop_over_tiles(poison_empty, monkeypatch, static):
    # Rows wider than one tile (none in today's models) take the two-pass loop.
    import pdserve.kernels.fp8_quant as fp8_quant

    monkeypatch.setattr(fp8_quant, "MAX_TILE", 64)
    x = torch.randn(3, 200, device=DEVICE) * 10
    scale = torch.tensor([0.04], device=DEVICE) if static else None
    q, s = quantize_fp8(x, static_scale=scale)
    q_ref, s_ref = quantize_fp8_ref(x, static_scale=scale)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert rel_error(q.float(), q_ref.float()) < 1e-2


def test_quantize_static_scale_writes_it_per_row(poison_empty):
    x = torch.randn(6, 96, device=DEVICE) * 100  # some values saturate at +-448
    scale = torch.tensor([0.05], device=DEVICE)
    q, s = quantize_fp8(x, static_scale=scale)
    q_ref, s_ref = quantize_fp8_ref(x, static_scale=scale)
    assert torch.equal(s, s_ref) and s.shape == (6, 1)
    assert q.float().abs().max() == 448 and rel_error(q.float(), q_ref.float()) < 1e-2


@pytest.mark.parametrize("m,n,k,scale_rows", [
    (1, 192, 256, 128),  # decode-sized M, two scale groups
    (20, 130, 300, 128),  # partial N, K and M tiles
    (70, 96, 200, 1),  # per-row scales (fused parts off the 128-row grid)
    (40, 96, 1200, 128),  # a decode batch with few tiles: K split (fp8_block_gemm._split_k)
])
def test_block_gemm_matches_reference(poison_empty, m, n, k, scale_rows):
    a, a_s = quantize_fp8_ref(torch.randn(m, k, device=DEVICE), 128)
    b = (torch.randn(n, k, device=DEVICE) * 3).to(FP8)
    b_s = torch.rand(-(-n // scale_rows), -(-k // 128), device=DEVICE) + 0.01
    out = fp8_block_gemm(a, a_s, b, b_s, scale_rows, torch.float32)
    ref = fp8_block_gemm_ref(a, a_s, b, b_s, scale_rows, torch.float64)
    # Hopper's FP8 tensor cores add a group's products in reduced precision (DeepSeek-V3's
    # report: about 14 bits) before the fp32 accumulation: a looser bound on the GPU.
    assert out.shape == (m, n) and rel_error(out, ref) < (1e-3 if ON_GPU else 1e-5)
    assert rel_error(fp8_block_gemm(a, a_s, b, b_s, scale_rows, torch.bfloat16), ref) < 1e-2


@pytest.mark.parametrize("split", [2, 3, 10])
def test_block_gemm_split_k_sums_in_a_fixed_order(poison_empty, split):
    """Each K slice's partials are added by the tile's last slice in slice order: the reference's
    product, the same bits on every call, and the arrival counters left at zero for the next."""
    from pdserve.kernels.arrivals import strip_counters

    m, n, k = 24, 160, 1280  # 10 scale groups; a partial N tile
    a, a_s = quantize_fp8_ref(torch.randn(m, k, device=DEVICE), 128)
    b = (torch.randn(n, k, device=DEVICE) * 3).to(FP8)
    b_s = torch.rand(-(-n // 128), k // 128, device=DEVICE) + 0.01
    tiles = dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=2, SPLIT_K=split)
    out = fp8_block_gemm(a, a_s, b, b_s, 128, torch.float32, tiles=tiles)
    ref = fp8_block_gemm_ref(a, a_s, b, b_s, 128, torch.float64)
    assert rel_error(out, ref) < (1e-3 if ON_GPU else 1e-5)
    assert torch.equal(fp8_block_gemm(a, a_s, b, b_s, 128, torch.float32, tiles=tiles), out)
    assert not strip_counters(out.device).any()


@pytest.mark.parametrize("m,n,k,split", [(20, 130, 300, None), (64, 96, 1200, None), (24, 160, 1280, 3)])
def test_rowwise_gemm_is_scaled_mms_product(poison_empty, m, n, k, split):
    """Per-token x per-row scales on the block GEMM's tiles (K split by the rule or as asked):
    torch._scaled_mm's row-wise product."""
    from pdserve.kernels.fp8_block_gemm import fp8_rowwise_gemm

    a, a_s = quantize_fp8_ref(torch.randn(m, k, device=DEVICE))
    b = (torch.randn(n, k, device=DEVICE) * 3).to(FP8)
    b_s = torch.rand(1, n, device=DEVICE) + 0.01
    tiles = None if split is None else dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=2, SPLIT_K=split)
    out = fp8_rowwise_gemm(a, a_s, b, b_s, torch.float32, tiles=tiles)
    ref = fp8_scaled_mm_ref(a, a_s, b, b_s, torch.float64)
    assert out.shape == (m, n) and rel_error(out, ref) < (1e-3 if ON_GPU else 1e-5)
    assert torch.equal(fp8_rowwise_gemm(a, a_s, b, b_s.reshape(-1), torch.float32, tiles=tiles), out)
    with pytest.raises(ValueError, match="b_scale must hold"):
        fp8_rowwise_gemm(a, a_s, b, b_s[:, :-1], torch.float32)


def test_k_is_split_for_decode_batches_whose_tiles_leave_sms_idle():
    from pdserve.kernels.fp8_block_gemm import SPLIT_MAX_M, _split_k

    # Llama-3.1-8B at 64 rows on a 132-SM card: qkv (96 tiles), o and down (64), gate_up (448).
    assert [_split_k(64, t, g, 132) for t, g in ((96, 32), (64, 32), (64, 112), (448, 32))] == [4, 6, 6, 1]
    assert _split_k(SPLIT_MAX_M + 1, 64, 112, 132) == 1  # past the measured rows: one slice
    assert _split_k(17, 2, 7, 132) == 1  # slices of at least MIN_SPLIT_GROUPS groups


def test_block_gemm_rejects_bad_arguments():
    a, a_s = quantize_fp8_ref(torch.randn(2, 256, device=DEVICE), 128)
    b = torch.zeros(64, 256, device=DEVICE).to(FP8)
    with pytest.raises(ValueError, match=r"b_scale has shape \[1, 1\], expected \[1, 2\]"):
        fp8_block_gemm(a, a_s, b, torch.ones(1, 1, device=DEVICE), 128, torch.bfloat16)
    with pytest.raises(TypeError, match="b has dtype bfloat16"):
        fp8_block_gemm(a, a_s, b.bfloat16(), torch.ones(1, 2, device=DEVICE), 128, torch.bfloat16)


# -- the FP8 linear method's GPU path on one fused layer ------------------------------------------

def _qkv_layer(weight: str, activation: str):
    from pdserve.worker.config.model import ModelConfig
    from pdserve.worker.config.quantization import Fp8Config
    from pdserve.worker.parallel.layers import QKVParallelLinear
    from pdserve.worker.parallel.shard import TPShard
    from pdserve.worker.quantization.fp8_linear import Fp8LinearMethod

    cfg = ModelConfig("LlamaForCausalLM", 100, 256, 512, 1, 4, 2, 64, 1e-5, 128, False, False, False, False,
                      1e4, (), ())
    fp8 = Fp8Config("fp8", weight, activation, "weight_scale_inv" if weight == "block" else "weight_scale")
    with torch.device("meta"):
        layer = QKVParallelLinear(256, 64, False, TPShard(0, 1, cfg), Fp8LinearMethod(fp8))
    return layer.to_empty(device=DEVICE), fp8


@pytest.mark.parametrize("weight,activation,w8a8", [
    ("channel", "token", "scaled_mm"), ("channel", "static", "scaled_mm"), ("block", "group", "scaled_mm"),
    ("channel", "token", "triton"), ("channel", "static", "triton"),  # 48 rows on fp8_rowwise_gemm
])
def test_fp8_linear_kernel_path_matches_reference(weight, activation, w8a8, monkeypatch):
    from pdserve.worker.quantization import fp8_linear

    monkeypatch.setattr(fp8_linear, "TRITON_ROWWISE_MAX_M", 128 if w8a8 == "triton" else 0)
    layer, fp8 = _qkv_layer(weight, activation)
    torch.manual_seed(0)
    dense = {}
    for part, rows in (("q", 256), ("k", 128), ("v", 128)):
        w = torch.randn(rows, 256, device=DEVICE)
        if weight == "block":
            s = torch.rand(rows // 128, 2, device=DEVICE) * 0.01 + 1e-3
            w8 = (w / s.repeat_interleave(128, 0).repeat_interleave(128, 1)).clamp(-448, 448).to(FP8)
        else:
            s = torch.rand((), device=DEVICE) * 0.01 + 1e-3  # per-tensor, written into each row
            w8 = (w / s).clamp(-448, 448).to(FP8)  # CUDA's cast makes NaN past e4m3's range; the CPU's saturates
        layer.weight_loader(layer.weight, w8, part)
        layer.weight_loader(getattr(layer, fp8.scale_name), s, part)
        if activation == "static":
            layer.weight_loader(layer.input_scale, torch.tensor({"q": 0.02, "k": 0.03, "v": 0.025}[part]), part)
        dense[part] = dequantize_fp8_ref(w8, s.reshape(-1).expand(rows) if weight != "block"
                                         else s.repeat_interleave(128, 0), fp8.block)
    layer.quant.process_weights_after_loading(layer, torch.bfloat16, kernels=True)
    assert layer.weight.dtype == FP8
    assert getattr(layer, "scale_rows", 128) == 128  # the q/k/v parts sit on the 128-row grid
    # 5 rows: the decode path (fp8_gemv, activations unquantized); 48 rows: W8A8.
    x = torch.randn(5, 256, device=DEVICE).bfloat16()
    out = layer(x)
    assert out.shape == (5, 512) and out.dtype == torch.bfloat16
    scale_rows = (layer.scale_rows if weight == "block" else None)
    assert rel_error(out, fp8_gemv_ref(x.double(), layer.weight, layer.w_scale, scale_rows)) < 1e-2
    x = torch.randn(48, 256, device=DEVICE).bfloat16()
    out = layer(x)
    if weight == "block":
        xq, xs = quantize_fp8_ref(x, 128)
        ref = fp8_block_gemm_ref(xq, xs, layer.weight, layer.w_scale, 128, torch.float64)
    else:
        static = torch.tensor([0.03], device=DEVICE) if activation == "static" else None  # the parts' max
        xq, xs = quantize_fp8_ref(x, static_scale=static)
        ref = fp8_scaled_mm_ref(xq, xs, layer.weight, layer.w_scale, torch.float64)
    assert out.shape == (48, 512) and out.dtype == torch.bfloat16
    assert rel_error(out, ref) < 1e-2
    # And near the unquantized-activation product: FP8 activations cost a few percent at most.
    w = torch.cat([dense["q"], dense["k"], dense["v"]])
    assert rel_error(out, x.double() @ w.double().t()) < 0.08


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,scale_rows", [(1, 40, 200, None), (5, 64, 256, None), (16, 33, 300, None),
                                              (1, 256, 384, 128), (7, 100, 200, 1), (16, 130, 128, 128),
                                              (40, 72, 256, None), (64, 50, 384, 128)])
def test_fp8_gemv_matches_reference(poison_empty, dtype, m, n, k, scale_rows):
    from pdserve.kernels.fp8_gemv import fp8_gemv
    from pdserve.kernels.reference import fp8_gemv_ref

    torch.manual_seed(0)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    w8 = (torch.randn(n, k, device=DEVICE) * 100).clamp(-448, 448).to(FP8)
    if scale_rows is None:
        scale = torch.rand(1, n, device=DEVICE) * 0.01 + 1e-3
    else:
        scale = torch.rand(-(-n // scale_rows), -(-k // 128), device=DEVICE) * 0.01 + 1e-3
    ref = fp8_gemv_ref(x.double(), w8, scale, scale_rows)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    out = fp8_gemv(x, w8, scale, scale_rows)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_error(out, ref) < tol
    # K split in 2 and 3 (fp32 partials summed by the second kernel), narrow row blocks.
    for split, bk in ((2, 64), (3, 128)):
        cfg = dict(BLOCK_N=16, BLOCK_K=bk, SPLIT_K=split, num_warps=4, num_stages=2)
        assert rel_error(fp8_gemv(x, w8, scale, scale_rows, config=cfg), ref) < tol


@pytest.mark.parametrize("m,n,k,scale_rows", [(1, 40, 300, None), (5, 64, 256, None), (1, 100, 384, 128),
                                              (7, 100, 256, 1)])
def test_fp8_gemv_in_kernel_reduce_is_the_second_launch_bit_for_bit(poison_empty, m, n, k, scale_rows):
    from pdserve.kernels.fp8_gemv import fp8_gemv
    from pdserve.kernels.arrivals import strip_counters

    torch.manual_seed(1)
    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    w8 = (torch.randn(n, k, device=DEVICE) * 100).clamp(-448, 448).to(FP8)
    if scale_rows is None:
        scale = torch.rand(n, device=DEVICE) * 0.01 + 1e-3
    else:
        scale = torch.rand(-(-n // scale_rows), -(-k // 128), device=DEVICE) * 0.01 + 1e-3
    cfg = dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=3, num_warps=4, num_stages=2)
    launch = fp8_gemv(x, w8, scale, scale_rows, config=cfg)
    here = [fp8_gemv(x, w8, scale, scale_rows, config=dict(cfg, REDUCE_IN_KERNEL=True)) for _ in range(3)]
    # Whichever slice program comes last adds the slices in slice order: the second launch's
    # bits on every run, and every strip's counter is back at zero for the next launch.
    assert all(torch.equal(h, launch) for h in here)
    assert not strip_counters(x.device).any()
    assert rel_error(launch, fp8_gemv_ref(x.double(), w8, scale, scale_rows)) < 1e-2
    # One row: the first weight tile loaded before the PDL wait (the loop's first step peeled off)
    # is the same product, split or not, summed in one launch or two.
    if m == 1:
        for extra in ({}, {"REDUCE_IN_KERNEL": True}, {"SPLIT_K": 1}):
            early = fp8_gemv(x, w8, scale, scale_rows, config=dict(cfg, EARLY_W=True, **extra))
            assert torch.equal(early, fp8_gemv(x, w8, scale, scale_rows, config=dict(cfg, **extra)))


@pytest.mark.parametrize("m,scale_rows,cfg", [
    (1, None, None), (1, 128, None), (5, None, None),
    (1, None, dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=3, num_warps=4, num_stages=2, REDUCE_IN_KERNEL=True, EARLY_W=True)),
    (1, 128, dict(BLOCK_N=16, BLOCK_K=256, SPLIT_K=2, num_warps=4, num_stages=2, EARLY_W=True)),  # wide steps
    (5, 128, dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=3, num_warps=4, num_stages=2))])
def test_fp8_gemv_prologues_are_the_ops_before_it(poison_empty, m, scale_rows, cfg):
    from pdserve.kernels.fp8_gemv import fp8_gemv, fp8_prologue_gemv
    from pdserve.kernels.reference import rms_norm_ref
    from pdserve.kernels.rms_norm import rms_norm
    from pdserve.kernels.silu_and_mul import silu_and_mul

    # The RMSNorm (with and without a residual) and the SiLU·mul fused into the FP8 GEMV's K loop:
    # the unfused kernels' values, split or not, early weights, wide group steps, 1 or 5 rows.
    torch.manual_seed(4)
    n, k = 100, 384
    w8 = (torch.randn(n, k, device=DEVICE) * 100).clamp(-448, 448).to(FP8)
    scale = torch.rand(1, n, device=DEVICE) * 0.01 + 1e-3 if scale_rows is None else \
        torch.rand(1, 3, device=DEVICE) * 0.01 + 1e-3
    x, r = (torch.randn(m, k, device=DEVICE).to(torch.bfloat16) for _ in range(2))
    g = (1 + 0.1 * torch.randn(k, device=DEVICE)).to(torch.bfloat16)
    for res in (None, r):
        out, new_res = fp8_prologue_gemv(x, w8, scale, scale_rows, "rms_norm", norm_weight=g, eps=1e-5, residual=res,
                                         config=cfg)
        h, sum_res = rms_norm(x, g, 1e-5, res)
        apart = fp8_gemv(h, w8, scale, scale_rows, config=cfg)
        assert (new_res is None) == (res is None) and (res is None or torch.equal(new_res, sum_res))
        assert out.shape == (m, n) and out.dtype == torch.bfloat16
        assert rel_error(out, fp8_gemv_ref(rms_norm_ref(x, g, 1e-5, res)[0].double(), w8, scale, scale_rows)) < 2e-2
        if ON_GPU:  # the norm kernel sums the row's squares in one reduction, this one K tile by K tile
            assert rel_error(out, apart) < 1e-2
        else:  # the interpreter's sums agree: the same bits
            assert torch.equal(out, apart)
    gu = torch.randn(m, 2 * k, device=DEVICE).to(torch.bfloat16)
    out, none = fp8_prologue_gemv(gu, w8, scale, scale_rows, "silu_mul", config=cfg)
    assert none is None and torch.equal(out, fp8_gemv(silu_and_mul(gu), w8, scale, scale_rows, config=cfg))


def test_fp8_gemv_prologue_arguments_are_checked():
    from pdserve.kernels.fp8_gemv import fp8_prologue_gemv

    w8, s = torch.zeros(32, 64, device=DEVICE).to(FP8), torch.ones(32, device=DEVICE)
    x = torch.zeros(1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="prologue must be one of"):
        fp8_prologue_gemv(x, w8, s, None, "gelu")
    with pytest.raises(ValueError, match="needs norm_weight"):
        fp8_prologue_gemv(x, w8, s, None, "rms_norm")
    with pytest.raises(ValueError, match="for prologue 'rms_norm'"):
        fp8_prologue_gemv(torch.zeros(1, 128, device=DEVICE), w8, s, None, "silu_mul", residual=x)
    with pytest.raises(ValueError, match=r"x has shape \[1, 64\], expected \[\*, 128\]"):  # silu_mul: [gate | up]
        fp8_prologue_gemv(x, w8, s, None, "silu_mul")


@pytest.mark.parametrize("n,k,scale_rows", [(256, 1024, 128), (100, 700, 128), (48, 384, 16)])
def test_fp8_gemv_wide_steps_over_group_scales_match_reference(poison_empty, n, k, scale_rows):
    from pdserve.kernels.fp8_gemv import fp8_gemv
    from pdserve.kernels.reference import fp8_gemv_ref

    # One row, K steps of 2-8 whole 128-column groups (each column of x scaled by its group's
    # scale): split or not, summed in one launch or two, the first tile loaded early; K not a
    # multiple of the step (700: a partial last group) nor of the group.
    torch.manual_seed(2)
    x = torch.randn(1, k, device=DEVICE).to(torch.bfloat16)
    w8 = (torch.randn(n, k, device=DEVICE) * 100).clamp(-448, 448).to(FP8)
    scale = torch.rand(-(-n // scale_rows), -(-k // 128), device=DEVICE) * 0.01 + 1e-3
    ref = fp8_gemv_ref(x.double(), w8, scale, scale_rows)
    for bn, bk, split, extra in ((16, 256, 1, {}), (8, 512, 2, {}), (4, 1024, 1, {"EARLY_W": True}),
                                 (16, 256, 3, {"REDUCE_IN_KERNEL": True, "EARLY_W": True})):
        cfg = dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=4, num_stages=2, **extra)
        out = fp8_gemv(x, w8, scale, scale_rows, config=cfg)
        assert out.shape == (1, n) and rel_error(out, ref) < 1e-2, cfg


def test_fp8_gemv_wide_steps_refused_or_replaced_where_groups_differ_per_row(poison_empty):
    from pdserve.kernels import fp8_gemv as g
    from pdserve.kernels.reference import fp8_gemv_ref

    torch.manual_seed(3)
    w8 = (torch.randn(64, 512, device=DEVICE) * 100).clamp(-448, 448).to(FP8)
    scale = torch.rand(64, 4, device=DEVICE) * 0.01 + 1e-3  # one scale row per weight row
    x = torch.randn(1, 512, device=DEVICE)
    wide = dict(BLOCK_N=8, BLOCK_K=512, SPLIT_K=1, num_warps=4, num_stages=2)
    # Asked for: refused, naming why (a strip of 8 rows spans 8 rows of scales; two rows of x).
    with pytest.raises(ValueError, match="spans several scale groups"):
        g.fp8_gemv(x, w8, scale, 1, config=wide)
    with pytest.raises(ValueError, match="spans several scale groups"):
        g.fp8_gemv(torch.randn(2, 512, device=DEVICE), w8, torch.rand(1, 4, device=DEVICE), 128, config=wide)
    # From the table (measured at 128 scale rows, keyed without them): the rule's tiles instead.
    card = torch.cuda.get_device_name(x.device) if x.is_cuda else "cpu"
    try:
        g.use_configs({card: {g.config_key(64, 512, True, 1): wide}})
        assert rel_error(g.fp8_gemv(x, w8, scale, 1), fp8_gemv_ref(x.double(), w8, scale, 1)) < 1e-5
    finally:
        g.use_configs({})


def test_fp8_gemv_default_tiles_split_k_for_few_rows_and_take_measured_ones():
    from pdserve.kernels import fp8_gemv as g

    assert g.default_config(4096, 14336, False, 1)["SPLIT_K"] > 1  # 128 row blocks: K split
    assert g.default_config(28672, 4096, False, 1)["SPLIT_K"] == 1  # 896 row blocks already
    assert g.default_config(4096, 4096, True, 4)["BLOCK_K"] == 128  # group scales: one group a step
    assert g.default_config(4096, 4096, False, 64)["BLOCK_K"] == 128  # 64-row x tiles: shorter steps
    # Tables keep one row, 2-16 rows and 17-64 rows apart.
    assert [g.config_key(8, 16, False, m) for m in (1, 2, 16, 17, 64)] == ["8,16,0,1", "8,16,0,0", "8,16,0,0",
                                                                           "8,16,0,64", "8,16,0,64"]
    # Group scales: about seven programs per SM (132 SMs), a split never under two steps.
    assert g.default_config(7168, 16384, True, 1) == dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=8, num_warps=4,
                                                          num_stages=3)  # 112 row blocks x 8
    assert g.default_config(576, 7168, True, 1)["SPLIT_K"] == 16  # 18 row blocks
    assert g.default_config(1024, 256, True, 1)["SPLIT_K"] == 1  # two steps of K in all
    x = torch.zeros(1, 256, device=DEVICE)
    card = torch.cuda.get_device_name(x.device) if x.is_cuda else "cpu"
    measured = dict(BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, num_warps=8, num_stages=3)
    try:
        g.use_configs({card: {g.config_key(512, 256, False, 1): measured}})
        assert g.choose_config(x, 512, 256, False) == measured
        assert g.choose_config(x, 512, 256, True) == g.default_config(512, 256, True, 1, g.num_sms(x.device))
    finally:
        g.use_configs({})


def test_fp8_gemv_refuses_what_it_cannot_run():
    from pdserve.kernels.fp8_gemv import fp8_gemv

    w8 = torch.zeros(32, 64, device=DEVICE).to(FP8)
    with pytest.raises(ValueError, match="at most 64 rows"):
        fp8_gemv(torch.zeros(65, 64, device=DEVICE), w8, torch.ones(32, device=DEVICE))
    with pytest.raises(ValueError, match="per-channel scales"):
        fp8_gemv(torch.zeros(2, 64, device=DEVICE), w8, torch.ones(31, device=DEVICE))
