"""The host KV cache's allocation: zeros that cost nothing until written (kv_cache.zeroed)."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.worker.attention.kv_cache import zeroed


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_zeroed_is_zeros_of_the_shape_and_writable(dtype):
    shape = (6, 2, 2, 4, 3, 8)
    t = zeroed(shape, dtype, torch.device("cpu"))
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert not t.float().any()
    t[2, 1] = 1.5
    assert t.float().sum().item() == 1.5 * 2 * 4 * 3 * 8
    assert zeroed((0, 4), dtype, torch.device("cpu")).shape == (0, 4)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads the resident size from /proc")
def test_an_unwritten_cache_takes_no_resident_memory():
    """torch.zeros would make all 512 MiB resident before the first request; the mapping makes a
    page resident when it is written."""
    before = _rss_bytes()
    t = zeroed((512, 1 << 20), torch.uint8, torch.device("cpu"))
    assert _rss_bytes() - before < 64 << 20
    t[:64] = 1  # 64 MiB written: those pages, and only those, become resident
    grown = _rss_bytes() - before
    assert 64 << 20 <= grown < 128 << 20
    assert int(t[64:].sum()) == 0


def test_a_cache_moved_to_shared_memory_keeps_its_contents():
    """--kv-tcp-io process shares the CPU cache with its TCP processes (kv/connector.py)."""
    t = zeroed((4, 1024), torch.float32, torch.device("cpu"))
    t[1] = 3.0
    t.share_memory_()
    assert t.is_shared() and t[1].eq(3.0).all() and not t[0].any()
