"""bench/moe.py's `decode` plumbing on CPU (interpreted kernels, no CUDA graphs, no timing), so the
device run the bench is for does not die on a Python error. Timings are a 1 us stand-in and
nothing asserts on them; the correctness cells (errors vs the loop, bit-stability) are real."""

from __future__ import annotations

import argparse

import pytest
import torch

from pdserve.bench import moe
from tests.kernels.kernel_inputs import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU plumbing check; on a GPU run the bench itself")


def test_decode_table(monkeypatch, tmp_path):
    import pdserve.kernels.moe_route as mr

    monkeypatch.setattr(moe, "DEVICE", "cpu")
    monkeypatch.setattr(moe, "DT", torch.float32)
    monkeypatch.setattr(moe, "GRAPH_LAYERS", 2)
    monkeypatch.setattr(moe, "DECODE_SWEEP_GU", moe.DECODE_SWEEP_GU[:2])
    monkeypatch.setattr(moe, "DECODE_SWEEP_DOWN", moe.DECODE_SWEEP_DOWN[:2])
    import pdserve.kernels.fused_moe as fm

    monkeypatch.setattr(mr, "ONE_WARP_MAX_EXPERTS", mr.ONE_WARP_MAX_EXPERTS)  # restored after the test
    monkeypatch.setattr(fm, "SUM_IN_TORCH", fm.SUM_IN_TORCH)
    monkeypatch.setattr(fm, "FUSE_ROUTE_ALIGN", fm.FUSE_ROUTE_ALIGN)
    warps_seen = []

    def fake_time(make_call, calls):
        for i in range(calls):
            make_call(i)()
        warps_seen.append(mr.ONE_WARP_MAX_EXPERTS)
        return 1.0

    monkeypatch.setattr(moe, "graph_time_us", fake_time)
    out = tmp_path / "decode.md"
    args = argparse.Namespace(tokens=[1, 6], hidden=64, inter=32, experts=8, top_k=2, copy_gbs=1000.0, out=str(out))
    assert moe.decode(args) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 1 ") or line.startswith("| 6 ")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 13
        sorted_err, decode_err = (float(v) for v in cells[9].split(" / "))
        assert sorted_err < 1e-5 and decode_err < 1e-5  # fp32: both paths equal the per-expert loop
        assert cells[10] == "yes"
    assert 64 in warps_seen and mr.ONE_WARP_MAX_EXPERTS == 256  # the "before" routing ran, then was put back
    assert fm.SUM_IN_TORCH is False and fm.FUSE_ROUTE_ALIGN is True


def test_fp8_table(monkeypatch, tmp_path):
    # `bench moe fp8` at a tiny shape: bf16 (fp32 here) vs FP8 block-128 and per-channel experts,
    # decode path (1 token) and sorted path (6); each equals the loop on its own (dequantized) weights.
    monkeypatch.setattr(moe, "DEVICE", "cpu")
    monkeypatch.setattr(moe, "DT", torch.float32)
    monkeypatch.setattr(moe, "_bench_us", lambda fn: fn() is None or 1.0)
    out = tmp_path / "fp8.md"
    args = argparse.Namespace(tokens=[1, 6], hidden=64, inter=32, experts=8, top_k=2, out=str(out))
    assert moe.fp8(args) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith(("| 1 ", "| 6 "))]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 9
        assert all(float(v) < 1e-5 for v in cells[8].split(" / "))


def test_mxfp4_table(monkeypatch, tmp_path):
    # `bench moe mxfp4` at a tiny gpt-oss-like shape: bf16 (fp32 here) vs MXFP4 experts with biases
    # and the clamped SwiGLU, decode path (1 token) and sorted path (17: above MXFP4_DECODE_MAX_TOKENS);
    # both equal the reference.
    monkeypatch.setattr(moe, "DEVICE", "cpu")
    monkeypatch.setattr(moe, "DT", torch.float32)
    monkeypatch.setattr(moe, "_bench_us", lambda fn: fn() is None or 1.0)
    monkeypatch.setattr(moe, "GPT_OSS", {"tiny": dict(experts=8, top_k=2, hidden=64, inter=32)})
    out = tmp_path / "mxfp4.md"
    args = argparse.Namespace(models=["tiny"], tokens=[1, 17], copy_gbs=1000.0, out=str(out))
    assert moe.mxfp4(args) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| tiny ")]
    assert len(rows) == 2
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 11
        assert all(float(v) < 1e-4 for v in cells[9].split(" / "))


def test_engine_report_names_the_moe_path(tmp_path):
    rows = tmp_path / "rows.jsonl"
    common = dict(tp=1, ep=False, layers=12, decode_ms=1.0, roofline_ms=0.5, start_s=20, card="x")
    import json

    rows.write_text(
        json.dumps(dict(common, moe_path="auto"))
        + "\n"
        + json.dumps(dict(common, moe_path="sorted"))
        + "\n"
        + json.dumps(common)
        + "\n"  # a row from before the flag existed
        + json.dumps(dict(common, moe_path="auto", quantization="fp8", decode_ms=0.25))
        + "\n"
        + json.dumps(dict(common, moe_path="auto", gate_norm=True, down_knobs='{"DOWN_REDUCE_HERE": true}'))
        + "\n"
        + json.dumps(dict(common, moe_path="auto", no_fused_gemv=True))
        + "\n"
        + json.dumps(dict(common, moe_path="auto", gemv_table="/out/gemv.md"))
        + "\n"
    )
    out = tmp_path / "engine.md"
    assert moe.report(argparse.Namespace(rows=str(rows), out=str(out))) == 0
    text = out.read_text()
    assert text.count("(new)") == 6 and text.count("(before)") == 1 and "50%" in text
    assert "attention on cuBLAS (no GEMV table)" in text and "the swept GEMV table" in text
    assert "the router's norm in its launch, knobs {\"DOWN_REDUCE_HERE\": true}" in text
    fp8_row = next(line for line in text.splitlines() if "--quantization fp8" in line)
    assert "0.25 | - | -" in fp8_row and "200%" not in text  # no bf16 roofline for FP8 weights



def test_config_only_checkpoint_writes_no_weights(tmp_path):
    """`checkpoint --config-only` (tools/gpu/moe.sh: engines with --load-format dummy, whose
    start on a config-only folder tests/worker/test_load_format.py covers): config and
    tokenizer, every layer asked for, no weight file."""
    import json

    path = tmp_path / "cfg"
    assert moe.main(["checkpoint", "--checkpoint", str(path), "--layers", "48", "--config-only"]) == 0
    assert not list(path.glob("*.safetensors")) and (path / "tokenizer.json").exists()
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_experts_per_tok"]) == (48, 8)
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
