"""bench/fp8.py's A/B switches (the engines' timings are the device's; this checks the harness):
each engine starts with the values its variant names and the module defaults come back after it."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from pdserve.bench import fp8
from pdserve.kernels import fp8_block_gemm
from pdserve.worker.quantization import fp8_linear


def _values() -> dict:
    return {"split": fp8_block_gemm.SPLIT_MAX_M, "rowwise": fp8_linear.TRITON_ROWWISE_MAX_M,
            "prologue": fp8_linear.FP8_GEMV_PROLOGUE_MAX_M, "fused": fp8_linear.FUSED_ACT_QUANT,
            "gemv": fp8_linear.FP8_GEMV_MAX_M, "measured": fp8_linear.FP8_GEMV_MEASURED_ROWS,
            "scaled_mm_block": fp8_linear.SCALED_MM_BLOCK}


@pytest.mark.parametrize("on", [False, True])
def test_an_engine_starts_with_its_switches_and_the_defaults_return(monkeypatch, on):
    seen = {}

    def start_engine(path, quantization, device, max_num_seqs):
        seen.update(_values())
        raise RuntimeError("no engine in this test")

    monkeypatch.setattr(fp8, "start_engine", start_engine)
    defaults = _values()
    args = SimpleNamespace(device="cpu", num_prompts=0)
    switches = {"block_split": on, "rowwise_triton": on, "fp8_prologue": on}
    with pytest.raises(RuntimeError, match="no engine"):
        fp8.speed("v", "ckpt", "fp8", args, 1e10, block_scaled_mm=False, fused_quant=False, gemv_rows="64",
                  switches=switches)
    assert seen == {"split": fp8_block_gemm.SPLIT_ROWS if on else 0, "rowwise": 128 if on else 0,
                    "prologue": 1 if on else 0, "fused": False, "gemv": 64, "measured": False,
                    "scaled_mm_block": False}
    assert _values() == defaults


def test_smoke_runs_one_engine_per_switch_value(tmp_path):
    # Each format's engines: the product of the switches that apply to it, named in its row.
    out = tmp_path / "fp8.md"
    proc = subprocess.run([sys.executable, "-m", "pdserve.bench.fp8", "--smoke", "--out", str(out),
                           "--rowwise-triton", "off", "on", "--block-split", "off", "on"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert "FAILED" not in text, text
    for row in ("| bf16 |", "| FP8 per-channel, W8A8 on _scaled_mm |", "| FP8 per-channel, W8A8 on the Triton GEMM |",
                "| FP8 block-128, K unsplit |", "| FP8 block-128, K split |"):
        assert row in text, row
