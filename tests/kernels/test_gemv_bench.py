"""bench/gemv.py's plumbing on CPU (interpreted kernels, no timing): one shape row per prologue
and the bs=1 step rows at tiny sizes, so the device run (which the bench is for) does not die on a
Python error. Timings are stand-ins (1 µs / 1 ms) and nothing asserts on them."""

from __future__ import annotations

import pytest
import torch

from pdserve.bench import gemv
from tests.kernels.kernel_inputs import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU plumbing check; on a GPU run the bench itself")


@pytest.fixture
def cpu_bench(monkeypatch):
    monkeypatch.setattr(gemv, "DEVICE", "cpu")
    monkeypatch.setattr(gemv, "DT", torch.float32)
    monkeypatch.setattr(gemv, "L2_DEFEAT_BYTES", 1)  # one weight copy
    monkeypatch.setattr(gemv, "graph_time_us", lambda make_call, calls: [make_call(i)() for i in range(2)] and 1.0)
    monkeypatch.setattr(gemv, "graph_ms", lambda fn: (fn(), 1.0)[1])


@pytest.mark.parametrize("layer,prologue", [("qkv_proj", "rms_norm"), ("o_proj", "none"), ("down_proj", "silu_mul")])
def test_shape_row(cpu_bench, layer, prologue):
    from pdserve.kernels.fused_gemv import GemvConfig

    s = gemv.Shape("tiny", layer, prologue, 48, 80)
    row, (key, cfg) = gemv.bench_shape(s, 3, [GemvConfig(16, 32, 2)], bw=1e12)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:4] == ["tiny", layer, "48×80", "3"] and len(cells) == 12
    assert key == (prologue, 48, 80, 3)
    assert float(cells[-1]) < 1e-5  # fp32: fused equals unfused up to rounding


def test_step_rows(cpu_bench):
    rows = gemv.bench_step(["qwen2.5-0.5b"], bw=1e12, tiny=True)
    assert len(rows) == 1 and "failed" not in rows[0], rows
    assert float(rows[0].strip("|").split("|")[-1]) < 1e-5  # logits, GEMV path on vs off


def test_step_with_a_swept_table(cpu_bench):
    # A sweep's entries run as a third column, and the shipped table is back afterwards.
    from pdserve.kernels.fused_gemv import MEASURED, GemvConfig

    before = {card: dict(t) for card, t in MEASURED.items()}
    table = {("none", 16, 16, 1): GemvConfig(16, 32, 2, reduce_in_kernel=True)}
    rows = gemv.bench_step(["qwen2.5-0.5b"], bw=1e12, tiny=True, table=table)
    cells = rows[0].strip("|").split("|")
    assert len(cells) == 7 and "failed" not in rows[0], rows
    assert float(cells[-1]) < 1e-5  # logits of every column against the path off
    assert {card: dict(t) for card, t in MEASURED.items()} == before


def test_measured_dict_is_valid_python(cpu_bench, tmp_path, monkeypatch):
    # The closing dict is meant to be pasted into kernels/fused_gemv.py: it must parse, and
    # carry both kinds of entry.
    from pdserve.kernels.fused_gemv import GemvConfig

    out = tmp_path / "gemv.md"
    shapes = [gemv.Shape("tiny", "qkv_proj", "rms_norm", 48, 80), gemv.Shape("tiny", "down_proj", "silu_mul", 32, 48)]
    monkeypatch.setattr(gemv, "model_shapes", lambda name: shapes)
    monkeypatch.setattr(gemv, "copy_bandwidth", lambda: 1e12)
    monkeypatch.setattr(gemv, "sweep_configs", lambda quick: [GemvConfig(16, 32, 2, one_pass_norm=False)])
    # The unfused path "wins" the silu_mul shape, the fused one the rms_norm shape.
    def fake_time(make_call, calls):
        make_call(0)()
        return next(times)
    monkeypatch.setattr(gemv, "graph_time_us", fake_time)
    times = iter([5.0, 1.0, 2.0, 3.0,   # rms_norm: unfused, cuBLAS, default, two-pass split (default wins)
                  1.0, 1.0, 2.0])        # silu_mul: unfused wins (the two-pass config is skipped)
    monkeypatch.setattr("sys.argv", ["gemv", "--models", "tiny", "--rows", "2", "--out", str(out)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "cpu")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    gemv.main()
    text = out.read_text()
    table = gemv.swept_table(str(out))  # what --step --table reads back: the card's entries
    assert "MEASURED['cpu'] = {" in text  # keyed by the card's name
    assert set(table) == {("rms_norm", 48, 80, 2), ("silu_mul", 32, 48, 2)}
    assert table[("silu_mul", 32, 48, 2)] is None
    assert isinstance(table[("rms_norm", 48, 80, 2)], GemvConfig)


def test_a_swept_table_lays_over_the_shipped_one(tmp_path, monkeypatch):
    # bench/engine.py and bench/moe.py's --gemv-table: the sweep's entries win, the rest stay.
    import pdserve.kernels.fused_gemv as fg
    from pdserve.kernels.fused_gemv import GemvConfig

    monkeypatch.setattr(fg, "MEASURED", {"cpu": {("none", 8, 8, 1): GemvConfig(2, 1024, 1),
                                                 ("none", 9, 9, 1): None}})
    md = tmp_path / "gemv.md"
    md.write_text("| rows |\n\nMEASURED for kernels/fused_gemv.py (a config where ...):\n\n```python\n"
                  "MEASURED['cpu'] = {\n    ('none', 8, 8, 1): GemvConfig(4, 512, 2, reduce_in_kernel=True),\n"
                  "    ('rms_norm', 16, 8, 1): None\n}\n```\n")
    assert gemv.use_swept_table(str(md), torch.device("cpu")) == 2
    assert fg.MEASURED["cpu"] == {("none", 8, 8, 1): GemvConfig(4, 512, 2, reduce_in_kernel=True),
                                  ("none", 9, 9, 1): None, ("rms_norm", 16, 8, 1): None}
    cut_short = tmp_path / "cut.md"  # a sweep killed before its first row
    cut_short.write_text("| rows |\n")
    with pytest.raises(SystemExit, match="no MEASURED block"):
        gemv.swept_table(str(cut_short))
