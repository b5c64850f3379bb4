"""bench/tcp_senders.py: a tiny CPU run (real child process, real reader process, real sockets)
writes a row per mode and round, the reader's bytes flowing in both sender modes."""

from __future__ import annotations

from pdserve.bench import tcp_senders


def test_tiny_run_writes_a_row_per_mode(tmp_path):
    out = tmp_path / "tcp_senders.md"
    tcp_senders.main(["--mib", "4", "--gbps", "0.2", "--seconds", "0.5", "--rounds", "1", "--out", str(out)])
    rows = {line.split("|")[2].strip(): line.split("|") for line in out.read_text().splitlines()
            if line.startswith("| 1 |")}
    assert set(rows) == {"alone", "thread", "process"}, rows
    for mode in ("thread", "process"):
        assert float(rows[mode][8]) > 0, f"no bytes reached the reader from the {mode} senders"
        assert int(rows[mode][7]) > 0  # steps were timed beside them
