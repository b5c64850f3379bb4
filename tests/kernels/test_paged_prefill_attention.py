"""paged_prefill_attention: varlen causal Triton kernel with cached prefixes against the reference."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref
from pdserve.kernels.paged_prefill_attention import paged_prefill_attention
from tests.kernels.kernel_inputs import DEVICE, TOL, bad_argument_inputs, block_tables_for, paged_kv, rel_error

CASES = [
    # (Hq, Hkv, D, block_size, context_lens, new query counts): fresh prompts, cached prefixes
    # (ctx > n), a sequence with no new queries, one query, and n > tile size (16 under the
    # interpreter) with a prefix that is not a multiple of the tile.
    (4, 4, 64, 16, [7, 37], [7, 37]),
    (6, 2, 40, 5, [37, 20, 5, 50], [21, 0, 1, 33]),
    (8, 2, 32, 8, [19, 64], [19, 17]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference(poison_empty, dtype, case):
    hq, hkv, d, block_size, ctx, n = CASES[case]
    _, k_cache, v_cache = paged_kv(40, 2, block_size, hkv, d, dtype)
    block_tables = block_tables_for(ctx, block_size, 40)
    context_lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0] + n, dtype=torch.int32, device=DEVICE).cumsum(0, dtype=torch.int32)
    q = torch.randn(sum(n), hq, d, dtype=dtype, device=DEVICE)
    out = paged_prefill_attention(q, k_cache, v_cache, block_tables, cu, context_lens, d**-0.5)
    ref = paged_prefill_attention_ref(q.float(), k_cache.float(), v_cache.float(), block_tables, cu, context_lens,
                                      d**-0.5)
    assert out.dtype == dtype
    assert rel_error(out, ref) < TOL[dtype]


def test_single_query_equals_decode(poison_empty):
    # One new token per sequence is a decode step: both kernels must agree with the decode ref.
    ctx = [13, 1, 29]
    _, k_cache, v_cache = paged_kv(20, 1, 4, 2, 16, torch.float32, layer=0)
    block_tables = block_tables_for(ctx, 4, 20)
    context_lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, 4, 16, device=DEVICE)
    cu = torch.arange(4, dtype=torch.int32, device=DEVICE)
    out = paged_prefill_attention(q, k_cache, v_cache, block_tables, cu, context_lens, 0.25)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, 0.25)
    assert rel_error(out, ref) < TOL[torch.float32]


def test_rejects_bad_arguments():
    k_cache, v_cache, q, bt, lens = bad_argument_inputs(5)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE)
    fn = paged_prefill_attention
    with pytest.raises(ValueError, match=r"cu_seqlens_q has shape \[2\], expected \[3\]"):
        fn(q, k_cache, v_cache, bt, cu[:2], lens, 0.25)
    with pytest.raises(TypeError, match="cu_seqlens_q has dtype int64"):
        fn(q, k_cache, v_cache, bt, cu.long(), lens, 0.25)
    with pytest.raises(ValueError, match=r"block_tables has shape \[1, 3\], expected \[2, \*\]"):
        fn(q, k_cache, v_cache, bt[:1], cu, lens, 0.25)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        fn(q.tolist(), k_cache, v_cache, bt, cu, lens, 0.25)
    with pytest.raises(ValueError, match="query heads \\(4\\) must be a multiple of KV heads \\(3\\)"):
        fn(q, *paged_kv(8, 1, 4, 3, 16, torch.float32, layer=0)[1:], bt, cu, lens, 0.25)
