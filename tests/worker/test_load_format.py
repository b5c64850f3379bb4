"""--load-format dummy: random weights of the checkpoint's shapes and formats, made on the device,
from a directory that holds only config.json and the tokenizer (model_loader.init_dummy_weights).
The default (auto) still reads the real weights. On CPU, tiny checkpoints (tests/checkpoints.py):
a dense model, an MoE one, gpt-oss, and an FP8 checkpoint's config (quantization_config kept)."""

from __future__ import annotations

import functools
import math
import shutil
import uuid
from pathlib import Path

import pytest
import torch

from pdserve.worker.engine.llm_engine import LLMEngine
from pdserve.worker.request.sampling_params import SamplingParams
from tests.helpers.engines import make_engine

PROMPT = [5, 17, 300, 42, 7, 99, 1000, 12, 31, 8, 64, 3]  # longer than gpt-oss's window of 8


def config_only(src: Path, dst: Path) -> Path:
    """A copy of the checkpoint without its weights: config.json, generation_config.json and the
    tokenizer's files."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    assert not list(dst.glob("*.safetensors"))
    return dst


engine = functools.partial(make_engine, max_model_len=64, kv_cache_memory=1 << 20)


def generate(eng: LLMEngine, n: int = 6) -> tuple[list[int], list[float]]:
    """Greedy ids and their logprobs (the top-1 alternative's too)."""
    rid = f"t-{uuid.uuid4().hex[:6]}"
    eng.add_request(rid, PROMPT, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1))
    ids, lps, done = [], [], False
    while not done:
        for o in eng.step():
            ids += o.new_token_ids
            for lp in o.logprobs or []:
                lps += [lp.logprob, *(v for _, v in lp.top)]
            done = done or o.finished
    return ids, lps


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe", "gpt-oss"])
def test_dummy_weights_from_config_and_tokenizer_only(arch, tiny_checkpoint, tmp_path, caplog):
    src = tiny_checkpoint(arch)
    with caplog.at_level("INFO", logger="pdserve.worker.models.loader"):
        eng = engine(config_only(src, tmp_path / "cfg"), load_format="dummy")
    assert "--load-format dummy" in caplog.text
    net = eng.runner.model
    params = list(net.parameters())
    assert all(torch.isfinite(p).all() and p.abs().max() <= 1e-3 for p in params)
    assert all(p.abs().max() > 0 for p in params)  # every parameter drawn, none left as to_empty's garbage/zeros
    ids, lps = generate(eng)
    assert len(ids) == 6 and lps and all(math.isfinite(x) for x in lps)
    # The same weights each start (fixed seed).
    again = engine(config_only(src, tmp_path / "cfg2"), load_format="dummy")
    assert all(torch.equal(a, b) for a, b in zip(params, again.runner.model.parameters()))
    # The default still reads the checkpoint: its weights, not the dummy ones.
    real = engine(src)
    assert real.config.load_format == "auto"
    assert any(not torch.equal(a, b) for a, b in zip(params, real.runner.model.parameters()))
    assert max(p.abs().max().item() for p in real.runner.model.parameters()) > 1e-2
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors.*--load-format dummy"):
        engine(tmp_path / "cfg")


@pytest.mark.parametrize("arch,block", [("llama", None), ("qwen3-moe", [128, 128])])
def test_dummy_fp8_checkpoint_keeps_its_formats(arch, block, tiny_checkpoint, tmp_path, caplog):
    """An FP8 checkpoint's config (per-channel, or 128x128 block-scaled e4m3): the layers are built FP8 as the
    checkpoint would load them, filled with e4m3 values and positive scales, and the model runs
    (on CPU the FP8 layers are dequantized at load, as a real FP8 checkpoint's are)."""
    import json

    src = config_only(tiny_checkpoint(arch), tmp_path / "fp8")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  **({"weight_block_size": block} if block else {})}
    (src / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level("INFO", logger="pdserve.worker.models.loader"):
        eng = engine(src, load_format="dummy")
    assert "--load-format dummy" in caplog.text and "fp8" in caplog.text.lower()
    named = dict(eng.runner.model.named_parameters())
    assert all(torch.isfinite(p.float()).all() for p in named.values())
    # On CPU the FP8 weights were dequantized after the fill: e4m3 values times the scale 1e-3.
    q = named["layers.0.self_attn.qkv_proj.weight"].float() / 1e-3
    assert q.abs().max() <= 1 and torch.allclose(q, q.to(torch.float8_e4m3fn).float(), rtol=1e-5, atol=0)
    ids, lps = generate(eng, 4)
    assert len(ids) == 4 and all(math.isfinite(x) for x in lps)


def test_dummy_fp8_experts_stay_e4m3_with_their_scales(tiny_checkpoint, tmp_path):
    """Where the Triton MoE op runs (a GPU), an FP8 checkpoint's experts are kept e4m3 with their
    block scales: the dummy fill gives those tensors e4m3 values in +-1 and scales of 1e-3."""
    import json

    from pdserve.worker.models.loader import init_dummy_weights, read_model_config
    from pdserve.worker.models.moe import FusedExperts
    from pdserve.worker.parallel.shard import TPShard
    from pdserve.worker.quantization.fp8_linear import keep_quantized_dtypes

    src = config_only(tiny_checkpoint("qwen3-moe"), tmp_path / "fp8")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (src / "config.json").write_text(json.dumps(cfg))
    mc = read_model_config(str(src))
    with torch.device("meta"):
        experts = FusedExperts(mc, TPShard(0, 1, mc), op=None, fp8_kernel=True)
    experts = keep_quantized_dtypes(experts.to(torch.bfloat16)).to_empty(device="cpu")
    init_dummy_weights(experts)
    assert experts.keep_fp8
    for w, s in ((experts.w13, experts.w13_scale), (experts.w2, experts.w2_scale)):
        assert w.dtype == torch.float8_e4m3fn and 0.5 < w.float().abs().max() <= 1
        assert s.dtype == torch.float32 and bool((s == 1e-3).all())


@pytest.mark.parametrize("packed", [False, True], ids=["dequantized", "packed"])
def test_dummy_mxfp4_experts(packed, tiny_checkpoint, tmp_path, monkeypatch):
    """gpt-oss's published config (quantization_config mxfp4): the experts are drawn as MXFP4
    straight into their packed tensors (random bytes, exponents DUMMY_MXFP4_SCALE: decoded within
    DUMMY_RANGE). Where the fused op runs them they stay packed and nothing decodes them (no bf16
    copy, which gpt-oss-120b's 65 GB rely on); elsewhere they are dequantized as a real
    checkpoint's. Either way the model generates finite logprobs."""
    import json

    from pdserve.kernels.mxfp4 import FP4_VALUES
    from pdserve.worker.models import gpt_oss
    from pdserve.worker.models.loader import DUMMY_MXFP4_SCALE, DUMMY_RANGE
    from tests.mxfp4_checkpoints import PUBLISHED, packed_reference

    src = config_only(tiny_checkpoint("gpt-oss"), tmp_path / "mxfp4")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "quantization_config": PUBLISHED}))
    if packed:
        monkeypatch.setattr(gpt_oss, "experts_op", lambda backend: packed_reference)
        monkeypatch.setattr(gpt_oss, "dequantize_mxfp4", None)  # the model never decodes its experts
    eng = engine(src, load_format="dummy")
    experts = [layer.mlp.experts for layer in eng.runner.model.layers]
    for ex in experts:
        if packed:
            assert ex.w13.dtype == ex.w2.dtype == torch.uint8 and len(torch.unique(ex.w13)) > 200  # random bytes
            assert bool((ex.w13_scale == DUMMY_MXFP4_SCALE).all()) and bool((ex.w2_scale == DUMMY_MXFP4_SCALE).all())
        else:
            w = torch.cat([ex.w13.flatten(), ex.w2.flatten()])
            assert w.dtype == torch.float32 and 0 < w.abs().max() <= DUMMY_RANGE
            assert bool(torch.isin(w * 2.0 ** (127 - DUMMY_MXFP4_SCALE), torch.tensor(FP4_VALUES)).all())
    ids, lps = generate(eng)
    assert len(ids) == 6 and lps and all(math.isfinite(x) for x in lps)
