"""bench/kv_transfer.py: the real-layout case comes from the real BlockManager, and a tiny run
through both transports (real processes, real NIXL on CPU memory) writes every table."""

from __future__ import annotations

import pytest

from pdserve.bench import kv_transfer
from pdserve.worker.kv.nixl_transport import nixl_available


def test_churned_blocks_are_a_real_allocation_in_few_runs():
    ids = kv_transfer.churned_blocks(2048, 512, seed=3)
    assert len(ids) == len(set(ids)) == 512 and all(0 <= b < 2048 for b in ids)
    assert ids == kv_transfer.churned_blocks(2048, 512, seed=3)  # seeded: the GPU run sees the same layout
    # After churn the free space is fragmented, yet the allocator hands out long runs (an
    # allocator taking free blocks in LRU order gives ~1 run per 1-2 blocks on this workload).
    assert kv_transfer.num_runs(ids, ids) < 512 // 4


def test_layouts():
    assert kv_transfer.layout("contiguous", 4, 64, 0) == ([0, 1, 2, 3], [0, 1, 2, 3])
    src, dst = kv_transfer.layout("scattered", 4, 64, 0)
    assert src == dst == [0, 2, 4, 6] and kv_transfer.num_runs(src, dst) == 4
    src, dst = kv_transfer.layout("real", 16, 256, 0)
    assert len(src) == len(dst) == 16 and src != dst  # each side churned with its own seed


@pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")
def test_tiny_run_writes_every_table(tmp_path, capsys):
    out = tmp_path / "kv.md"
    rc = kv_transfer.main(["--sizes-mib", "1", "--block-kib", "64", "--iters", "1", "--breakdown-iters", "2",
                           "--lease-registration-blocks", "4", "--layouts", "contiguous", "real",
                           "--out", str(out)])
    assert rc == 0
    report = out.read_text()
    for needle in ("| 1 MiB | contiguous | 1 | 1.00 |", "| 1 MiB | real |", "nixl prepped GB/s", "nixl dlist GB/s",
                   "tcp GB/s", "memcpy per descriptor, issued GB/s", "| lease (side-channel round trip) |",
                   "| fixed cost per pull (ms) | real |",
                   "Per-lease NIXL registration of 4 blocks"):
        assert needle in report, needle


def test_descriptor_copies_move_every_block_of_each_layout():
    cases = [(kind, 0, *kv_transfer.layout(kind, 8, 64, 0)) for kind in ("contiguous", "scattered", "real")]
    rows = kv_transfer.descriptor_copies(cases, 64, 4096, "cpu", "cpu", iters=2)  # raises unless they landed
    assert set(rows) == {(kind, 0, f"memcpy per descriptor{src}, issued") for kind, *_ in cases
                         for src in ("", ", IPC source")}
    assert all(nbytes == 8 * 4096 and seconds > 0 for nbytes, seconds in rows.values())


def test_bad_flags_are_named():
    with pytest.raises(SystemExit):
        kv_transfer.main(["--iters", "0"])
    with pytest.raises(SystemExit):
        kv_transfer.main(["--eviction-slack", "-1"])
