"""Tier 4 (CUDA machines, not CI): every kernel at model sizes against a float64 reference.

Relative error ||out - ref|| / ||ref||: bf16 lands between 1e-3 and 1e-2, fp32 far below;
NaN never passes. Shapes are Llama-3.1-8B's (32 query heads, 8 KV heads, head_dim 128,
hidden 4096, intermediate 14336), Qwen2.5-0.5B's attention (14/2 heads, head_dim 64) and
Qwen3-30B-A3B's (32/4 heads, head_dim 128, q/k norm).
"""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.reference import rotary_kv_write_ref, rotary_ref, silu_and_mul_ref
from pdserve.kernels.kv_cache_write import kv_cache_write
from pdserve.kernels.paged_decode_attention import paged_decode_attention
from pdserve.kernels.paged_prefill_attention import paged_prefill_attention
from pdserve.kernels.rms_norm import rms_norm
from pdserve.kernels.rotary import rotary
from pdserve.kernels.rotary_kv_write import rotary_kv_write
from pdserve.kernels.silu_and_mul import silu_and_mul
from tests.kernels.kernel_inputs import ON_GPU, as_double, block_tables_for, paged_kv, qk_norm_weights, rel_error

pytestmark = pytest.mark.skipif(not ON_GPU, reason="real-size kernel checks need a CUDA GPU")
GPU_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
ATTN = [(32, 8, 128, 16), (14, 2, 64, 16)]  # (Hq, Hkv, D, block_size)


def attention_f64(q, k_cache, v_cache, block_tables, cu, context_lens, scale):
    """Causal attention of each sequence's last n queries over its paged context, in float64."""
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    group = q.shape[1] // k_cache.shape[2]
    for i, ctx in enumerate(context_lens.tolist()):
        s, e = cu[i].item(), cu[i + 1].item()
        if s == e:
            continue
        k = k_cache[block_tables[i].long()].flatten(0, 1)[:ctx].double().repeat_interleave(group, 1)
        v = v_cache[block_tables[i].long()].flatten(0, 1)[:ctx].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].double(), k) * scale
        q_pos = torch.arange(ctx - (e - s), ctx, device=q.device)[:, None]
        scores.masked_fill_(torch.arange(ctx, device=q.device)[None, :] > q_pos, float("-inf"))
        out[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", ATTN)
@pytest.mark.parametrize("batch", [1, 3, 64])
@pytest.mark.parametrize("fused_merge", [False, True], ids=["reduce-kernel", "fused-merge"])
def test_decode_attention(poison_empty, dtype, shape, batch, fused_merge):
    hq, hkv, d, bs = shape
    ctx = torch.randint(1, 8192, (batch,)).tolist()
    ctx[0] = 8191 if batch == 1 else 1  # long split-K context / single-token context
    num_blocks = sum(-(-c // bs) for c in ctx) + 4
    _, k_cache, v_cache = paged_kv(num_blocks, 2, bs, hkv, d, dtype)
    bt = block_tables_for(ctx, bs, num_blocks, extra=3)
    lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, d, dtype=dtype, device="cuda")
    sem = torch.zeros(batch * hkv, dtype=torch.int32, device="cuda") if fused_merge else None
    out = paged_decode_attention(q, k_cache, v_cache, bt, lens, d**-0.5, semaphores=sem)
    cu = torch.arange(batch + 1, device="cuda")
    assert rel_error(out, attention_f64(q, k_cache, v_cache, bt, cu, lens, d**-0.5)) < GPU_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", ATTN)
def test_prefill_attention(poison_empty, dtype, shape):
    hq, hkv, d, bs = shape
    n = [1024, 333, 1, 0, 2000]
    ctx = [1024, 1500, 4097, 77, 2000]  # fresh prompts and cached prefixes
    num_blocks = sum(-(-c // bs) for c in ctx) + 4
    _, k_cache, v_cache = paged_kv(num_blocks, 2, bs, hkv, d, dtype)
    bt = block_tables_for(ctx, bs, num_blocks)
    lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0] + n, device="cuda").cumsum(0).int()
    q = torch.randn(sum(n), hq, d, dtype=dtype, device="cuda")
    out = paged_prefill_attention(q, k_cache, v_cache, bt, cu, lens, d**-0.5)
    assert rel_error(out, attention_f64(q, k_cache, v_cache, bt, cu, lens, d**-0.5)) < GPU_TOL[dtype]


def test_kv_cache_write_bf16():
    cache, k_cache, v_cache = paged_kv(2048, 4, 16, 8, 128, torch.bfloat16)
    cache.fill_(float("nan"))
    key, value = torch.randn(2, 4096, 8, 128, dtype=torch.bfloat16, device="cuda")
    slots = torch.randperm(2048 * 16, device="cuda")[:4096]
    kv_cache_write(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.flatten(0, 1)[slots], key) and torch.equal(v_cache.flatten(0, 1)[slots], value)
    assert (~cache.isnan()).sum().item() == 2 * key.numel()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_elementwise(poison_empty, dtype):
    t = 4096
    x, res = torch.randn(2, t, 4096, dtype=dtype, device="cuda")
    w = torch.randn(4096, dtype=dtype, device="cuda")
    out, new_res = rms_norm(x, w, 1e-5, res)
    h = x.double() + res.double()
    ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert rel_error(new_res, h) < GPU_TOL[dtype] and rel_error(out, ref) < GPU_TOL[dtype]

    g = torch.randn(t, 2 * 14336, dtype=dtype, device="cuda")
    assert rel_error(silu_and_mul(g), silu_and_mul_ref(g.double())) < GPU_TOL[dtype]

    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64, device="cuda") / 128))
    ang = torch.arange(131072, dtype=torch.float64, device="cuda")[:, None] * inv
    cs = torch.cat([ang.cos(), ang.sin()], -1).float()
    pos = torch.randint(0, 131072, (t,), device="cuda")
    q, k = torch.randn(t, 32, 128, dtype=dtype, device="cuda"), torch.randn(t, 8, 128, dtype=dtype, device="cuda")
    (qo, ko), (qr, kr) = rotary(pos, q, k, cs), rotary_ref(pos, q.double(), k.double(), cs.double())
    assert rel_error(qo, qr) < GPU_TOL[dtype] and rel_error(ko, kr) < GPU_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,bias,norm", [
    ((32, 8, 128), False, False),  # Llama-3.1-8B
    ((14, 2, 64), True, False),  # Qwen2.5-0.5B
    ((32, 4, 128), False, True),  # Qwen3-30B-A3B
])
def test_rotary_kv_write(dtype, shape, bias, norm):
    hq, hkv, d = shape
    t, bs, num_blocks = 4096, 16, 512
    cache, k_cache, v_cache = paged_kv(num_blocks, 3, bs, hkv, d, dtype)
    cache.fill_(float("nan"))
    qkv = torch.randn(t, (hq + 2 * hkv) * d, dtype=dtype, device="cuda")
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], -1))
    b = torch.randn((hq + 2 * hkv) * d, dtype=dtype, device="cuda") if bias else None
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float64, device="cuda") / d))
    ang = torch.arange(32768, dtype=torch.float64, device="cuda")[:, None] * inv
    cs = torch.cat([ang.cos(), ang.sin()], -1).float()
    pos = torch.randint(0, 32768, (t,), device="cuda")
    slots = torch.randperm(num_blocks * bs, device="cuda")[:t]
    qk_norm = qk_norm_weights(d, dtype) if norm else None
    qo = rotary_kv_write(pos, q, k, v, cs, k_cache, v_cache, slots, b, qk_norm=qk_norm)
    ref = cache.double()
    qr = rotary_kv_write_ref(pos, q.double(), k.double(), v.double(), cs.double(), ref[:, 1, 0], ref[:, 1, 1],
                             slots, b.double() if bias else None, qk_norm=as_double(qk_norm))
    assert rel_error(qo, qr) < GPU_TOL[dtype]
    assert torch.equal(cache.isnan(), ref.isnan())
    written = ~ref.isnan()
    assert rel_error(cache[written], ref[written]) < GPU_TOL[dtype]


@pytest.mark.parametrize("shape", ATTN)
@pytest.mark.parametrize("batch", [1, 16])
def test_fp8_kv_cache_attention(poison_empty, shape, batch):
    """--kv-cache-dtype fp8 at model sizes: the write quantizes bit for bit as the reference,
    decode and prefill attention over the fp8 cache match float64 attention over its dequantized
    values (calibrated-looking scales), bf16 queries."""
    from pdserve.kernels.reference import FP8_KV_DTYPE, kv_cache_write_ref

    hq, hkv, d, bs = shape
    ctx = torch.randint(1, 8192, (batch,)).tolist()
    ctx[0] = 8191
    num_blocks = sum(-(-c // bs) for c in ctx) + 4
    cache = torch.zeros(num_blocks, 2, 2, bs, hkv, d, dtype=FP8_KV_DTYPE, device="cuda")
    k_cache, v_cache = cache[:, 1, 0], cache[:, 1, 1]
    ks, vs = torch.tensor([0.02], device="cuda"), torch.tensor([0.013], device="cuda")
    rows = num_blocks * bs
    k = torch.randn(rows, hkv, d, dtype=torch.bfloat16, device="cuda") * 4
    v = torch.randn(rows, hkv, d, dtype=torch.bfloat16, device="cuda")
    slots = torch.arange(rows, device="cuda")
    expected = cache.clone()
    kv_cache_write_ref(k, v, expected[:, 1, 0], expected[:, 1, 1], slots, ks, vs)
    kv_cache_write(k, v, k_cache, v_cache, slots, ks, vs)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    kd, vd = k_cache.double() * ks.double(), v_cache.double() * vs.double()  # what the cache means
    bt = block_tables_for(ctx, bs, num_blocks, extra=3)
    lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, d, dtype=torch.bfloat16, device="cuda")
    sem = torch.zeros(batch * hkv, dtype=torch.int32, device="cuda")
    out = paged_decode_attention(q, k_cache, v_cache, bt, lens, d**-0.5, ks, vs, semaphores=sem)
    cu = torch.arange(batch + 1, device="cuda")
    assert rel_error(out, attention_f64(q, kd, vd, bt, cu, lens, d**-0.5)) < GPU_TOL[torch.bfloat16]
    n = [min(c, 300) for c in ctx]  # prefill chunks: the last n tokens of each context
    cu = torch.tensor([0] + n, device="cuda").cumsum(0).int()
    qp = torch.randn(int(cu[-1]), hq, d, dtype=torch.bfloat16, device="cuda")
    out = paged_prefill_attention(qp, k_cache, v_cache, bt, cu, lens, d**-0.5, ks, vs)
    assert rel_error(out, attention_f64(qp, kd, vd, bt, cu, lens, d**-0.5)) < GPU_TOL[torch.bfloat16]
