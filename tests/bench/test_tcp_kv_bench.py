"""bench/tcp_kv.py: a tiny CPU run through every path (real processes, real sockets, real NIXL
on CPU memory) writes a row per path and size, each against the raw socket of the same run."""

from __future__ import annotations

import pytest

from pdserve.bench import tcp_kv
from pdserve.worker.kv import tcp_stream
from pdserve.worker.kv.nixl_transport import nixl_available


def test_configs_parse_ucx_transport_lists():
    assert tcp_kv._parse_configs("raw,tcp,nixl:tcp,cuda_copy,tcp-inline,nixl:tcp") == [
        ("raw", {}), ("tcp", {}), ("nixl", {"UCX_TLS": "tcp,cuda_copy"}), ("tcp-inline", {}),
        ("nixl", {"UCX_TLS": "tcp"})]


@pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")
def test_tiny_run_writes_every_row(tmp_path):
    out = tmp_path / "tcp_kv.md"
    assert tcp_kv.main(["--sizes-mib", "1", "2", "--block-kib", "256", "--iters", "1", "--streams-sweep", "1",
                        "--configs", "raw,tcp,tcp-inline,nixl:tcp", "--out", str(out)]) == 0
    report = out.read_text()
    for row in (
        "| raw socket, 1 stream |",
        "| raw sockets, 4 streams |",
        f"| TCP data path, 4 streams, {tcp_stream.CHUNK_BYTES >> 20} MiB chunks |",
        "| TCP data path, 1 stream |",
        "| TCP inline",
        "| NIXL, UCX_TLS=tcp",
    ):  # (,cuda_copy where a GPU is)
        line = next((x for x in report.splitlines() if x.startswith(row)), None)
        assert line is not None and line.count("|") == 4, (row, report)  # a cell per size: no path failed
    assert "failed" not in report
