"""The native CPU decode attention (kernels/cpu_decode_attention.c through cpu_native.py) = the torch
reference, in the engine's layout: bf16 cache blocks that hold every layer (a layer's K and V are
strided views), 16-token blocks, SmolLM2's heads (9 query heads over 3 KV heads of 64), contexts
from one token to several blocks; one thread and a batch split over threads."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

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


def _built(where, name: str, extra: list[str]):
    """The kernel's source built with the engine's flags plus `extra`, loaded with its signature."""
    out = where / f"{name}.so"
    subprocess.run(["cc", *cpu_native.FLAGS, *extra, "-o", str(out), str(cpu_native.SOURCE)], check=True)
    lib = ctypes.CDLL(str(out))
    lib.paged_decode_bf16.argtypes = cpu_native.library().paged_decode_bf16.argtypes
    return lib


def _call(lib, q, k_cache, v_cache, tables, lens, bs):
    B, Hq, D = q.shape
    out = torch.empty(B, Hq, D)
    scratch = torch.empty(Hq * (tables.shape[1] * bs + D) + k_cache.shape[2] * D)
    cs = k_cache.stride()
    lib.paged_decode_bf16(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), cs[0],
                          cs[1], cs[2], tables.data_ptr(), tables.stride(0), lens.data_ptr(), B, Hq,
                          k_cache.shape[2], D, bs, D**-0.5, out.data_ptr(), scratch.data_ptr())
    return out


@pytest.fixture(scope="module")
def both_builds(tmp_path_factory):
    where = tmp_path_factory.mktemp("decode-builds")
    return _built(where, "fast", []), _built(where, "plain", ["-mno-avx512f"])


@pytest.mark.skipif("avx512f" not in cpu_native._cpu_flags().split(), reason="no AVX-512 here")
@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (32, 8, 128, 16), (8, 1, 64, 4), (4, 4, 16, 32),
                                          (32, 1, 64, 16)])
def test_avx512_path_gives_the_plain_c_bits(both_builds, hq, hkv, d, bs):
    """The AVX-512 path (16 scores folded at a time) and the plain C loops (built without AVX-512)
    add the same numbers in the same order: equal bit for bit, over partial blocks and groups of
    16 tokens, one token and many blocks; 32 query heads on one KV head take the plain loops."""
    fast, plain = both_builds
    g = torch.Generator().manual_seed(hq + d + bs)
    lens = [1, 2, 15, 16, 17, 33, 100, 271]
    nblk = [-(-n // bs) for n in lens]
    cache = (torch.randn(sum(nblk) + 2, 2, 2, bs, hkv, d, generator=g) * 2).bfloat16()
    order = torch.randperm(sum(nblk), generator=g).to(torch.int32)
    tables = torch.zeros(len(lens), max(nblk), dtype=torch.int32)
    for i, n in enumerate(nblk):
        tables[i, :n] = order[sum(nblk[:i]):sum(nblk[:i]) + n]
    q = (torch.randn(len(lens), hq, d, generator=g) * 3).bfloat16()
    args = (q, cache[:, 1, 0], cache[:, 1, 1], tables, torch.tensor(lens, dtype=torch.int32), bs)
    assert torch.equal(_call(fast, *args), _call(plain, *args))


def _two_sequences(seed: int, queries: int):
    """(q [queries], k_cache, v_cache, block tables of a 50- and a 20-token sequence), random bf16."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(40, 2, BS, HKV, D, generator=g).bfloat16()
    torch.manual_seed(seed)
    tables = block_tables_for([50, 20], BS, 40).cpu()
    return torch.randn(queries, HQ, D, generator=g).bfloat16(), cache[:, 0], cache[:, 1], tables


@pytest.mark.parametrize("threads", [1, 2])
def test_invariant_prefill_is_the_decode_kernel_per_query(monkeypatch, threads):
    """In a batch-invariant step a prompt's attention is the decode kernel's, query by query: each
    token gets the bits a decode step gives it, however the prompt is chunked (a whole prompt, or
    a chunk after cached tokens, beside another sequence), and stays the reference's math."""
    from pdserve.kernels.cpu_attention import paged_prefill_attention_cpu
    from pdserve.kernels.reference import paged_prefill_attention_ref

    monkeypatch.setattr(cpu_native, "_step_invariant", True)
    monkeypatch.setattr(cpu_native, "_threads", threads)
    q, k_cache, v_cache, tables = _two_sequences(3, 70)  # sequence 0: 50 tokens, sequence 1: 20
    cu = torch.tensor([0, 50, 70], dtype=torch.int32)
    whole = paged_prefill_attention_cpu(q, k_cache, v_cache, tables, cu, torch.tensor([50, 20], dtype=torch.int32),
                                        D**-0.5)
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, tables, cu, torch.tensor([50, 20], dtype=torch.int32),
                                      D**-0.5)
    assert ((whole.float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + 1e-6).all()
    # sequence 0's last 13 tokens as a chunk after 37 cached ones, sequence 1's first 7 beside it
    chunk = paged_prefill_attention_cpu(torch.cat([q[37:50], q[50:57]]), k_cache, v_cache, tables,
                                        torch.tensor([0, 13, 20], dtype=torch.int32),
                                        torch.tensor([50, 7], dtype=torch.int32), D**-0.5)
    assert torch.equal(chunk[:13], whole[37:50]) and torch.equal(chunk[13:], whole[50:57])
    for t in (0, 17, 49):  # a decode step of sequence 0's token t
        one = paged_decode_attention_cpu(q[t:t + 1], k_cache, v_cache, tables[:1],
                                         torch.tensor([t + 1], dtype=torch.int32), D**-0.5)
        assert torch.equal(one, whole[t:t + 1])


def test_invariant_prefill_plans_each_call_from_its_metadata(monkeypatch):
    """Layers of one step reuse the per-query plan; metadata of the same shapes but other values
    (new tensors, or the same ones written in place) gets its own plan, not the last one's."""
    from pdserve.kernels import cpu_attention

    monkeypatch.setattr(cpu_native, "_step_invariant", True)
    q, k_cache, v_cache, tables = _two_sequences(5, 20)
    cu = torch.tensor([0, 13, 20], dtype=torch.int32)
    lens = torch.tensor([50, 7], dtype=torch.int32)

    def attend():
        return cpu_attention.paged_prefill_attention_cpu(q, k_cache, v_cache, tables, cu, lens, D**-0.5)

    first = attend()
    lens[0] = 40  # the same tensor, written in place: sequence 0's chunk now follows 27 cached tokens
    moved = attend()
    monkeypatch.setattr(cpu_attention, "_plan_memo", [None])
    assert torch.equal(moved, attend()) and not torch.equal(moved, first)
    tables = tables.flip(1).contiguous()  # a new tensor of the same shape
    flipped = attend()
    monkeypatch.setattr(cpu_attention, "_plan_memo", [None])
    assert torch.equal(flipped, attend()) and not torch.equal(flipped, moved)
