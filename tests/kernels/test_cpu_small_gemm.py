"""The small-batch GEMM (kernels/cpu_small_gemm.c through cpu_small_gemm.py) on oneDNN's packed bf16
weights: a decode batch's rows (1-32) against SmolLM2's five linear shapes give the exact product
rounded to bf16, within fp32 summation order (at most one bf16 step from oneDNN's output, rarely);
strided rows and the cases it leaves to oneDNN; with batch invariance on, any number of rows, each
row's bits those of the row computed alone (cpu_native.step_invariant)."""

from __future__ import annotations

import shutil

import pytest
import torch

from pdserve.kernels import cpu_native, cpu_small_gemm
from pdserve.worker.models import cpu_packed

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None or not cpu_packed.wanted(torch.device("cpu"), torch.bfloat16),
    reason="no C compiler, or this CPU's oneDNN has no bf16 kernels",
)

SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # qkv, o, gate_up, down, head


def _attached(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).bfloat16()
    packed = cpu_packed.pack(w)
    if not cpu_small_gemm.attach(packed):
        pytest.skip("the kernel does not read this CPU's packed layout (AMX, or no AVX512-BF16)")
    return w, packed


def _within_fp32_order(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """got = bf16(x @ w^T) up to an fp32 sum's order: at most one bf16 step off the exact product,
    plus the fp32 rounding of the summands' magnitudes (cancellation near zero)."""
    exact = x.double() @ w.double().T
    bound = exact.abs() * 2**-7 + (x.double().abs() @ w.double().abs().T) * 2**-20
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    assert ((got.double() - exact).abs() <= bound).all()


def test_the_kernel_builds_here():
    assert cpu_small_gemm.library() is not None


@pytest.mark.parametrize("n,k", SMOLLM2_SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 32])
def test_small_linear_is_the_product(n, k, rows):
    w, packed = _attached(n, k, seed=n + k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = cpu_small_gemm.small_linear(x, packed)
    assert got is not None
    _within_fp32_order(got, x, w)
    onednn = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    assert ((got.float() - onednn.float()).abs() <= onednn.float().abs() * 2**-7 + 1e-6).all()
    assert (got != onednn).float().mean() < 0.01


def test_strided_rows():
    w, packed = _attached(960, 576)
    x = torch.randn(7, 2 * 576, generator=torch.Generator().manual_seed(1)).bfloat16()[:, :576]
    got = cpu_small_gemm.small_linear(x, packed)
    _within_fp32_order(got, x, w)
    assert torch.equal(got, cpu_small_gemm.small_linear(x.contiguous(), packed))


def test_left_to_onednn(monkeypatch):
    _, packed = _attached(576, 576)
    monkeypatch.setattr(cpu_native, "_step_invariant", False)
    assert cpu_small_gemm.small_linear(torch.randn(cpu_small_gemm.MAX_ROWS + 1, 576).bfloat16(), packed) is None
    assert cpu_small_gemm.small_linear(torch.randn(2, 576), packed) is None  # fp32 rows
    assert not cpu_small_gemm.attach(cpu_packed.pack(torch.randn(100, 576).bfloat16()))  # not 64-column blocks
    unattached = cpu_packed.pack(torch.randn(64, 576).bfloat16())  # packed, never attached (pack_model attaches)
    assert cpu_small_gemm.small_linear(torch.randn(2, 576).bfloat16(), unattached) is None


def test_switched_off(monkeypatch):
    monkeypatch.setenv(cpu_small_gemm.ENV, "0")
    assert not cpu_small_gemm.attach(cpu_packed.pack(torch.randn(576, 576).bfloat16()))


@pytest.mark.parametrize("n,k", SMOLLM2_SHAPES[:4])
@pytest.mark.parametrize("threads", [1, 2])
def test_batch_invariant_rows(monkeypatch, n, k, threads):
    """Batch-invariant: a prompt's rows (many, split over threads, six a pass) and a decode
    batch's (four a pass) give each row the bits it gets alone, with or without a bias."""
    monkeypatch.setattr(cpu_native, "_step_invariant", True)
    monkeypatch.setattr(cpu_native, "_threads", threads)
    w, packed = _attached(n, k, seed=n + k)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(203, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    many = cpu_small_gemm.packed_linear(x, packed, None)
    _within_fp32_order(many, x, w)
    alone = torch.cat([cpu_small_gemm.packed_linear(x[i:i + 1], packed, None) for i in range(len(x))])
    assert torch.equal(many, alone)
    for lo, hi in [(0, 5), (17, 49), (100, 203)]:  # other batch sizes, other offsets
        assert torch.equal(cpu_small_gemm.packed_linear(x[lo:hi], packed, None), many[lo:hi])
    with_bias = cpu_small_gemm.packed_linear(x, packed, bias)
    assert torch.equal(with_bias, many + bias)
    assert torch.equal(cpu_small_gemm.packed_linear(x[3:4], packed, bias), with_bias[3:4])
