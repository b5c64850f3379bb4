"""bench/tcp_io.py: a tiny CPU run of each side (real child processes, real sockets) writes a
row per mode, the reader's bytes flowing in both modes."""

from __future__ import annotations

import pytest

from pdserve.bench import tcp_io


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_tiny_run_writes_a_row_per_mode(tmp_path, side):
    out = tmp_path / "tcp_io.md"
    tcp_io.main(["--side", side, "--mib", "4", "--gbps", "0.2", "--seconds", "0.5", "--rounds", "1",
                 "--out", str(out)])
    rows = {line.split("|")[2].strip(): line.split("|") for line in out.read_text().splitlines()
            if line.startswith("| 1 |")}
    assert set(rows) == {"alone", "thread", "process"}, rows
    for mode in ("thread", "process"):
        assert float(rows[mode][8]) > 0, f"no bytes reached the reader with {mode} data connections"
        assert int(rows[mode][7]) > 0  # steps were timed beside them
