"""The native CPU decode attention (kernels/cpu_decode_attention.c through cpu_native.py) = the torch
reference, in the engine's layout: bf16 cache blocks that hold every layer (a layer's K and V are
strided views), 16-token blocks, SmolLM2's heads (9 query heads over 3 KV heads of 64), contexts
from one token to several blocks; one thread and a batch split over threads."""

from __future__ import annotations

import shutil

import pytest
import torch

from pdserve.kernels import cpu_native
from pdserve.kernels.cpu_attention import paged_decode_attention_cpu
from pdserve.kernels.reference import paged_decode_attention_ref
from tests.kernels.kernel_inputs import TOL, block_tables_for, rel_error

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the kernel")

BS, HQ, HKV, D = 16, 9, 3, 64
LENS = [1, 16, 17, 40, 5, 33, 64, 3]


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(40, 3, 2, BS, HKV, D, generator=g).bfloat16()  # [blocks, layers, K|V, ...]
    torch.manual_seed(seed)
    tables = block_tables_for(LENS, BS, 40, extra=2).cpu()
    q = torch.randn(len(LENS), HQ, D, generator=g).bfloat16()
    return q, cache[:, 1, 0], cache[:, 1, 1], tables, torch.tensor(LENS, dtype=torch.int32)


def test_kernel_builds_here():
    assert cpu_native.library() is not None


@pytest.mark.parametrize("threads", [1, 2])
def test_native_decode_matches_reference(threads):
    q, k_cache, v_cache, tables, ctx = _inputs()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = paged_decode_attention_cpu(q, k_cache, v_cache, tables, ctx, D**-0.5)
    finally:
        torch.set_num_threads(before)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, D**-0.5)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert rel_error(out, ref) < TOL[torch.bfloat16]
    # fp32 math as the reference's: outputs differ from it by at most one bf16 rounding step.
    assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + 1e-6).all()


def test_batch_does_not_change_a_sequence():
    """A sequence's result is the same alone as in a batch (fixed summation order)."""
    q, k_cache, v_cache, tables, ctx = _inputs(1)
    batch = paged_decode_attention_cpu(q, k_cache, v_cache, tables, ctx, D**-0.5)
    alone = paged_decode_attention_cpu(q[3:4], k_cache, v_cache, tables[3:4], ctx[3:4], D**-0.5)
    assert torch.equal(batch[3:4], alone)
