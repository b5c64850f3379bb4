"""fused_gemv: the small-M GEMV with its RMSNorm / SiLU·mul prologue against the references.

Tolerances are kernel_inputs.TOL. The oracle is the reference run in the input dtype, i.e. the
unfused model path itself (x + residual and the normalised activations rounded to that dtype, as
the kernel rounds them; a float64 reference would not round them and sits a dtype-rounding away
from both). The matrix products of the oracle are float64 for fp32 inputs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve.kernels.fused_gemv import GemvConfig, choose_config, fused_gemv
from pdserve.kernels.reference import rms_norm_gemv_ref, silu_mul_gemv_ref
from tests.kernels.kernel_inputs import DEVICE, ON_GPU, TOL, rel_error

# Triton's interpreter casts fp32 -> bf16 by truncation (toward zero; the GPU rounds to nearest),
# and the bf16 path rounds three times before the product (x + residual, the normalised value,
# times the norm weight): a systematic ~1% shrink on CPU only. fp16 and fp32 keep TOL.
TOL = {**TOL, torch.bfloat16: TOL[torch.bfloat16] if ON_GPU else 2.5e-2}

# (N, K): non-powers of two on both sides, a partial last strip and a partial last K-tile.
SHAPES = [(40, 72), (200, 300)]
SPLIT2 = GemvConfig(block_n=32, block_k=64, split_k=2)  # two K slices + the reduce launch
SPLIT3 = GemvConfig(block_n=16, block_k=32, split_k=3)  # 300 = 128 + 128 + 44: a short last slice
HERE3 = GemvConfig(block_n=16, block_k=32, split_k=3, reduce_in_kernel=True)  # the strip's last program sums
# The norm's two-pass variant (rstd first, the reference's roundings), unsplit and split.
TWO_PASS = GemvConfig(block_n=32, block_k=64, one_pass_norm=False)
TWO_PASS_SPLIT3 = GemvConfig(block_n=16, block_k=32, split_k=3, one_pass_norm=False)


def _inputs(m, n, k, dtype, seed=0, x_cols=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, x_cols or k, generator=g) * 3
    w = torch.randn(n, k, generator=g) / k**0.5
    return x.to(dtype).to(DEVICE), w.to(dtype).to(DEVICE), g


def _f64(*ts):
    return [None if t is None else t.double() for t in ts]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("config", [None, SPLIT2, TWO_PASS_SPLIT3, HERE3],
                         ids=["heuristic", "split2", "two-pass-split3", "split3-in-kernel"])
def test_rms_norm_gemv_matches_reference(poison_empty, dtype, m, n, k, config):
    x, w, g = _inputs(m, n, k, dtype)
    res = (torch.randn(m, k, generator=g)).to(dtype).to(DEVICE)
    nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
    x0, res0 = x.clone(), res.clone()
    out, new_res = fused_gemv(x, w, "rms_norm", norm_weight=nw, eps=1e-6, residual=res, config=config)
    ref, ref_res = rms_norm_gemv_ref(x, nw, 1e-6, w, residual=res)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_error(out, ref) < TOL[dtype]
    assert rel_error(new_res, ref_res) < TOL[dtype]
    assert torch.equal(x, x0) and torch.equal(res, res0)  # inputs untouched


@pytest.mark.parametrize("m", [2, 5])
@pytest.mark.parametrize("config", [None, SPLIT3, TWO_PASS, HERE3],
                         ids=["heuristic", "split3", "two-pass", "in-kernel"])
def test_rms_norm_gemv_without_residual_with_bias(poison_empty, m, config):
    n, k = 200, 300
    x, w, g = _inputs(m, n, k, torch.float32, seed=1)
    nw, bias = torch.randn(k, generator=g).to(DEVICE), torch.randn(n, generator=g).to(DEVICE)
    for b in (None, bias):
        out, new_res = fused_gemv(x, w, "rms_norm", norm_weight=nw, eps=1e-5, bias=b, config=config)
        ref, _ = rms_norm_gemv_ref(*_f64(x, nw), 1e-5, *_f64(w, b))  # fp32: float64 throughout
        assert new_res is None
        assert rel_error(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 4, 7])  # 4: with bias
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("config", [None, SPLIT3, HERE3], ids=["heuristic", "split3", "split3-in-kernel"])
def test_silu_mul_gemv_matches_reference(poison_empty, dtype, m, n, k, config):
    x, w, g = _inputs(m, n, k, dtype, seed=2, x_cols=2 * k)
    bias = torch.randn(n, generator=g).to(dtype).to(DEVICE) if m == 4 else None
    out, none = fused_gemv(x, w, "silu_mul", bias=bias, config=config)
    assert none is None and out.shape == (m, n)
    assert rel_error(out, silu_mul_gemv_ref(x, w, bias)) < TOL[dtype]


# Narrow strips with the prologue as its own launch (the norm / SiLU·mul kernel, then the plain GEMV).
APART = GemvConfig(block_n=2, block_k=128, separate_prologue=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prologue", ["rms_norm", "silu_mul"])
def test_prologue_apart_is_the_prologue_kernel_then_the_plain_gemv(poison_empty, dtype, prologue):
    from pdserve.kernels.rms_norm import rms_norm
    from pdserve.kernels.silu_and_mul import silu_and_mul

    n, k = 40, 300
    x, w, g = _inputs(1, n, k, dtype, seed=5, x_cols=2 * k if prologue == "silu_mul" else k)
    bias = torch.randn(n, generator=g).to(dtype).to(DEVICE)
    plain = GemvConfig(block_n=2, block_k=128)
    if prologue == "rms_norm":
        res = torch.randn(1, k, generator=g).to(dtype).to(DEVICE)
        nw = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEVICE)
        out, new_res = fused_gemv(x, w, "rms_norm", norm_weight=nw, eps=1e-6, residual=res, bias=bias, config=APART)
        h, want_res = rms_norm(x, nw, 1e-6, res)
        ref, _ = rms_norm_gemv_ref(x, nw, 1e-6, w, bias, residual=res)
        assert torch.equal(new_res, want_res)
    else:
        out, new_res = fused_gemv(x, w, "silu_mul", bias=bias, config=APART)
        h, ref = silu_and_mul(x), silu_mul_gemv_ref(x, w, bias)
        assert new_res is None
    # Bit for bit the two launches it stands for; within the kernels' tolerance of the reference.
    assert torch.equal(out, fused_gemv(h, w, bias=bias, config=plain)[0])
    assert rel_error(out, ref) < TOL[dtype]


@pytest.mark.parametrize("m", [1, 6])
def test_plain_gemv_and_row_strided_input(poison_empty, m):
    n, k = 200, 300
    big, w, _ = _inputs(m, n, k, torch.float32, seed=3, x_cols=k + 20)
    x = big[:, :k]  # rows strided, last dimension contiguous
    out, _ = fused_gemv(x, w, config=SPLIT2)
    assert rel_error(out, x.double() @ w.double().t()) < TOL[torch.float32]


def test_split_k_is_deterministic_and_matches_unsplit():
    x, w, g = _inputs(3, 200, 300, torch.float32, seed=4)
    nw = torch.randn(300, generator=g).to(DEVICE)
    a, _ = fused_gemv(x, w, "rms_norm", norm_weight=nw, config=SPLIT3)
    b, _ = fused_gemv(x, w, "rms_norm", norm_weight=nw, config=SPLIT3)
    c, _ = fused_gemv(x, w, "rms_norm", norm_weight=nw, config=GemvConfig(split_k=1))
    assert torch.equal(a, b)
    assert rel_error(a, c.double()) < TOL[torch.float32]


@pytest.mark.parametrize("prologue", ["none", "rms_norm", "silu_mul"])
@pytest.mark.parametrize("m", [1, 3])
def test_in_kernel_reduce_is_the_reduce_launch_bit_for_bit(poison_empty, prologue, m):
    from pdserve.kernels.arrivals import strip_counters

    n, k = 40, 300  # three strips of block_n 16 (the last one partial), each of three K slices
    x, w, g = _inputs(m, n, k, torch.bfloat16, seed=6, x_cols=2 * k if prologue == "silu_mul" else k)
    bias = torch.randn(n, generator=g).to(torch.bfloat16).to(DEVICE)
    kw = {"bias": bias}
    if prologue == "rms_norm":
        kw["norm_weight"] = (1 + 0.1 * torch.randn(k, generator=g)).to(torch.bfloat16).to(DEVICE)
    launch, _ = fused_gemv(x, w, prologue, config=SPLIT3, **kw)
    here = [fused_gemv(x, w, prologue, config=HERE3, **kw)[0] for _ in range(3)]
    # The slices summed in one order by whichever program came last: the second launch's bits,
    # on every run; and the strips' counters are zero again for the next launch (or graph replay).
    assert all(torch.equal(h, launch) for h in here)
    assert not strip_counters(torch.device(DEVICE)).any()


@pytest.mark.parametrize("prologue", ["none", "rms_norm", "silu_mul"])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("config", [GemvConfig(block_n=16, block_k=32), SPLIT3, HERE3, TWO_PASS_SPLIT3,
                                    GemvConfig(block_n=16, block_k=32, separate_prologue=True)])
def test_early_weights_are_the_same_bits(poison_empty, prologue, m, config):
    # The first weight tile loaded before the PDL wait, its step peeled off the K loop: the same
    # product, every prologue, split or not, residual written alike. Three strips (the last one
    # partial) show it; the K loop is what changes.
    n, k = 40, 300
    x, w, g = _inputs(m, n, k, torch.bfloat16, seed=7, x_cols=2 * k if prologue == "silu_mul" else k)
    kw = {"bias": torch.randn(n, generator=g).to(torch.bfloat16).to(DEVICE)}
    if prologue == "rms_norm":
        kw["norm_weight"] = (1 + 0.1 * torch.randn(k, generator=g)).to(torch.bfloat16).to(DEVICE)
        kw["residual"] = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEVICE)
    out, res = fused_gemv(x, w, prologue, config=config, **kw)
    early, early_res = fused_gemv(x, w, prologue, config=replace(config, early_weights=True), **kw)
    assert torch.equal(early, out)
    assert (res is None and early_res is None) or torch.equal(early_res, res)


def test_heuristic_splits_narrow_layers_only():
    dev = torch.device(DEVICE)
    # Few output strips (N = 64: 2 strips) and a long K: split; a wide N: no split.
    assert choose_config("silu_mul", 1, 64, 4096, dev).split_k > 1
    assert choose_config("rms_norm", 1, 1 << 16, 4096, dev).split_k == 1
    # Never more slices than keep 4 K-tiles each.
    cfg = choose_config("none", 1, 16, 512, dev)
    assert cfg.split_k == 1


def test_empty_batch():
    x, w, _ = _inputs(0, 40, 72, torch.float32)
    out, _ = fused_gemv(x, w)
    assert out.shape == (0, 40)


def test_rejects_bad_arguments():
    x, w, _ = _inputs(2, 40, 72, torch.float32)
    with pytest.raises(ValueError, match="at most 8"):
        fused_gemv(torch.randn(9, 72, device=DEVICE), w)
    with pytest.raises(ValueError, match="prologue must be one of"):
        fused_gemv(x, w, "gelu")
    with pytest.raises(ValueError, match="needs norm_weight"):
        fused_gemv(x, w, "rms_norm")
    with pytest.raises(ValueError, match=r"x has shape \[2, 72\], expected \[\*, 144\]"):
        fused_gemv(x, w, "silu_mul")
    with pytest.raises(TypeError, match="x has dtype bfloat16"):
        fused_gemv(x.bfloat16(), w)
    with pytest.raises(ValueError, match="for prologue 'rms_norm'"):
        fused_gemv(x, w, residual=x)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        fused_gemv(torch.randn(72, 2, device=DEVICE).t(), w)


def test_measured_table_picks_config_or_cublas(monkeypatch):
    from pdserve.kernels import fused_gemv as mod

    dev = torch.device(DEVICE)
    cfg = GemvConfig(block_n=64, block_k=128, split_k=4)
    table = {("rms_norm", 6144, 4096, 2): cfg, ("silu_mul", 4096, 14336, 8): None}
    monkeypatch.setitem(mod.MEASURED, mod.card_name(dev), table)
    monkeypatch.setitem(mod.MEASURED, "another card", {("rms_norm", 6144, 4096, 4): None})
    assert choose_config("rms_norm", 2, 6144, 4096, dev) == cfg
    assert choose_config("rms_norm", 3, 6144, 4096, dev) != cfg  # M=3 is bucket 4: heuristic
    assert mod.gemv_preferred("rms_norm", 2, 6144, 4096, dev)
    assert mod.gemv_preferred("rms_norm", 4, 6144, 4096, dev)  # another card's entry does not apply
    assert not mod.gemv_preferred("silu_mul", 5, 4096, 14336, dev)  # bucket 8: cuBLAS measured faster
    assert mod.gemv_preferred("silu_mul", 1, 4096, 14336, dev)
    assert not mod.gemv_preferred("none", 9, 64, 64, dev)  # past MAX_ROWS
    # The engine's default takes only what the card's table names a config for.
    assert mod.gemv_preferred("rms_norm", 2, 6144, 4096, dev, measured_only=True)
    assert not mod.gemv_preferred("rms_norm", 4, 6144, 4096, dev, measured_only=True)  # absent here
    assert not mod.gemv_preferred("silu_mul", 5, 4096, 14336, dev, measured_only=True)
