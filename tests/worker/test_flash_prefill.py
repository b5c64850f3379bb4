"""Prefill attention on torch's FlashAttention (worker/attention/flash_prefill.py).

FlashAttention runs on CUDA only: on CPU (CI) the varlen call is replaced by
`varlen_attention_ref`, its contract in torch, so these tests check everything of ours around
it (the plan's gather of each row's context, the offsets, the backend's choice, the engine's
answers); the GPU-only test at the end checks torch's real kernel against the Triton one.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.reference import paged_prefill_attention_ref
from pdserve.worker.attention import flash_prefill
from pdserve.worker.attention.flash_prefill import (
    flash_inputs,
    flash_prefill_attention,
    varlen_attention_ref,
)
from tests.helpers.engines import ON_GPU

BS = 16


def _host(x, dtype):
    return torch.as_tensor(x, dtype=dtype)


def test_flash_inputs_name_each_rows_context():
    # Row 0: a 4-token chunk after 16 cached tokens (context 20, two blocks); row 1: a fresh 5-token prompt.
    f = flash_inputs([[3, 7, 0, 0], [5, 0, 0, 0]], [20, 5], [0, 4, 9], BS, _host)
    assert f.kv_blocks.tolist() == [3] * 16 + [7] * 4 + [5] * 5
    assert f.kv_offsets.tolist() == list(range(16)) + list(range(4)) + list(range(5))
    assert f.cu_seqlens_k.tolist() == [0, 20, 25]
    assert (f.max_q, f.max_k) == (5, 20)
    assert f.kv_blocks.dtype == f.kv_offsets.dtype == torch.int64 and f.cu_seqlens_k.dtype == torch.int32


def _layer_caches(num_blocks: int, hkv: int, d: int, dtype=torch.float32, device="cpu"):
    """One layer's K and V views of a cache laid out as KVCache's ([blocks, layers, 2, block, Hkv, D]):
    strided over the other layer's blocks, as the engine's are."""
    whole = torch.randn(num_blocks, 2, 2, BS, hkv, d, dtype=dtype, device=device)
    return whole[:, 1, 0], whole[:, 1, 1]


def _rows(lens_and_chunks, num_blocks, gen):
    """Block tables (random distinct blocks), context lengths and query offsets for rows of
    (context length after the step, chunk length)."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-ctx // BS) for ctx, _ in lens_and_chunks)
    tables, used = [], 0
    for ctx, _ in lens_and_chunks:
        n = -(-ctx // BS)
        tables.append(perm[used:used + n] + [0] * (width - n))
        used += n
    cu = [0]
    for _, chunk in lens_and_chunks:
        cu.append(cu[-1] + chunk)
    return tables, [ctx for ctx, _ in lens_and_chunks], cu


class _StandIn:
    """torch's varlen call replaced by its torch contract (CPU has no FlashAttention), counting calls."""

    def __init__(self):
        self.calls = 0

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, scale):
        self.calls += 1
        assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())
        return varlen_attention_ref(q, k, v, cu_q, cu_k, scale)


@pytest.fixture
def stand_in(monkeypatch):
    fn = _StandIn()
    monkeypatch.setattr(flash_prefill, "_varlen_attn", lambda: fn)
    return fn


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("rows", [
    [(7, 7), (37, 37), (2, 2)],  # fresh prompts
    [(40, 8), (33, 33), (17, 1), (64, 16)],  # chunks after cached prefixes, a fresh prompt, a one-token row
])
def test_gathered_contexts_give_the_paged_kernels_answer(hq, hkv, rows, stand_in):
    gen = torch.Generator().manual_seed(len(rows) * hq)
    k_cache, v_cache = _layer_caches(24, hkv, 32)
    tables, ctx, cu = _rows(rows, 24, gen)
    q = torch.randn(cu[-1], hq, 32, generator=gen)
    flash = flash_inputs(tables, ctx, cu, BS, _host)
    cu_q = torch.tensor(cu, dtype=torch.int32)
    out = flash_prefill_attention(q, k_cache, v_cache, cu_q, flash, 32 ** -0.5)
    assert stand_in.calls == 1
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), cu_q,
                                      torch.tensor(ctx, dtype=torch.int32), 32 ** -0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_the_triton_backend_takes_flash_only_where_it_may(stand_in):
    from pdserve.worker.attention.backend import AttentionMetadata, TorchAttentionBackend
    from pdserve.worker.attention.triton_backend import TritonAttentionBackend
    from pdserve.worker.config.model import ModelConfig
    from pdserve.worker.attention.kv_cache import KVCache

    device = "cuda" if ON_GPU else "cpu"
    cfg = ModelConfig("LlamaForCausalLM", 100, 64, 128, 2, 4, 2, 16, 1e-5, 128, False, False, False, False,
                      1e4, (), ())
    cache = KVCache(cfg, 16, BS, torch.float32, torch.device(device))
    backend, torch_backend = TritonAttentionBackend(), TorchAttentionBackend()
    backend.bind(cache)
    torch_backend.bind(cache)
    assert backend.flash_prefill is False  # an fp32 cache (or a CPU, or the switch off): the paged kernel
    backend.flash_prefill = True
    gen = torch.Generator().manual_seed(0)
    tables, ctx, cu = _rows([(20, 4), (9, 9)], 16, gen)
    t = cu[-1]
    slots = [tables[0][p // BS] * BS + p % BS for p in range(16, 20)] + [tables[1][p // BS] * BS + p % BS
                                                                          for p in range(9)]

    def dev(x, dt):
        return torch.as_tensor(x, dtype=dt, device=device)

    meta = AttentionMetadata(dev(slots, torch.int64), 0, dev([[0]], torch.int32)[:0], dev([], torch.int32),
                             dev(tables, torch.int32), dev(cu, torch.int32), dev(ctx, torch.int32))
    meta.flash = flash_inputs(tables, ctx, cu, BS, dev)
    q, k, v = (torch.randn(t, h, 16, generator=gen).to(device) for h in (4, 2, 2))
    ref = torch_backend.forward(1, q, k, v, meta, 0.25)
    out = backend.forward(1, q, k, v, meta, 0.25)
    assert stand_in.calls == 1
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # Sinks and sliding windows stay on the paged kernel (FlashAttention has neither here).
    backend.forward(1, q, k, v, meta, 0.25, sinks=torch.zeros(4, device=device))
    backend.forward(1, q, k, v, meta, 0.25, window=8)
    assert stand_in.calls == 1


@pytest.mark.slow
def test_an_engine_with_flash_prefill_answers_as_the_torch_engine(tmp_path_factory, stand_in, monkeypatch):
    # Chunked prefill (a 16-token budget) and a prefix-cache hit: rows whose context is longer than
    # their chunk, through the runner's plan of the gather.
    from pdserve.worker.attention.triton_backend import TritonAttentionBackend
    from pdserve.worker.request.sampling_params import SamplingParams
    from tests.checkpoints import checkpoint_factory, write_word_tokenizer
    from tests.helpers.engines import device_engine

    monkeypatch.setattr(flash_prefill, "ENABLED", False)  # no probe at bind: it would turn the fp32 cache away
    monkeypatch.setattr(TritonAttentionBackend, "flash_prefill", True)
    ckpt = checkpoint_factory(tmp_path_factory, write_word_tokenizer(tmp_path_factory.mktemp("tok")))("llama")
    prompts = [list(range(100, 137)), [5, 17, 300, 42, 9, 1000, 77], list(range(100, 137)) + [9, 8]]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    kw = dict(static_decode=False, max_num_seqs=4, max_num_batched_tokens=16, enable_prefix_caching=True,
              gpu_memory_utilization=0.5)
    engine = device_engine(ckpt, attention_backend="triton", **kw)
    got = [engine.generate([p], greedy)[0] for p in prompts]  # one at a time: the third hits the first's prefix
    assert stand_in.calls > 0 and engine.runner.prefill_on_flash
    del engine
    ref_engine = device_engine(ckpt, attention_backend="torch", **kw)
    assert got == [ref_engine.generate([p], greedy)[0] for p in prompts]


@pytest.mark.skipif(not ON_GPU, reason="FlashAttention runs on CUDA only (tier 4)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torchs_flash_attention_matches_the_triton_prefill_kernel(dtype):
    from pdserve.kernels.paged_prefill_attention import paged_prefill_attention

    device = torch.device("cuda")
    assert flash_prefill.flash_available(device, dtype, 128, 8)
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache = _layer_caches(160, 8, 128, dtype, device)
    tables, ctx, cu = _rows([(300, 300), (1100, 128), (37, 1), (640, 640)], 160, gen)
    q = torch.randn(cu[-1], 32, 128, generator=gen).to(device, dtype)
    flash = flash_inputs(tables, ctx, cu, BS, lambda x, dt: torch.as_tensor(x, dtype=dt, device=device))
    cu_q = torch.tensor(cu, dtype=torch.int32, device=device)
    out = flash_prefill_attention(q, k_cache, v_cache, cu_q, flash, 128 ** -0.5)
    ref = paged_prefill_attention(q, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32, device=device), cu_q,
                                  torch.tensor(ctx, dtype=torch.int32, device=device), 128 ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
