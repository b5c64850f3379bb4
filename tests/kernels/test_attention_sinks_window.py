"""gpt-oss's attention options in the paged kernels: per-head sinks and sliding windows, against
the torch references, and the references against transformers' own eager attention and masks.

Small sizes: every case runs under the interpreter in a fraction of a second."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_rotary
from pdserve.kernels.paged_prefill_attention import paged_prefill_attention
from pdserve.kernels.reference import (
    paged_decode_attention_ref,
    paged_decode_attention_rotary_ref,
    paged_prefill_attention_ref,
)
from tests.kernels.kernel_inputs import DEVICE, TOL, bad_argument_inputs, block_tables_for, paged_kv, rel_error


def _sinks(hq: int, on: bool) -> torch.Tensor | None:
    # Of order 1 and one large: a sink that takes most of a row's mass is a case too.
    if not on:
        return None
    s = torch.randn(hq, device=DEVICE) * 1.5
    s[0] = 6.0
    return s


def test_references_match_transformers_eager_attention():
    """The references' sinks and window are transformers' (eager_attention_forward with sinks, its
    sliding-window causal mask): all queries of one sequence through prefill, the last one through
    decode, with windows below, at and above the length."""
    from types import SimpleNamespace

    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.manual_seed(0)
    hq, hkv, d, bs, n = 4, 2, 16, 4, 11
    _, k_cache, v_cache = paged_kv(8, 1, bs, hkv, d, torch.float32, layer=0)
    k_cache, v_cache = k_cache.cpu(), v_cache.cpu()
    bt = torch.randperm(8)[:3].to(torch.int32)[None]
    q = torch.randn(n, hq, d)
    sinks = torch.randn(hq) * 1.5
    keys = k_cache[bt[0].long()].reshape(-1, hkv, d)[:n].transpose(0, 1)[None]  # [1, Hkv, n, D]
    values = v_cache[bt[0].long()].reshape(-1, hkv, d)[:n].transpose(0, 1)[None]
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=hq // hkv, training=False)
    ctx = torch.tensor([n], dtype=torch.int32)
    for window in (0, 1, 3, n, n + 5):
        fn = sliding_window_causal_mask_function(window) if window else causal_mask_function
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        visible = fn(torch.tensor(0), torch.tensor(0), i, j).expand(n, n)
        mask = torch.zeros(n, n).masked_fill(~visible, float("-inf"))[None, None]
        hf, _ = eager_attention_forward(module, q.transpose(0, 1)[None], keys, values, mask, d**-0.5)
        hf = hf[0]  # [n, Hq, D]
        cu = torch.tensor([0, n], dtype=torch.int32)
        pre = paged_prefill_attention_ref(q, k_cache, v_cache, bt, cu, ctx, d**-0.5, sinks=sinks, window=window)
        dec = paged_decode_attention_ref(q[-1:], k_cache, v_cache, bt, ctx, d**-0.5, sinks=sinks, window=window)
        torch.testing.assert_close(pre, hf, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dec, hf[-1:], rtol=1e-5, atol=1e-6)


DECODE_CASES = [
    # (Hq, Hkv, D, block_size, context_lens, window): windows shorter than a tile (16 under the
    # interpreter), spanning blocks, longer than some contexts, and none.
    (4, 2, 32, 4, [1, 40, 17, 9], 8),
    (6, 2, 40, 5, [23, 1, 50], 20),
    (8, 8, 16, 8, [64, 3], 0),
]


@pytest.mark.parametrize("num_splits,fused_merge", [(1, False), (3, False), (3, True), (None, True)])
@pytest.mark.parametrize("case,sinks_on", [(c, s) for c in range(len(DECODE_CASES)) for s in (True, False)
                                           if s or DECODE_CASES[c][-1]])  # neither: the plain kernel's tests
def test_decode_matches_reference(poison_empty, case, sinks_on, num_splits, fused_merge):
    hq, hkv, d, block_size, ctx, window = DECODE_CASES[case]
    _, k_cache, v_cache = paged_kv(40, 2, block_size, hkv, d, torch.float32)
    block_tables = block_tables_for(ctx, block_size, 40)
    context_lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(ctx), hq, d, device=DEVICE)
    sinks = _sinks(hq, sinks_on)
    sem = torch.zeros(len(ctx) * hkv, dtype=torch.int32, device=DEVICE) if fused_merge else None
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, d**-0.5, num_splits=num_splits,
                                 semaphores=sem, sinks=sinks, window=window)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, d**-0.5, sinks=sinks,
                                     window=window)
    assert rel_error(out, ref) < TOL[torch.float32]
    if sem is not None:
        assert not sem.any()


def test_decode_bf16_sinks_from_bf16_parameters(poison_empty):
    # The model's sinks are a parameter in its dtype: the kernel widens them to fp32.
    hq, hkv, d, bs, ctx = 4, 2, 32, 4, [30, 7]
    _, k_cache, v_cache = paged_kv(20, 2, bs, hkv, d, torch.bfloat16)
    bt = block_tables_for(ctx, bs, 20)
    lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, hq, d, dtype=torch.bfloat16, device=DEVICE)
    sinks = _sinks(hq, True).bfloat16()
    out = paged_decode_attention(q, k_cache, v_cache, bt, lens, d**-0.5, num_splits=2, sinks=sinks, window=8)
    ref = paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), bt, lens, d**-0.5,
                                     sinks=sinks.float(), window=8)
    assert rel_error(out, ref) < TOL[torch.bfloat16]


def test_decode_rotary_matches_reference(poison_empty):
    # The fused epilogue writes the new token before the window's tiles read it.
    hq, hkv, d, bs, ctx, window = 4, 2, 16, 4, [13, 1, 26], 6
    _, k_cache, v_cache = paged_kv(20, 2, bs, hkv, d, torch.float32)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    bt = block_tables_for(ctx, bs, 20)
    lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    pos = lens.long() - 1
    slots = (bt.long().gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs)
    q, k, v = (torch.randn(3, h, d, device=DEVICE) for h in (hq, hkv, hkv))
    freqs = torch.arange(64, dtype=torch.float32, device=DEVICE)[:, None] * torch.rand(d // 2, device=DEVICE)[None]
    cs = torch.cat([freqs.cos(), freqs.sin()], -1)
    bias = torch.randn((hq + 2 * hkv) * d, device=DEVICE)
    sinks = _sinks(hq, True)
    out = paged_decode_attention_rotary(q, k, v, k_cache, v_cache, bt, lens, pos, slots, cs, d**-0.5, bias,
                                        num_splits=2, sinks=sinks, window=window)
    ref = paged_decode_attention_rotary_ref(q, k, v, k_ref, v_ref, bt, lens, pos, slots, cs, d**-0.5, bias,
                                            sinks=sinks, window=window)
    assert rel_error(out, ref) < TOL[torch.float32]


PREFILL_CASES = [
    # (Hq, Hkv, D, block_size, context_lens, new query counts, window): fresh prompts longer than
    # the window, a cached prefix (chunked prefill), a window of 4 whose later rows see nothing of
    # the tile their first row starts in (ctx 36, 16 queries from position 20), one query,
    # a window longer than the context.
    (4, 2, 16, 4, [40, 9], [40, 9], 8),
    (6, 2, 40, 5, [37, 36, 5], [21, 16, 1], 4),
    (4, 4, 32, 8, [19], [7], 64),
]


@pytest.mark.parametrize("sinks_on", [True, False])
@pytest.mark.parametrize("case", range(len(PREFILL_CASES)))
def test_prefill_matches_reference(poison_empty, case, sinks_on):
    hq, hkv, d, block_size, ctx, n, window = PREFILL_CASES[case]
    _, k_cache, v_cache = paged_kv(40, 2, block_size, hkv, d, torch.float32)
    block_tables = block_tables_for(ctx, block_size, 40)
    context_lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0] + n, dtype=torch.int32, device=DEVICE).cumsum(0, dtype=torch.int32)
    q = torch.randn(sum(n), hq, d, device=DEVICE)
    sinks = _sinks(hq, sinks_on)
    out = paged_prefill_attention(q, k_cache, v_cache, block_tables, cu, context_lens, d**-0.5, sinks=sinks,
                                  window=window)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu, context_lens, d**-0.5, sinks=sinks,
                                      window=window)
    assert rel_error(out, ref) < TOL[torch.float32]


def test_prefill_sinks_only_bf16(poison_empty):
    hq, hkv, d, bs, ctx, n = 4, 2, 32, 8, [30, 12], [30, 5]
    _, k_cache, v_cache = paged_kv(20, 2, bs, hkv, d, torch.bfloat16)
    bt = block_tables_for(ctx, bs, 20)
    lens = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0] + n, dtype=torch.int32, device=DEVICE).cumsum(0, dtype=torch.int32)
    q = torch.randn(sum(n), hq, d, dtype=torch.bfloat16, device=DEVICE)
    sinks = _sinks(hq, True).bfloat16()
    out = paged_prefill_attention(q, k_cache, v_cache, bt, cu, lens, d**-0.5, sinks=sinks)
    ref = paged_prefill_attention_ref(q.float(), k_cache.float(), v_cache.float(), bt, cu, lens, d**-0.5,
                                      sinks=sinks.float())
    assert rel_error(out, ref) < TOL[torch.bfloat16]


def test_bad_sinks_and_windows_are_refused():
    k_cache, v_cache, q, bt, lens = bad_argument_inputs(2)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"paged_decode_attention: sinks has shape \[2\], expected \[4\]"):
        paged_decode_attention(q, k_cache, v_cache, bt, lens, 0.25, sinks=torch.zeros(2, device=DEVICE))
    with pytest.raises(TypeError, match="sinks has dtype int64"):
        paged_prefill_attention(q, k_cache, v_cache, bt, cu, lens, 0.25, sinks=torch.zeros(4, dtype=torch.long,
                                                                                           device=DEVICE))
    with pytest.raises(ValueError, match="window must be an int >= 0"):
        paged_prefill_attention(q, k_cache, v_cache, bt, cu, lens, 0.25, window=-1)
