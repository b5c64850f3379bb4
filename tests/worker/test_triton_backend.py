"""The GPU engine path against the torch reference engine: same greedy tokens.

On CPU (CI) the Triton backend and the Triton element-wise kernels run under TRITON_INTERPRET=1
(tests/conftest.py sets it) on CPU tensors, and the decode graphs' static-buffer path runs
without capture. On a CUDA machine (tier 4) the same tests run compiled, with real CUDA graphs,
plus the GPU-only checks at the end (--enforce-eager, KV sizing by --gpu-memory-utilization).
fp32 throughout, so the two engines may differ only by rounding, and the tiny checkpoint's
peaked logits (tests/checkpoints.py) leave greedy decoding no near-ties to flip.
"""

from __future__ import annotations


import pytest
import torch

from pdserve.kernels.arrivals import strip_counters
from pdserve.worker.config.engine import EngineConfig
from pdserve.worker.engine.llm_engine import LLMEngine
from pdserve.worker.executor.cuda_graphs import DecodeGraphConfig, batch_buckets
from pdserve.worker.request.sampling_params import SamplingParams
from tests.checkpoints import checkpoint_factory, write_word_tokenizer
from tests.helpers.engines import ON_GPU, device_engine

gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (tier 4)")

# Dispatched with the slow modules, before the quick ones (tests/conftest.py):
# engines under Triton's interpreter on CI's CPU, 15-35 s a test.
pytestmark = pytest.mark.slow


PROMPTS = [
    [5, 17, 300, 42, 9, 1000, 77],
    list(range(100, 137)),  # spans several blocks
    [3, 4],
]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """Made here, so this file runs where the default model is not installed (the GPU machine)."""
    return write_word_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_dir):
    return checkpoint_factory(tmp_path_factory, tokenizer_dir)


def make_engine(ckpt, backend: str | None, **kw) -> LLMEngine:
    # A second live engine on the GPU needs a larger --gpu-memory-utilization than the first
    # (device_engine): the references below ask for more.
    return device_engine(ckpt, attention_backend=backend, **{"max_num_seqs": 8, **kw})


def reference_tokens(ckpt, prompts, params):
    engine = make_engine(ckpt, "torch", static_decode=False, gpu_memory_utilization=0.6)
    return engine.generate(prompts, params)


# qwen2 (bias, tied) runs in the graphs test. qwen3's q/k norms run inside the rotary epilogue,
# or (fuse_qk_norm off: bench/moe.py's baseline) as rms_norm launches before it.
@pytest.mark.parametrize("arch,fuse_qk_norm", [("llama", True), ("qwen3", True), ("qwen3", False)])
def test_triton_backend_matches_torch_backend(checkpoint, monkeypatch, arch, fuse_qk_norm):
    from pdserve.worker.attention.triton_backend import TritonAttentionBackend

    monkeypatch.setattr(TritonAttentionBackend, "fuse_qk_norm", fuse_qk_norm)
    ckpt = checkpoint(arch)
    engine = make_engine(ckpt, "triton", static_decode=False)
    assert engine.attention_backend == "triton"
    assert engine.runner.graphs is None
    assert engine.runner.model.layers[0].self_attn.norm_in_epilogue == (arch == "qwen3" and fuse_qk_norm)
    assert engine.generate(PROMPTS, GREEDY) == reference_tokens(ckpt, PROMPTS, GREEDY)
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks
    # The split merge counts in the device's shared arrival counters and leaves them zero.
    assert TritonAttentionBackend.semaphores(8, engine.runner.device) is strip_counters(engine.runner.device)
    assert not strip_counters(engine.runner.device).any()


def test_triton_backend_mixed_steps_match(checkpoint):
    # An 8-token budget splits prompts into chunks and mixes them with decodes in one step:
    # the backend's decode-first split of q, and the prefill kernel over cached prefixes.
    ckpt = checkpoint("llama")
    engine = make_engine(ckpt, "triton", static_decode=False, max_num_batched_tokens=8)
    assert engine.generate(PROMPTS, GREEDY) == reference_tokens(ckpt, PROMPTS, GREEDY)


def test_decode_graphs_pad_to_buckets_and_match(checkpoint):
    # Three sequences finishing at different lengths walk the batch down through buckets 4
    # (one padded row), 2 and 1; max_num_seqs=5 makes 5 a bucket too.
    ckpt = checkpoint("qwen2")
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (9, 5, 2)]
    engine = make_engine(ckpt, "triton", static_decode=True, max_num_seqs=5)
    graphs = engine.runner.graphs
    assert graphs.buckets == [1, 2, 4, 5]
    assert graphs.config.capture == ON_GPU
    first = engine.generate(PROMPTS, params)
    assert first == reference_tokens(ckpt, PROMPTS, params)
    assert [len(t) for t in first] == [9, 5, 2]
    assert graphs.num_replays == 8  # every step after the first (the prompts' prefill) is decode-only
    # Again, now with stale ids in the static block table from the first run.
    assert engine.generate(PROMPTS[::-1], params[::-1]) == reference_tokens(ckpt, PROMPTS[::-1], params[::-1])


@pytest.mark.parametrize("arch", ["qwen2-moe", "qwen3-moe"])
def test_moe_triton_backend_with_decode_graphs_matches_torch(checkpoint, arch):
    # The fused MoE kernel and its device-side sort inside the decode graphs' static buffers
    # (captured on a GPU): padded rows route like any token and are dropped after. Qwen2-MoE:
    # every layer sparse, with the shared expert. Qwen3-MoE: its q/k norms inside the fused
    # rotary epilogue of the decode graphs' attention (the bs=1 decode it was fused for).
    ckpt = checkpoint(arch)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (6, 4, 2)]
    engine = make_engine(ckpt, "triton", static_decode=True, max_num_seqs=4, max_num_batched_tokens=16)
    assert engine.generate(PROMPTS, params) == reference_tokens(ckpt, PROMPTS, params)
    assert engine.runner.graphs.num_replays > 0


def test_gpt_oss_triton_backend_matches_torch(checkpoint):
    # Sinks and sliding windows (8 positions, the 37-token prompt slides) in the Triton decode
    # kernel (fused rotary epilogue, split merge) and the prefill kernel over cached chunks (an
    # 8-token budget: mixed steps). Its experts run the fused Triton op (biases, clamped SwiGLU),
    # which a CUDA graph can capture, so the model allows decode graphs.
    ckpt = checkpoint("gpt-oss")
    engine = make_engine(ckpt, "triton", max_num_batched_tokens=8)
    assert engine.runner.model.cuda_graphs
    assert engine.generate(PROMPTS, GREEDY) == reference_tokens(ckpt, PROMPTS, GREEDY)


@pytest.mark.parametrize("static_decode,budget,kv_dtype", [(True, None, "fp8"), (False, 8, "auto")])
def test_deepseek_triton_backend_matches_torch(checkpoint, static_decode, budget, kv_dtype):
    # Multi-head latent attention: the latent written by kernels/mla_cache_write.py and decoded in
    # the latent space by kernels/mla_decode.py; the experts through the fused op's top-k entry
    # after DeepSeek's grouped routing. The decode graphs' static buffers (captured on a GPU; 3
    # sequences run bucket 4, its padding row's slot -1 skipped by the latent write) with an fp8
    # latent cache of per-layer scales; an 8-token budget: decodes mixed with chunks that expand
    # cached latents.
    ckpt = checkpoint("deepseek-v3")
    kw = dict(kv_cache_dtype=kv_dtype, max_num_batched_tokens=budget)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (8, 5, 3)]
    engine = make_engine(ckpt, "triton", static_decode=static_decode, max_num_seqs=4, **kw)
    reference = make_engine(ckpt, "torch", static_decode=False, gpu_memory_utilization=0.6, **kw)
    assert engine.runner.model.cuda_graphs and not reference.runner.model.cuda_graphs
    layers = engine.kv_cache.num_layers
    if kv_dtype == "fp8":
        for e in (engine, reference):
            e.kv_cache.scales.copy_(torch.linspace(0.05, 0.8, 2 * layers).reshape(layers, 2))
    assert engine.generate(PROMPTS, params) == reference.generate(PROMPTS, params)
    assert (engine.runner.graphs is not None and engine.runner.graphs.num_replays > 0) == static_decode


@pytest.mark.parametrize("static_decode,budget", [(True, None), (False, 8)])
def test_fp8_kv_cache_matches_torch_backend(checkpoint, static_decode, budget):
    # --kv-cache-dtype fp8 with calibrated-looking scales: the Triton writes (the fused decode
    # launch, the prefill epilogue) quantize as the reference does and the kernels dequantize
    # alike, in decode-only graph steps and in mixed chunked steps.
    ckpt = checkpoint("qwen2")
    kw = dict(kv_cache_dtype="fp8", max_num_batched_tokens=budget)
    engine = make_engine(ckpt, "triton", static_decode=static_decode, **kw)
    reference = make_engine(ckpt, "torch", static_decode=False, gpu_memory_utilization=0.6, **kw)
    layers = engine.kv_cache.num_layers
    for e in (engine, reference):
        e.kv_cache.scales.copy_(torch.linspace(0.05, 0.8, 2 * layers).reshape(layers, 2))
    assert engine.generate(PROMPTS, GREEDY) == reference.generate(PROMPTS, GREEDY)


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(256)[-3:] == [240, 248, 256]


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        DecodeGraphConfig(max_batch=0, max_blocks_per_seq=4)
    with pytest.raises(ValueError, match="max_blocks_per_seq must be >= 1"):
        DecodeGraphConfig(max_batch=4, max_blocks_per_seq=0)
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        LLMEngine(EngineConfig(device="cpu"), attention_backend="flash")


@gpu_only
def test_gpu_defaults_triton_graphs_and_enforce_eager(checkpoint):
    ckpt = checkpoint("llama")
    engine = make_engine(ckpt, None)
    assert engine.attention_backend == "triton" and engine.runner.graphs is not None
    assert engine.runner.graphs.capture_seconds > 0
    eager = make_engine(ckpt, None, enforce_eager=True, gpu_memory_utilization=0.6)
    assert eager.runner.graphs is None
    assert engine.generate(PROMPTS, GREEDY) == eager.generate(PROMPTS, GREEDY)
    assert engine.runner.graphs.num_replays > 0


@gpu_only
def test_gpu_memory_utilization_sizes_kv_cache(checkpoint):
    ckpt = checkpoint("llama")
    total = torch.cuda.mem_get_info()[1]
    small = make_engine(ckpt, None, gpu_memory_utilization=0.2, enforce_eager=True)
    small_bytes = small.kv_cache.tensor.numel() * small.kv_cache.tensor.element_size()
    del small
    big = make_engine(ckpt, None, gpu_memory_utilization=0.4, enforce_eager=True)
    big_bytes = big.kv_cache.tensor.numel() * big.kv_cache.tensor.element_size()
    # The tiny model is ~1 MB, so the KV cache takes nearly all of the allowed share.
    assert small_bytes < 0.2 * total < big_bytes < 0.4 * total
    assert big_bytes - small_bytes > 0.15 * total
