"""paged_decode_attention: Triton split-K kernel against the reference."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.reference import paged_decode_attention_ref
from pdserve.kernels.paged_decode_attention import paged_decode_attention
from tests.kernels.kernel_inputs import (DEVICE, ON_GPU, TOL, as_double, assert_matches_separate_norm,
                                        bad_argument_inputs, block_tables_for, cos_sin_cache, fused_qkv, paged_kv,
                                        qk_norm_weights, rel_error, slots_of)

CASES = [
    # (Hq, Hkv, D, block_size, context_lens): GQA groups 1/3/4, odd sizes, 1-token and
    # exactly-full-table contexts.
    (4, 4, 64, 16, [1, 33, 16]),
    (6, 2, 40, 5, [23, 1, 11, 30]),
    (8, 2, 32, 8, [64, 57]),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 9 > tiles: some splits are empty. The merge is fused when counters are lent (S = 1 has no merge).
@pytest.mark.parametrize("num_splits,fused_merge", [(None, False), (None, True), (1, False), (3, False), (3, True),
                                                    (9, False), (9, True)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_reference(poison_empty, dtype, num_splits, case, fused_merge):
    hq, hkv, d, block_size, ctx = CASES[case]
    _, k_cache, v_cache = paged_kv(40, 2, block_size, hkv, d, dtype)
    block_tables = block_tables_for(ctx, block_size, 40, extra=0 if case == 0 else 2)
    context_lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(ctx), hq, d, dtype=dtype, device=DEVICE)
    scale = d**-0.5
    sem = torch.zeros(len(ctx) * hkv + 3, dtype=torch.int32, device=DEVICE) if fused_merge else None
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, num_splits=num_splits,
                                 semaphores=sem)
    ref = paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), block_tables, context_lens, scale)
    assert out.dtype == dtype
    assert rel_error(out, ref) < TOL[dtype]
    if sem is not None:
        assert not sem.any(), "the last program of each group must reset its counter"


def test_fused_merge_equals_reduce_kernel_over_repeated_launches():
    # Both paths merge the same partials in the same order (bit for bit under the interpreter);
    # on the GPU, many back-to-back launches on one counter buffer would expose a lost or early
    # merge (a program merging before every partial is visible: stale or unwritten partials).
    hq, hkv, d, bs = (32, 8, 128, 16) if DEVICE == "cuda" else (4, 2, 32, 4)
    ctx = [700, 1, 333, 2048, 64] if DEVICE == "cuda" else [40, 1, 17]
    num_blocks = sum(-(-c // bs) for c in ctx) + 4
    _, k_cache, v_cache = paged_kv(num_blocks, 2, bs, hkv, d, torch.bfloat16)
    block_tables = block_tables_for(ctx, bs, num_blocks)
    context_lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    sem = torch.zeros(len(ctx) * hkv, dtype=torch.int32, device=DEVICE)
    for launch in range(50 if DEVICE == "cuda" else 3):
        q = torch.randn(len(ctx), hq, d, dtype=torch.bfloat16, device=DEVICE)
        plain = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, d**-0.5, num_splits=7)
        fused = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, d**-0.5, num_splits=7,
                                       semaphores=sem)
        if DEVICE == "cuda":  # two compiled kernels may contract multiply-adds differently: an ulp
            assert rel_error(fused, plain) < 4e-3, f"launch {launch}"
        else:
            assert torch.equal(fused, plain), f"launch {launch}"
    assert not sem.any()


def test_strided_query_and_large_scale(poison_empty):
    # q as a view into a fused qkv buffer; a large scale makes the softmax peaky (tests the max).
    _, k_cache, v_cache = paged_kv(16, 1, 4, 2, 16, torch.float32, layer=0)
    qkv = torch.randn(3, 4 + 2 + 2, 16, device=DEVICE)
    q = qkv[:, :4]
    block_tables = block_tables_for([9, 3, 14], 4, 16)
    context_lens = torch.tensor([9, 3, 14], dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, 4.0, num_splits=2)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, 4.0)
    assert rel_error(out, ref) < TOL[torch.float32]


def test_rejects_bad_arguments():
    k_cache, v_cache, q, bt, lens = bad_argument_inputs(2)
    fn = paged_decode_attention
    with pytest.raises(ValueError, match="query heads \\(3\\) must be a multiple of KV heads \\(2\\)"):
        fn(q[:, :3], k_cache, v_cache, bt, lens, 0.25)
    with pytest.raises(ValueError, match=r"k_cache has shape \[8, 4, 2, 16\], expected \[\*, \*, \*, 8\]"):
        fn(q[..., :8], k_cache, v_cache, bt, lens, 0.25)
    with pytest.raises(TypeError, match="k_cache has dtype bfloat16, expected one of float32"):
        fn(q, k_cache.bfloat16(), v_cache.bfloat16(), bt, lens, 0.25)
    with pytest.raises(TypeError, match="block_tables has dtype int64"):
        fn(q, k_cache, v_cache, bt.long(), lens, 0.25)
    with pytest.raises(ValueError, match=r"context_lens has shape \[3\], expected \[2\]"):
        fn(q, k_cache, v_cache, bt, torch.ones(3, dtype=torch.int32, device=DEVICE), 0.25)
    with pytest.raises(ValueError, match="same shape, strides and dtype"):
        fn(q, k_cache, v_cache[:4], bt, lens, 0.25)
    with pytest.raises(ValueError, match="num_splits must be in"):
        fn(q, k_cache, v_cache, bt, lens, 0.25, num_splits=0)
    with pytest.raises(ValueError, match="scale must be finite"):
        fn(q, k_cache, v_cache, bt, lens, float("nan"))
    with pytest.raises(ValueError, match=r"semaphores must be contiguous with >= batch \* kv_heads = 4"):
        fn(q, k_cache, v_cache, bt, lens, 0.25, semaphores=torch.zeros(3, dtype=torch.int32, device=DEVICE))
    with pytest.raises(TypeError, match="semaphores has dtype int64"):
        fn(q, k_cache, v_cache, bt, lens, 0.25, semaphores=torch.zeros(4, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("case,with_bias,with_norm", [
    (0, False, False), (1, True, False), (2, True, False),
    (2, False, True),  # Qwen3: q/k norm, GQA 4
    (1, True, True),  # the bias added before the norm; GQA 3, head_dim 40
])
def test_rotary_variant_writes_the_new_token_and_attends_to_it(poison_empty, dtype, num_splits, case, with_bias,
                                                                with_norm):
    # One launch = rotary_kv_write + decode attention: the new token's k/v are written by the
    # split that holds its position, which then reads them back from the cache.
    from pdserve.kernels.paged_decode_attention import paged_decode_attention_rotary
    from pdserve.kernels.reference import paged_decode_attention_rotary_ref

    torch.manual_seed(case)  # fixed inputs, whatever ran before in this process
    hq, hkv, d, block_size, ctx = CASES[case]
    cache, k_cache, v_cache = paged_kv(40, 2, block_size, hkv, d, dtype)
    block_tables = block_tables_for(ctx, block_size, 40, extra=1)
    context_lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    b = len(ctx)
    q, k, v = fused_qkv(b, hq, hkv, d, dtype)
    bias = torch.randn((hq + 2 * hkv) * d, dtype=dtype, device=DEVICE) if with_bias else None
    qk_norm = qk_norm_weights(d, dtype) if with_norm else None
    positions = context_lens.long() - 1
    slots = slots_of(block_tables, positions, block_size)
    cs = cos_sin_cache(128, d)
    ref_cache = cache.double()
    ref = paged_decode_attention_rotary_ref(q.double(), k.double(), v.double(), ref_cache[:, 1, 0],
                                            ref_cache[:, 1, 1], block_tables, context_lens, positions, slots,
                                            cs.double(), d**-0.5, bias.double() if bias is not None else None,
                                            qk_norm=as_double(qk_norm))
    sem = torch.zeros(b * hkv, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention_rotary(q, k, v, k_cache, v_cache, block_tables, context_lens, positions,
                                        slots.int(), cs, d**-0.5, bias, num_splits=num_splits, semaphores=sem,
                                        qk_norm=qk_norm)
    # Twice the bound: the rotated q and the new K/V are rounded to the cache dtype before the
    # attention (truncated, under the interpreter) where the float64 reference keeps them exact.
    assert out.dtype == dtype
    assert rel_error(out, ref) < 2 * TOL[dtype]
    blk, off = slots // block_size, slots % block_size  # the new tokens' K/V, where the reference put them
    # With the q/k norm, k is rounded to the cache dtype twice more (x * rstd, times the weight)
    # before rotary: in bf16 that alone puts it ~1% from the float64 reference.
    kv_tol = (2 if with_norm else 1) * TOL[dtype]
    for kv in (0, 1):
        assert rel_error(cache[blk, 1, kv, off], ref_cache[blk, 1, kv, off]) < kv_tol
    assert torch.equal(cache[:, 0], ref_cache[:, 0].to(dtype))  # the other layer untouched
    assert not sem.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_qk_norm_equals_the_separate_norm_kernel_then_the_rotary_variant(dtype, num_splits):
    # What the fusion replaces: kernels/rms_norm.py over every q and k head, then this kernel
    # without the norm. The same roundings (x * rstd and the weighted result in q's dtype), and
    # the sum of squares over the whole head in one tl.sum as the norm kernel's: under the
    # interpreter the two are equal bit for bit. Compiled, the sum's order follows each
    # kernel's own layout, so an fp32 ulp of rstd may differ.
    from pdserve.kernels.paged_decode_attention import paged_decode_attention_rotary
    from pdserve.kernels.rms_norm import rms_norm

    g = torch.Generator().manual_seed(2)
    hq, hkv, d, block_size, ctx = CASES[1]
    fused_cache, k_cache, v_cache = paged_kv(40, 2, block_size, hkv, d, dtype)
    separate_cache = fused_cache.clone()
    block_tables = block_tables_for(ctx, block_size, 40, extra=1)
    context_lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    b = len(ctx)
    qkv = (3 * torch.randn(b, (hq + 2 * hkv) * d, generator=g)).to(dtype).to(DEVICE)
    q, k, v = (x.view(b, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], -1))
    qk_norm = qk_norm_weights(d, dtype, g)
    positions = context_lens.long() - 1
    slots = slots_of(block_tables, positions, block_size).int()
    slots[2] = -1  # a padding row: nothing written, either way
    cs = cos_sin_cache(128, d)
    args = (block_tables, context_lens, positions, slots, cs, d**-0.5)

    fused = paged_decode_attention_rotary(q, k, v, k_cache, v_cache, *args, num_splits=num_splits, qk_norm=qk_norm)
    wq, wk, eps = qk_norm
    qn = rms_norm(q.reshape(-1, d), wq, eps)[0].view(b, hq, d)
    kn = rms_norm(k.reshape(-1, d), wk, eps)[0].view(b, hkv, d)
    separate = paged_decode_attention_rotary(qn, kn, v, separate_cache[:, 1, 0], separate_cache[:, 1, 1], *args,
                                             num_splits=num_splits)
    if ON_GPU:
        assert_matches_separate_norm(fused, separate)
        assert_matches_separate_norm(fused_cache, separate_cache)
    else:
        assert torch.equal(fused, separate)
        assert torch.equal(fused_cache, separate_cache)


def test_rotary_variant_padding_rows_write_nothing():
    from pdserve.kernels.paged_decode_attention import paged_decode_attention_rotary

    cache, k_cache, v_cache = paged_kv(8, 1, 4, 2, 16, torch.float32, layer=0)
    before = cache.clone()
    q, k, v = (
        torch.randn(2, 4, 16, device=DEVICE),
        torch.randn(2, 2, 16, device=DEVICE),
        torch.randn(2, 2, 16, device=DEVICE),
    )
    ones = torch.ones(2, dtype=torch.int32, device=DEVICE)
    bt = torch.zeros(2, 3, dtype=torch.int32, device=DEVICE)
    cs = torch.randn(8, 16, device=DEVICE)
    out = paged_decode_attention_rotary(q, k, v, k_cache, v_cache, bt, ones, ones * 0, -ones, cs, 0.25, num_splits=2)
    assert torch.equal(cache, before) and not out.isnan().any()
    out = paged_decode_attention_rotary(q, k, v, k_cache, v_cache, bt, ones, ones * 0, -ones, cs, 0.25, num_splits=2,
                                        qk_norm=qk_norm_weights(16, torch.float32))
    assert torch.equal(cache, before) and not out.isnan().any()
    with pytest.raises(ValueError, match=r"paged_decode_attention_rotary: q_norm_weight has shape \[8\]"):
        paged_decode_attention_rotary(q, k, v, k_cache, v_cache, bt, ones, ones, ones, cs, 0.25,
                                      qk_norm=(torch.ones(8), torch.ones(16), 1e-6))
    with pytest.raises(ValueError, match=r"paged_decode_attention_rotary: bias has shape \[3\], expected \[128\]"):
        paged_decode_attention_rotary(q, k, v, k_cache, v_cache, bt, ones, ones, ones, cs, 0.25, torch.zeros(3))
    with pytest.raises(ValueError, match=r"k_cache has shape \[8, 4, 2, 16\], expected \[\*, \*, 1, 16\]"):
        paged_decode_attention_rotary(q, k[:, :1], v[:, :1], k_cache, v_cache, bt, ones, ones, ones, cs, 0.25)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_reference_equals_attention_per_sequence_and_head(case):
    # The reference is every kernel's oracle, so it gets one of its own: each sequence's
    # contiguous K/V gathered by hand, each query head against its KV head (h // group) through
    # torch's scaled_dot_product_attention in float64. Several sequences of different lengths in
    # one call (the reference pads and masks them together) and GQA groups 1/3/4.
    hq, hkv, d, bs, lens = CASES[case]
    torch.manual_seed(case)
    _, k_cache, v_cache = paged_kv(32, 2, bs, hkv, d, torch.float32)
    k_cache, v_cache = k_cache.cpu(), v_cache.cpu()
    tables = block_tables_for(lens, bs, 32).cpu()
    q = torch.randn(len(lens), hq, d)
    got = paged_decode_attention_ref(q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), 0.3)
    for b, n in enumerate(lens):
        rows = torch.cat([k_cache[int(i)] for i in tables[b]])[:n], torch.cat([v_cache[int(i)] for i in tables[b]])[:n]
        for h in range(hq):
            k, v = (r[:, h // (hq // hkv)].double() for r in rows)
            want = torch.nn.functional.scaled_dot_product_attention(q[b, h].double()[None], k, v, scale=0.3)[0]
            torch.testing.assert_close(got[b, h].double(), want, rtol=1e-5, atol=1e-6)
