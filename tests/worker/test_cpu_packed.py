"""CPU bf16 linears on oneDNN's packed weights (worker/models/cpu_packed.py) give F.linear's values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_native, cpu_small_gemm
from pdserve.worker.models import cpu_packed
from pdserve.worker.parallel.layers import ParallelLinear
from pdserve.worker.request.sampling_params import SamplingParams
from tests.helpers.engines import make_engine

pytestmark = pytest.mark.skipif(
    not cpu_packed.wanted(torch.device("cpu"), torch.bfloat16), reason="this CPU's oneDNN has no bf16 kernels"
)


@pytest.mark.parametrize("rows", [0, 1, 3, 32, 257])
def test_packed_linear_equals_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(384, 576, generator=g).bfloat16() * 0.05
    bias = torch.randn(384, generator=g).bfloat16()
    x = torch.randn(rows, 576, generator=g).bfloat16()
    packed = cpu_packed.pack(w)
    assert torch.equal(cpu_packed.packed_linear(x, packed, None), F.linear(x, w))
    assert torch.equal(cpu_packed.packed_linear(x, packed, bias), F.linear(x, w, bias))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "deepseek-v3", "gpt-oss"])
def test_engine_greedy_unchanged_by_packing(tiny_checkpoint, monkeypatch, arch):
    """A bf16 engine packs its linears and its (tied or not) head; the greedy tokens are those of
    the plain weights, prefill and decode, and nothing is left unpacked that should be. Batch
    invariance off: its prompts' linears are oneDNN's, F.linear's bits (test_batch_invariance.py
    covers it on)."""
    monkeypatch.setattr(cpu_native, "_batch_invariant", False)
    prompts = [[5, 17, 300, 42, 9, 1000, 77], list(range(100, 137)), [3, 4]]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ckpt = tiny_checkpoint(arch)
    monkeypatch.setenv(cpu_packed.ENV, "0")
    plain = make_engine(ckpt, dtype="bfloat16")
    assert plain.runner.model.packed_head is None
    expected = plain.generate(prompts, greedy)
    monkeypatch.delenv(cpu_packed.ENV)
    engine = make_engine(ckpt, dtype="bfloat16")
    model = engine.runner.model
    assert model.packed_head is not None
    linears = [m for m in model.modules() if isinstance(m, ParallelLinear)]
    assert linears and all(m.packed and m.weight.is_mkldnn for m in linears)
    if cpu_small_gemm.attach(cpu_packed.pack(torch.randn(64, 64).bfloat16())):  # the kernel reads this CPU's layout
        # then decode steps (and these short prompts) ran it: its greedy tokens are the plain ones too
        assert all(cpu_small_gemm.attached(m.weight) for m in linears if m.weight.shape[0] % cpu_small_gemm.BLOCK == 0)
        assert cpu_small_gemm.attached(model.packed_head)
    assert engine.generate(prompts, greedy) == expected
