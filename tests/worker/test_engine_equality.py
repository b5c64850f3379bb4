"""Greedy generation equals Hugging Face transformers token for token (fp32, CPU)."""

from __future__ import annotations

import functools

import pytest
import torch

from pdserve.worker.attention.kv_cache import KVCache
from pdserve.worker.request.sampling_params import SamplingParams
from tests.helpers.engines import make_engine

PROMPTS = [
    [5, 17, 300, 42, 9, 1000, 77],
    list(range(100, 137)),  # longer than several blocks
    [3, 4],
    [900 + 7 * i for i in range(19)],
]
MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@functools.lru_cache(maxsize=None)
def hf_reference(ckpt: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    outs = []
    for p in PROMPTS:
        ids = model.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
        outs.append(ids[0, len(p):].tolist())
    return outs


# gpt-oss: sinks, q/k/v/o biases, layers alternating sliding (window 8: every prompt but [3, 4]
# outgrows it, as do the 12 generated tokens) and full attention, YaRN rope, the biased experts'
# clamped SwiGLU; with 5-token chunks, a chunk's queries see keys of earlier chunks through the
# window, mixed with decodes of other sequences.
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama3-rope", "gpt-oss"])
def test_batched_greedy_matches_hf(tiny_checkpoint, arch):
    ckpt = tiny_checkpoint(arch)
    engine = make_engine(ckpt)
    assert engine.generate(PROMPTS, GREEDY) == hf_reference(str(ckpt))
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


@pytest.mark.parametrize("arch", ["llama", "gpt-oss"])
def test_chunked_prefill_matches_hf(tiny_checkpoint, arch):
    ckpt = tiny_checkpoint(arch)
    # A 5-token budget splits every prompt over several steps and mixes chunks with decodes.
    engine = make_engine(ckpt, max_num_batched_tokens=5)
    assert engine.generate(PROMPTS, GREEDY) == hf_reference(str(ckpt))


def test_prefix_cache_hits_keep_outputs(tiny_checkpoint):
    ckpt = tiny_checkpoint("qwen2")
    engine = make_engine(ckpt)
    ref = hf_reference(str(ckpt))
    first = engine.generate(PROMPTS, GREEDY)
    hits_before = engine.stats().prefix_cache_hits
    second = engine.generate(PROMPTS, GREEDY)
    assert first == second == ref
    # Every full block but the one holding the last prompt token comes from the cache.
    expected_hits = sum((len(p) - 1) // 4 * 4 for p in PROMPTS)
    assert engine.stats().prefix_cache_hits - hits_before == expected_hits


def test_preemption_by_recompute_matches_hf(tiny_checkpoint):
    ckpt = tiny_checkpoint("qwen3")
    engine = make_engine(ckpt)
    per_block = engine.kv_cache.block_bytes
    # 16 blocks x 4 tokens cannot hold all four sequences at once (they need ~29 blocks).
    engine = make_engine(ckpt, kv_cache_memory=16 * per_block, enable_prefix_caching=False, max_model_len=64)
    assert engine.generate(PROMPTS, GREEDY) == hf_reference(str(ckpt))
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.num_free_blocks == stats.num_total_blocks


# Mixture of experts: Qwen3-MoE (top-2 renormalised, one dense layer), Mixtral (top-2 of 4),
# Qwen2-MoE (not renormalised, shared expert) against transformers' own MoE code; one engine
# feature per architecture keeps the CI time small (each checkpoint is a fresh model load).
@pytest.mark.parametrize("arch,kw", [
    ("qwen3-moe", dict(max_num_batched_tokens=5)),  # chunked prefill mixed with decodes
    ("mixtral", {}),
    ("qwen2-moe", {}),
])
def test_moe_greedy_matches_hf(tiny_checkpoint, arch, kw):
    ckpt = tiny_checkpoint(arch)
    engine = make_engine(ckpt, **kw)
    assert engine.generate(PROMPTS, GREEDY) == hf_reference(str(ckpt))
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


@pytest.mark.parametrize("gate_norm", [False, True])
@pytest.mark.parametrize("arch", ["qwen2-moe", "mixtral", "gpt-oss"])
def test_moe_decode_gate_matches_hf(tiny_checkpoint, arch, gate_norm, monkeypatch):
    """Decode steps routed by kernels/moe_gate.py (the router's GEMV and top-k in one launch, in
    Triton's interpreter; Qwen2-MoE's top-2 not renormalised beside its shared expert, Mixtral's
    renormalised, gpt-oss's with its router bias), the experts computed by the reference from that
    choice: transformers' tokens.
    The gate runs where the experts' op is not the reference, so the op here is the reference
    under another name. `gate_norm`: the post-attention add + RMSNorm inside that launch too."""
    from pdserve.kernels import moe_gate
    from pdserve.kernels.reference import fused_moe_routed_ref
    from pdserve.worker.models import moe

    from pdserve.worker.models import gpt_oss

    for module in (moe, gpt_oss):
        monkeypatch.setattr(module, "moe_op", lambda backend: lambda *a, **k: fused_moe_routed_ref(*a, **k))
    monkeypatch.setattr(moe, "GATE_NORM", gate_norm)
    gated, normed, gate = [], [], moe_gate.moe_gate

    def spy(x, *a):
        gated.append(x.shape[0])
        normed.append(len(a) > 5 and a[5] is not None)
        return gate(x, *a)

    monkeypatch.setattr(moe_gate, "moe_gate", spy)
    ckpt = tiny_checkpoint(arch)
    assert make_engine(ckpt).generate(PROMPTS, GREEDY) == hf_reference(str(ckpt))
    assert gated and max(gated) <= moe_gate.MAX_TOKENS
    assert all(normed) if gate_norm else not any(normed)


@pytest.mark.parametrize("arch", ["mixtral", "gpt-oss"])
def test_prefix_cache_hits_and_preemption_match_hf(tiny_checkpoint, arch):
    ckpt = tiny_checkpoint(arch)
    ref = hf_reference(str(ckpt))
    engine = make_engine(ckpt)
    assert engine.generate(PROMPTS, GREEDY) == ref
    hits_before = engine.stats().prefix_cache_hits
    assert engine.generate(PROMPTS, GREEDY) == ref
    assert engine.stats().prefix_cache_hits - hits_before == sum((len(p) - 1) // 4 * 4 for p in PROMPTS)
    # 16 blocks of every layer's KV (gpt-oss: 32 blocks of its hybrid cache, docs/kv-cache.md).
    per_block = KVCache.bytes_per_block(engine.model_config, 4, engine.runner.kv_dtype)
    small = make_engine(ckpt, kv_cache_memory=16 * per_block, enable_prefix_caching=False, max_model_len=64)
    assert small.generate(PROMPTS, GREEDY) == ref
    assert small.stats().num_preemptions > 0


def test_max_model_len_must_fit_the_kv_cache(tiny_checkpoint):
    from pdserve.worker.config.engine import ConfigError

    ckpt = tiny_checkpoint("llama")
    per_block = make_engine(ckpt).kv_cache.block_bytes
    # 8 blocks x 4 tokens = 32 tokens: a 128-token limit could never be served (it would
    # preempt itself forever), so an explicit one is refused, naming the flag...
    with pytest.raises(ConfigError, match="--max-model-len"):
        make_engine(ckpt, kv_cache_memory=8 * per_block, max_model_len=128)
    # ...and the model's default is lowered to what fits.
    engine = make_engine(ckpt, kv_cache_memory=8 * per_block, max_model_len=None)
    assert engine.max_model_len == 32 and engine.scheduler.max_model_len == 32


def test_unsupported_architecture_is_named(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    from pdserve.worker.config.model import ModelConfig
    from pdserve.worker.config.unsupported_model import UnsupportedModelError
    from transformers import AutoConfig

    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelConfig.from_hf(AutoConfig.from_pretrained(tmp_path))
