"""The CPU engine's paged attention (kernels/cpu_attention.py) = the torch references, for every
option the references take: GQA groups, ragged contexts, chunks after cached tokens, sliding
windows, sinks, an fp8 cache's scales, fp32 and bf16; the KV write with and without skipped rows."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import cpu_attention
from pdserve.kernels.cpu_attention import kv_cache_write_cpu, paged_decode_attention_cpu, paged_prefill_attention_cpu
from pdserve.kernels.reference import (
    FP8_KV_DTYPE,
    kv_cache_write_ref,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    quantize_kv,
)
from tests.kernels.kernel_inputs import TOL, block_tables_for, rel_error

BS = 4


def _cache(dtype, hkv: int, d: int, fp8: bool):
    cache = torch.randn(40, 2, 2, BS, hkv, d, dtype=torch.float32)
    scales = (torch.tensor([0.7]), torch.tensor([1.3])) if fp8 else (None, None)
    if fp8:
        cache = torch.stack([quantize_kv(cache[:, :, 0], FP8_KV_DTYPE, scales[0]),
                             quantize_kv(cache[:, :, 1], FP8_KV_DTYPE, scales[1])], 2)
    else:
        cache = cache.to(dtype)
    return cache[:, 1, 0], cache[:, 1, 1], scales


def _sinks(hq: int, on: bool):
    return torch.randn(hq) * 1.5 if on else None


CASES = [  # dtype, Hq, Hkv, window, sinks, fp8
    (torch.float32, 4, 2, 0, False, False),
    (torch.float32, 6, 6, 0, False, False),
    (torch.bfloat16, 9, 3, 0, False, False),
    (torch.float32, 4, 1, 5, True, False),
    (torch.float32, 4, 2, 3, False, False),
    (torch.bfloat16, 4, 2, 0, False, True),
]


@pytest.mark.parametrize("dtype,hq,hkv,window,sinks,fp8", CASES)
def test_decode_matches_reference(dtype, hq, hkv, window, sinks, fp8):
    torch.manual_seed(0)
    k_cache, v_cache, (ks, vs) = _cache(dtype, hkv, 16, fp8)
    lens = [1, 7, 13, 4, 9]
    tables = block_tables_for(lens, BS, 40, extra=2).cpu()  # CPU kernels: CPU tensors on a GPU machine too
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), hq, 16, dtype=dtype if not fp8 else torch.bfloat16)
    s = _sinks(hq, sinks)
    args = (q, k_cache, v_cache, tables, ctx, 0.25, ks, vs)
    out = paged_decode_attention_cpu(*args, sinks=s, window=window)
    ref = paged_decode_attention_ref(*args, sinks=s, window=window)
    assert out.dtype == ref.dtype and rel_error(out, ref) < TOL[q.dtype]


def test_decode_in_chunks_matches_reference(monkeypatch):
    """A batch larger than one chunk (here 2 sequences a chunk, the last one alone) = the reference."""
    torch.manual_seed(0)
    k_cache, v_cache, _ = _cache(torch.bfloat16, 3, 16, False)
    lens = [1, 7, 13, 4, 9]
    monkeypatch.setattr(cpu_attention, "DECODE_CHUNK_BYTES", 2 * 2 * 4 * 3 * 16 * max(lens))
    tables = block_tables_for(lens, BS, 40, extra=2).cpu()
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), 9, 16, dtype=torch.bfloat16)
    out = paged_decode_attention_cpu(q, k_cache, v_cache, tables, ctx, 0.25)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, ctx, 0.25)
    assert out.shape == ref.shape and rel_error(out, ref) < TOL[q.dtype]


@pytest.mark.parametrize("dtype,hq,hkv,window,sinks,fp8", CASES)
def test_prefill_matches_reference(dtype, hq, hkv, window, sinks, fp8):
    """Three sequences: a whole prompt, a chunk after 6 cached tokens, a one-token chunk."""
    torch.manual_seed(0)
    k_cache, v_cache, (ks, vs) = _cache(dtype, hkv, 16, fp8)
    chunks, lens = [9, 5, 1], [9, 11, 6]
    tables = block_tables_for(lens, BS, 40).cpu()
    cu = torch.tensor([0, 9, 14, 15], dtype=torch.int32)
    q = torch.randn(sum(chunks), hq, 16, dtype=dtype if not fp8 else torch.bfloat16)
    s = _sinks(hq, sinks)
    args = (q, k_cache, v_cache, tables, cu, torch.tensor(lens, dtype=torch.int32), 0.25, ks, vs)
    out = paged_prefill_attention_cpu(*args, sinks=s, window=window)
    ref = paged_prefill_attention_ref(*args, sinks=s, window=window)
    assert out.dtype == ref.dtype and rel_error(out, ref) < TOL[q.dtype]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("slots", [[5, 17, 0, 63], [5, -1, 22, -1], [-1], []])
def test_kv_write_matches_reference(fp8, slots):
    """Rows to every slot (a decode step), some skipped (-1: the reference's masked path), none."""
    k_cache, v_cache, (ks, vs) = _cache(torch.bfloat16, 2, 8, fp8)  # strided views, as the engine's
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    key, value = torch.randn(2, len(slots), 2, 8).bfloat16().unbind(0)
    mapping = torch.tensor(slots, dtype=torch.int64)
    kv_cache_write_cpu(key, value, k_cache, v_cache, mapping, ks, vs)
    kv_cache_write_ref(key, value, k_ref, v_ref, mapping, ks, vs)
    for got, want in ((k_cache, k_ref), (v_cache, v_ref)):
        assert torch.equal(got.contiguous().view(torch.uint8), want.view(torch.uint8))


def test_kv_write_of_views_of_one_qkv_row():
    """The engine's K and V: strided views of the projection's rows (the native bf16 copy reads them in place)."""
    k_cache, v_cache, _ = _cache(torch.bfloat16, 2, 8, False)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    qkv = torch.randn(5, (4 + 2 + 2) * 8).bfloat16()
    _, key, value = qkv.split([32, 16, 16], dim=-1)
    key, value = key.view(5, 2, 8), value.view(5, 2, 8)
    mapping = torch.tensor([3, 40, -1, 9, 62])
    kv_cache_write_cpu(key, value, k_cache, v_cache, mapping)
    kv_cache_write_ref(key, value, k_ref, v_ref, mapping)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
