"""bench/deepseek.py's plumbing on CPU (interpreted kernels, a shrunken DeepSeek-V3 config with
its FP8 block quantization, no timing), so the device run it is for (tools/gpu/deepseek.sh) does
not die on a Python error. Timings are a 1 us stand-in and nothing asserts on them; the kernel's
error against the reference is real."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from pdserve.bench import deepseek

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU plumbing check; on a GPU run the bench itself")

SMALL = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, n_group=4,
             topk_group=2, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
             kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, vocab_size=1024)


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(deepseek, "DEVICE", "cpu")
    monkeypatch.setattr(deepseek, "_bandwidth", lambda: 1e11)
    monkeypatch.setattr(deepseek, "_bench_us", lambda fn, rep: (fn(), 1.0)[1])


def test_kernel_table(on_cpu, monkeypatch, tmp_path):
    monkeypatch.setattr(deepseek, "HEADS", 4)
    monkeypatch.setattr(deepseek, "LATENT", 32)
    monkeypatch.setattr(deepseek, "ROPE", 16)
    monkeypatch.setattr(deepseek, "BLOCK", 4)
    out = tmp_path / "kernel.md"
    old = str(Path(__file__).parents[2] / "tools" / "gpu" / "baselines" / "mla_decode_600a0db.py")
    assert deepseek.kernel(argparse.Namespace(contexts=[9], batches=[1, 2], out=str(out), old=old,
                                              sweep=False)) == 0
    rows = [line.split("|") for line in out.read_text().splitlines() if line.startswith("| bf16") or
            line.startswith("| fp8")]
    assert len(rows) == 4
    assert all(r[7].strip() == "1.0" for r in rows)  # the baseline copy ran beside (1 us: the stand-in)
    assert all(float(r[-3]) < 2e-2 for r in rows)  # the kernel's max relative error vs the reference
    assert [r[-2].strip() != "-" for r in rows] == [True, True, False, False]  # the expanded baseline: bf16


def test_kernel_sweep(on_cpu, monkeypatch, tmp_path):
    monkeypatch.setattr(deepseek, "HEADS", 20)
    monkeypatch.setattr(deepseek, "LATENT", 32)
    monkeypatch.setattr(deepseek, "ROPE", 16)
    monkeypatch.setattr(deepseek, "BLOCK", 4)
    monkeypatch.setattr(deepseek, "SWEEP_SHAPES", [("bf16", 9, 2), ("fp8", 5, 1)])
    monkeypatch.setattr(deepseek, "SWEEP_TILES", [(16, 16, 4, 2), (32, 16, 8, 1)])
    out = tmp_path / "sweep.md"
    assert deepseek.kernel(argparse.Namespace(contexts=[], batches=[], out=str(out), old=None, sweep=True)) == 0
    text = out.read_text()
    assert text.count("| (") == 2 and "- best at bf16 9 b2:" in text and "- best at fp8 5 b1:" in text
    assert "| - |" not in text  # every tile ran and matched the reference


def test_checkpoint_engine_and_report(on_cpu, monkeypatch, tmp_path):
    monkeypatch.setattr(deepseek, "V3", {**deepseek.V3, **SMALL})
    monkeypatch.setattr(deepseek, "OFFLINE_IN", 16)
    monkeypatch.setattr(deepseek, "OFFLINE_OUT", 4)
    ckpt, rows = tmp_path / "ckpt", tmp_path / "rows.jsonl"
    assert deepseek.main(["checkpoint", "--checkpoint", str(ckpt), "--layers", "2", "--dense-layers", "1"]) == 0
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [128, 128] and cfg["first_k_dense_replace"] == 1
    # One engine (each costs seconds on CPU): the fp8 latent cache's row, FP8 block weights made at load.
    assert deepseek.main(["engine", "--checkpoint", str(ckpt), "--eager", "--kv-cache-dtype", "fp8", "--context", "12",
                          "--decode-steps", "3", "--offline", "2", "--rows", str(rows)]) == 0
    out = tmp_path / "engine.md"
    assert deepseek.main(["report", "--rows", str(rows), "--out", str(out)]) == 0
    text = out.read_text()
    assert "| eager | fp8 | 80 |" in text  # 2 layers x (32 + 8) one-byte values per token
    assert " (2 x 16/4) |" in text  # the offline run: 2 prompts, each to its 4 tokens
