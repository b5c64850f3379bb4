"""kv_cache_write: the Triton kernel against the reference, into a strided multi-layer cache."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels.reference import kv_cache_write_ref
from pdserve.kernels.kv_cache_write import kv_cache_write
from tests.kernels.kernel_inputs import DEVICE, paged_kv


def _nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@pytest.mark.parametrize(
    "src_dtype,cache_dtype,block_size,hkv,d",
    [
        (torch.float32, torch.float32, 16, 2, 64),
        (torch.bfloat16, torch.bfloat16, 5, 3, 40),  # odd block size, non-power-of-two heads/dim
        (torch.float32, torch.bfloat16, 8, 1, 32),  # converts to the cache dtype
    ],
)
def test_writes_exactly_the_mapped_slots(src_dtype, cache_dtype, block_size, hkv, d):
    num_blocks, t = 9, 13
    cache, k_cache, v_cache = paged_kv(num_blocks, 3, block_size, hkv, d, cache_dtype)
    cache.fill_(float("nan"))  # every slot not written must stay NaN, in every layer
    key = torch.randn(t, hkv, d, dtype=src_dtype, device=DEVICE)
    value = torch.randn(t, hkv, d, dtype=src_dtype, device=DEVICE)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:t]
    slots[[2, 7]] = -1  # padding tokens are skipped
    expected = cache.clone()
    kv_cache_write_ref(key, value, expected[:, 1, 0], expected[:, 1, 1], slots)

    kv_cache_write(key, value, k_cache, v_cache, slots.int())

    if src_dtype == cache_dtype:
        assert _nan_equal(cache, expected)  # a pure copy: bit for bit
    else:
        # Triton's interpreter truncates fp32 -> bf16 where torch rounds to nearest: one ulp.
        assert torch.equal(cache.isnan(), expected.isnan())
        diff = (cache.float() - expected.float()).nan_to_num(0.0).abs()
        assert (diff <= expected.float().nan_to_num(0.0).abs() * 2**-7).all()
    written = (~cache.isnan()).sum().item()
    assert written == 2 * (t - 2) * hkv * d


def test_value_strided_input_and_empty_batch():
    cache, k_cache, v_cache = paged_kv(4, 2, 4, 2, 16, torch.float32)
    before = cache.clone()
    empty = torch.empty(0, 2, 16, device=DEVICE)
    kv_cache_write(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(cache, before)
    # key/value as views into a fused qkv output: row stride larger than Hkv * D
    qkv = torch.randn(5, 3, 2, 16, device=DEVICE)
    slots = torch.tensor([0, 5, 6, 15, 9], device=DEVICE)
    expected = cache.clone()
    kv_cache_write_ref(qkv[:, 1], qkv[:, 2], expected[:, 1, 0], expected[:, 1, 1], slots)
    kv_cache_write(qkv[:, 1], qkv[:, 2], k_cache, v_cache, slots)
    assert torch.equal(cache, expected)


def test_rejects_bad_arguments(monkeypatch):
    _, k_cache, v_cache = paged_kv(4, 2, 4, 2, 16, torch.float32)
    key = torch.randn(3, 2, 16, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match=r"kv_cache_write: key has shape \[3, 2, 8\], expected \[\*, 2, 16\]"):
        kv_cache_write(key[..., :8], key[..., :8], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="value has shape"):
        kv_cache_write(key, key[:2], k_cache, v_cache, slots)
    with pytest.raises(TypeError, match="slot_mapping has dtype float32"):
        kv_cache_write(key, key, k_cache, v_cache, slots.float())
    with pytest.raises(ValueError, match="same shape, strides and dtype"):
        kv_cache_write(key, key, k_cache, v_cache.contiguous(), slots)
    with pytest.raises(TypeError, match="key has dtype int64"):
        kv_cache_write(key.long(), key, k_cache, v_cache, slots)
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="needs CUDA tensors"):
            kv_cache_write(key, key, k_cache, v_cache, slots)
