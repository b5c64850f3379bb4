"""tools/gpu/gpt_oss.py: the published configs it writes, the roofline's bytes, and the CPU run of
its engine and capacity steps (tiny shapes, --load-format dummy) into the report's tables."""

from __future__ import annotations

import json

from tools.gpu import gpt_oss


def test_configs_are_the_published_shapes(tmp_path):
    assert gpt_oss.main(["config", "--size", "120b", "--out", str(tmp_path / "120b")]) == 0
    cfg = json.loads((tmp_path / "120b" / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (36, 128, 4)
    assert cfg["layer_types"][:2] == ["sliding_attention", "full_attention"] and len(cfg["layer_types"]) == 36
    assert cfg["quantization_config"]["quant_method"] == "mxfp4" and cfg["vocab_size"] == 201088
    assert not list((tmp_path / "120b").glob("*.safetensors"))  # no weights: --load-format dummy
    twenty = gpt_oss.make_config("20b", "bf16", tiny=False)
    assert (twenty["num_hidden_layers"], twenty["num_local_experts"]) == (24, 32)
    assert "quantization_config" not in twenty
    # The engine reads the published shapes as gpt-oss (the bf16 form: this test runs on any tree).
    from pdserve.worker.models.loader import read_model_config

    assert gpt_oss.main(["config", "--size", "120b", "--format", "bf16", "--out", str(tmp_path / "bf16")]) == 0
    mc = read_model_config(str(tmp_path / "bf16"))
    assert (mc.architecture, mc.num_layers, mc.num_experts, mc.num_experts_per_tok) == ("GptOssForCausalLM", 36,
                                                                                       128, 4)
    assert (mc.sliding_window, len(mc.sliding_layers), mc.swiglu_limit) == (128, 18, 7.0)


def test_roofline_bytes_of_a_bs1_step():
    parts = gpt_oss.step_bytes(gpt_oss.make_config("120b", "mxfp4", tiny=False))
    # attention 2880 x (4096 + 2 x 512) + 4096 x 2880 bf16 weights a layer, four experts of
    # 3 x 2880 x 2880 weights at 4.25 bits, lm_head 201088 x 2880 bf16
    assert abs(parts["attention"] / 36 - 2 * 2880 * 9216) < 1e5
    assert abs(parts["experts"] / 36 / 4 - 3 * 2880 * 2880 * 4.25 / 8) < 1e5
    assert parts["lm_head"] == 2 * 201088 * 2880
    assert 4.9e9 < parts["total"] < 5.1e9
    bf16 = gpt_oss.step_bytes(gpt_oss.make_config("120b", "bf16", tiny=False))
    assert bf16["experts"] > 3.7 * parts["experts"] and bf16["attention"] == parts["attention"]


def test_cpu_run_fills_the_tables(tmp_path):
    ckpt, rows = tmp_path / "tiny", tmp_path / "rows.jsonl"
    assert gpt_oss.main(["config", "--size", "20b", "--format", "bf16", "--tiny", "--out", str(ckpt)]) == 0
    common = ["--checkpoint", str(ckpt), "--name", "tiny", "--rows", str(rows), "--device", "cpu"]
    profile = tmp_path / "profile.md"
    assert gpt_oss.main(["engine", *common, "--decode-steps", "3", "--num-prompts", "2", "--input-len", "24",
                         "--output-len", "3", "--profile", str(profile)]) == 0
    assert "| kernel | calls/step |" in profile.read_text()  # the step's kernel table (empty on CPU)
    assert gpt_oss.main(["capacity", *common, "--prompt-len", "300", "--kv-gib", "0.0008", "--requests", "8",
                         "--decode-tokens", "2"]) == 0
    assert gpt_oss.main(["engine", "--checkpoint", str(tmp_path / "none"), "--name", "broken", "--rows", str(rows),
                         "--device", "cpu"]) == 1  # a failed step is a row with its error, not a crash
    out, js = tmp_path / "r.md", tmp_path / "r.json"
    assert gpt_oss.main(["report", "--rows", str(rows), "--out", str(out), "--json", str(js)]) == 0
    engine, released, kept, broken = json.loads(js.read_text())["rows"]
    assert engine["decode_ms"] > 0 and engine["offline_tok_s"] > 0 and "error" not in engine
    # The capacity step runs twice: with the window-aware release, then without it (every layer's
    # blocks kept): in the same memory the release holds the sliding layers' blocks only once.
    assert released["mode"].startswith("window-aware release on") and "off" in kept["mode"]
    assert released["kv_tokens"] > kept["kv_tokens"]
    for capacity in (released, kept):  # 8 requests of 300 tokens in KV for fewer: the rest wait
        assert 0 < capacity["resident_peak"] < 8 and capacity["tokens_per_request"] >= 300
    assert "error" in broken
    text = out.read_text()
    assert "| tiny | bf16 |" in text and "| broken |" in text and "| tiny | " in text.split("KV mode")[1]
