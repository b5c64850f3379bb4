"""rotary_kv_write: bias + q/k norm + rotary + KV write in one kernel, against the composed references."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.reference import rotary_kv_write_ref
from pdserve.kernels.rms_norm import rms_norm
from pdserve.kernels.rotary_kv_write import rotary_kv_write
from tests.kernels.kernel_inputs import (DEVICE, TOL, as_double, assert_matches_separate_norm, cos_sin_cache,
                                        fused_qkv, paged_kv, qk_norm_weights, rel_error)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d,block_size,with_bias,with_norm", [
    (4, 4, 64, 16, False, False),
    (6, 2, 40, 5, True, False),  # GQA 3, non-power-of-two dim, odd block size, Qwen2-style bias
    (3, 1, 96, 8, True, False),
    (4, 4, 64, 16, False, True),  # Qwen3: q/k norm, no bias
    (6, 2, 40, 5, True, True),  # both: the bias is added before the norm
    (8, 2, 128, 16, False, True),  # Qwen3-30B-A3B's head_dim and GQA group (32 / 4 heads)
])
def test_matches_reference(poison_empty, dtype, hq, hkv, d, block_size, with_bias, with_norm):
    torch.manual_seed(0)  # fixed inputs (bf16 with the norm measured up to 0.95% apart over 75 seeds)
    t, num_blocks = 11, 7
    cs = cos_sin_cache(300, d)
    positions = torch.randint(0, 300, (t,), device=DEVICE)
    q, k, v = fused_qkv(t, hq, hkv, d, dtype)
    bias = torch.randn((hq + 2 * hkv) * d, dtype=dtype, device=DEVICE) if with_bias else None
    qk_norm = qk_norm_weights(d, dtype) if with_norm else None
    cache, k_cache, v_cache = paged_kv(num_blocks, 3, block_size, hkv, d, dtype)
    cache.fill_(float("nan"))  # every slot not written must stay NaN, in every layer
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:t]
    slots[[1, 6]] = -1  # padding rows (CUDA-graph batches): no write, q still rotated

    q_out = rotary_kv_write(positions, q, k, v, cs, k_cache, v_cache, slots.int(), bias, qk_norm=qk_norm)

    # float64 reference from the same inputs into a float64 copy of the cache.
    ref_cache = cache.double()
    b64 = bias.double() if bias is not None else None
    q_ref = rotary_kv_write_ref(positions, q.double(), k.double(), v.double(), cs.double(),
                                ref_cache[:, 1, 0], ref_cache[:, 1, 1], slots, b64, qk_norm=as_double(qk_norm))
    assert q_out.dtype == dtype and q_out.is_contiguous()
    assert rel_error(q_out, q_ref) < TOL[dtype]
    assert torch.equal(cache.isnan(), ref_cache.isnan())  # exactly the mapped slots, this layer only
    assert (~cache.isnan()).sum().item() == 2 * (t - 2) * hkv * d
    keep = slots >= 0
    blocks, offs = slots[keep] // block_size, slots[keep] % block_size
    for layer_kv in (0, 1):
        got = cache[blocks, 1, layer_kv, offs]
        want = ref_cache[blocks, 1, layer_kv, offs]
        assert rel_error(got, want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_equals_the_separate_norm_kernel_then_rotary(dtype):
    # What the fusion replaces: kernels/rms_norm.py over every q and k head, then this kernel
    # without the norm. Here the sum of squares adds the two halves' sums: another order than
    # the norm kernel's, even under the interpreter.
    g = torch.Generator().manual_seed(1)
    t, hq, hkv, d, block_size = 9, 6, 2, 40, 4
    qkv = (3 * torch.randn(t, (hq + 2 * hkv) * d, generator=g)).to(dtype).to(DEVICE)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], -1))
    qk_norm = qk_norm_weights(d, dtype, g)
    cs, positions = cos_sin_cache(64, d), torch.randint(0, 64, (t,), generator=g).to(DEVICE)
    slots = torch.randperm(8 * block_size, generator=g)[:t].to(DEVICE)
    slots[3] = -1
    fused_cache, k_cache, v_cache = paged_kv(8, 2, block_size, hkv, d, dtype)
    separate_cache = fused_cache.clone()

    q_fused = rotary_kv_write(positions, q, k, v, cs, k_cache, v_cache, slots, qk_norm=qk_norm)
    wq, wk, eps = qk_norm
    qn = rms_norm(q.reshape(-1, d), wq, eps)[0].view(t, hq, d)
    kn = rms_norm(k.reshape(-1, d), wk, eps)[0].view(t, hkv, d)
    q_sep = rotary_kv_write(positions, qn, kn, v, cs, separate_cache[:, 1, 0], separate_cache[:, 1, 1], slots)

    assert_matches_separate_norm(q_fused, q_sep)
    assert_matches_separate_norm(fused_cache, separate_cache)
    assert torch.equal(fused_cache[:, :, 1], separate_cache[:, :, 1])  # v: not normalised, bit for bit


def test_v_passes_through_unrotated_and_position_zero_is_identity():
    # fp32, no bias: v must be written bit for bit; q and k at position 0 are unchanged.
    t, hq, hkv, d = 3, 2, 1, 16
    q, k, v = fused_qkv(t, hq, hkv, d, torch.float32)
    cache, k_cache, v_cache = paged_kv(2, 1, 4, hkv, d, torch.float32, layer=0)
    slots = torch.tensor([0, 5, 2], device=DEVICE)
    q_out = rotary_kv_write(torch.zeros(t, dtype=torch.int64, device=DEVICE), q, k, v, cos_sin_cache(4, d),
                            k_cache, v_cache, slots)
    assert torch.equal(q_out, q)
    assert torch.equal(v_cache.reshape(-1, hkv, d)[slots], v)
    assert torch.equal(k_cache.reshape(-1, hkv, d)[slots], k)


def test_empty_batch_and_bad_arguments():
    q, k, v = fused_qkv(3, 4, 2, 32, torch.float32)
    cache, k_cache, v_cache = paged_kv(4, 2, 4, 2, 32, torch.float32)
    cs, pos, slots = cos_sin_cache(16, 32), torch.arange(3, device=DEVICE), torch.arange(3, device=DEVICE)
    before = cache.clone()
    out = rotary_kv_write(pos[:0], q[:0], k[:0], v[:0], cs, k_cache, v_cache, slots[:0])
    assert out.shape == (0, 4, 32) and torch.equal(cache, before)
    with pytest.raises(ValueError, match=r"rotary_kv_write: v has shape \[3, 1, 32\], expected \[3, 2, 32\]"):
        rotary_kv_write(pos, q, k, v[:, :1], cs, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match=r"bias has shape \[10\], expected \[256\]"):
        rotary_kv_write(pos, q, k, v, cs, k_cache, v_cache, slots, torch.zeros(10, device=DEVICE))
    with pytest.raises(TypeError, match="slot_mapping has dtype float32"):
        rotary_kv_write(pos, q, k, v, cs, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match=r"k_cache has shape \[4, 4, 2, 32\], expected \[\*, \*, 1, 32\]"):
        rotary_kv_write(pos, q, k[:, :1], v[:, :1], cs, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="k_cache and v_cache must have the same shape"):
        rotary_kv_write(pos, q, k, v, cs, k_cache, v_cache[:2], slots)
    w = torch.ones(32, device=DEVICE)
    with pytest.raises(ValueError, match=r"k_norm_weight has shape \[16\], expected \[32\]"):
        rotary_kv_write(pos, q, k, v, cs, k_cache, v_cache, slots, qk_norm=(w, w[:16], 1e-6))
    with pytest.raises(TypeError, match="q_norm_weight has dtype bfloat16"):
        rotary_kv_write(pos, q, k, v, cs, k_cache, v_cache, slots, qk_norm=(w.bfloat16(), w, 1e-6))
    with pytest.raises(ValueError, match="q_norm_weight must be contiguous"):
        rotary_kv_write(pos, q, k, v, cs, k_cache, v_cache, slots, qk_norm=(torch.ones(64)[::2], w, 1e-6))
    with pytest.raises(ValueError, match="qk_norm eps must be > 0, got 0"):
        rotary_kv_write(pos, q, k, v, cs, k_cache, v_cache, slots, qk_norm=(w, w, 0))
    assert torch.equal(cache, before)
