"""gpt-oss in MXFP4 as published (models/gpt_oss.py, config/quantization.py): a tiny checkpoint
with the real tensor names and quantization_config (tests/mxfp4_checkpoints.py) generates what
transformers generates (fp32, greedy) from its dequantized twin, with prompts past the sliding
window; with the experts dequantized at load (CPU) and kept packed (as where the fused op runs
them); a wrong nibble order, gate/up interleave or orientation in the checkpoint changes the
tokens; tensor and expert parallelism (gloo) equal one rank; what cannot run is refused by name."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.kernels.moe_gate import moe_gate as moe_gate_kernel
from pdserve.kernels.mxfp4 import dequantize_mxfp4
from pdserve.worker.config.engine import ConfigError
from pdserve.worker.config.quantization import QuantizationError
from pdserve.worker.models import gpt_oss, moe
from pdserve.worker.models.gpt_oss import GptOssExperts
from pdserve.worker.models.loader import read_model_config
from pdserve.worker.parallel.shard import TPShard
from tests.checkpoints import write_checkpoint
from tests.helpers.engines import make_engine
from tests.mxfp4_checkpoints import CORRUPTIONS, PUBLISHED, packed_reference, write_mxfp4_pair
from tests.worker.test_engine_equality import GREEDY, PROMPTS, hf_reference

EXPERTS = "model.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def dense(tmp_path_factory, default_model_dir):
    """The tiny gpt-oss (2 layers: sliding window 8, then full) with experts 64 wide, so that two
    tensor-parallel ranks hold 32 columns each: one MXFP4 scale block."""
    return write_checkpoint(tmp_path_factory.mktemp("gpt-oss-i64"), "gpt-oss", default_model_dir, intermediate_size=64)


@pytest.fixture(scope="module")
def pair(dense, tmp_path_factory):
    return write_mxfp4_pair(dense, tmp_path_factory.mktemp("pair"))


@functools.cache
def tokens(ckpt: str, tp: int = 1, **kw) -> list[list[int]]:
    engine = make_engine(ckpt, tensor_parallel_size=tp, **kw)
    try:
        return engine.generate(PROMPTS, GREEDY)
    finally:
        engine.shutdown()


def test_mxfp4_checkpoint_matches_hf_on_its_dequantized_twin(pair):
    mxfp4, twin = pair
    engine = make_engine(mxfp4)
    experts = engine.runner.model.layers[0].mlp.experts
    # On CPU (no fused op) the experts were dequantized at load.
    assert experts.w13.dtype == torch.float32 and not hasattr(experts, "w13_scale")
    assert not engine.runner.model.cuda_graphs
    assert engine.generate(PROMPTS, GREEDY) == hf_reference(str(twin))
    # Chunks of 5 tokens: the window crosses chunks, mixed with decodes.
    assert tokens(str(mxfp4), max_num_batched_tokens=5) == hf_reference(str(twin))


def test_packed_experts_match_hf(pair, monkeypatch):
    """Where the fused op runs them, the experts stay uint8 as the checkpoint has them (no
    dequantized copy is ever made) and the op receives them with their exponents."""
    mxfp4, twin = pair
    monkeypatch.setattr(gpt_oss, "experts_op", lambda backend: packed_reference)
    monkeypatch.setattr(gpt_oss, "dequantize_mxfp4", None)  # the model itself never decodes them
    # Every step through the op (decode steps would route in kernels/moe_gate.py and run the fused
    # op's decode kernels, Triton's interpreter here: the next test's).
    monkeypatch.setattr(moe.DecodeGate, "takes", lambda self, tokens, mxfp4: False)
    monkeypatch.setattr(moe.DecodeGate, "takes_norm", lambda self, x, norm, mxfp4: False)
    engine = make_engine(mxfp4)
    model = engine.runner.model
    experts = model.layers[1].mlp.experts
    assert model.cuda_graphs and experts.packed
    e, h, i = 4, 64, 64
    assert experts.w13.dtype == experts.w2.dtype == experts.w13_scale.dtype == torch.uint8
    assert (experts.w13.shape, experts.w13_scale.shape) == ((e, 2 * i, h // 2), (e, 2 * i, h // 32))
    assert (experts.w2.shape, experts.w2_scale.shape) == ((e, h, i // 2), (e, h, i // 32))
    assert engine.generate(PROMPTS, GREEDY) == hf_reference(str(twin))


def test_packed_experts_on_the_fused_triton_op_match_hf(pair, monkeypatch):
    """The packed experts through kernels/fused_moe.fused_moe_routed (Triton's interpreter on CPU;
    attention on the torch backend, to keep it cheap): the op gets the uint8 tensors, their
    exponents, the biases and the clamped SwiGLU, decode steps are routed by kernels/moe_gate.py,
    and the tokens are transformers'."""
    from pdserve.kernels import moe_gate
    from pdserve.kernels.fused_moe import fused_moe_routed

    mxfp4, twin = pair
    monkeypatch.setattr(gpt_oss, "experts_op", lambda backend: fused_moe_routed)
    gated = []  # decode steps route through kernels/moe_gate.py (the router's GEMV + top-k in one launch)
    monkeypatch.setattr(moe_gate, "moe_gate", lambda x, *a: gated.append(x.shape[0]) or moe_gate_kernel(x, *a))
    engine = make_engine(mxfp4)
    assert engine.runner.model.layers[0].mlp.experts.packed
    # One prompt past the window: its prefill takes the sorted path, its decodes the decode path.
    assert engine.generate(PROMPTS[1:2], GREEDY) == hf_reference(str(twin))[1:2]
    assert gated and max(gated) <= moe_gate.MAX_TOKENS


@pytest.mark.parametrize("rank,size,ep", [(0, 1, False), (1, 2, False), (1, 2, True)], ids=["tp1", "tp2", "ep2"])
def test_packed_tensors_load_exactly_per_rank(pair, rank, size, ep):
    """A rank's packed gate|up rows and down column blocks decode to exactly its slice of the twin's
    experts, in our [gate; up] row order."""
    mxfp4, twin = pair
    cfg = read_model_config(str(mxfp4))
    shard = TPShard(rank, size, cfg, expert_parallel=ep)
    experts = GptOssExperts(cfg, shard, op=None, packed=True, name=EXPERTS)
    ckpt = load_file(str(mxfp4 / "model.safetensors"))
    for leaf, param in gpt_oss._MXFP4_TENSORS.items():
        experts.weight_loader(getattr(experts, param), ckpt[f"{EXPERTS}.{leaf}"], leaf)
    ref = load_file(str(twin / "model.safetensors"))
    gate_up, down = ref[f"{EXPERTS}.gate_up_proj"], ref[f"{EXPERTS}.down_proj"]  # [E, H, 2I], [E, I, H]
    n = experts.inter
    col = 0 if ep else rank * n
    for i, e in enumerate(shard.local_experts):
        w13 = dequantize_mxfp4(experts.w13[i], experts.w13_scale[i])
        assert torch.equal(w13[:n], gate_up[e][:, 0::2][:, col:col + n].t())
        assert torch.equal(w13[n:], gate_up[e][:, 1::2][:, col:col + n].t())
        assert torch.equal(dequantize_mxfp4(experts.w2[i], experts.w2_scale[i]), down[e][col:col + n].t())


@pytest.mark.parametrize("corrupt", CORRUPTIONS)
def test_a_wrong_nibble_order_interleave_or_orientation_changes_the_tokens(dense, pair, tmp_path, corrupt):
    mxfp4, twin = write_mxfp4_pair(dense, tmp_path, corrupt=corrupt)
    assert tokens(str(mxfp4)) != hf_reference(str(pair[1]))


@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "tp2-ep"])
def test_tp2_with_and_without_expert_parallel_equals_tp1(pair, ep):
    mxfp4, _ = pair
    assert tokens(str(mxfp4), 2, enable_expert_parallel=ep) == tokens(str(mxfp4))


# -- refused -------------------------------------------------------------------------------------

def _with_config(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


def test_mxfp4_is_gpt_oss_only_and_takes_no_quantization_flag(tiny_checkpoint, pair, tmp_path):
    llama = _with_config(tiny_checkpoint("llama"), tmp_path / "llama", quantization_config=PUBLISHED)
    with pytest.raises(QuantizationError, match=r"quant_method = 'mxfp4'.*gpt-oss.*not LlamaForCausalLM"):
        read_model_config(str(llama))
    with pytest.raises(QuantizationError, match="--quantization fp8.*already quantized.*mxfp4"):
        read_model_config(str(pair[0]), "fp8")
    cfg = read_model_config(str(pair[0]))
    assert cfg.mxfp4 is not None and cfg.quantization is None


def test_experts_left_unquantized_are_refused(pair, tmp_path):
    qc = {**PUBLISHED, "modules_to_not_convert": [*PUBLISHED["modules_to_not_convert"], "model.layers.1.mlp"]}
    ckpt = _with_config(pair[0], tmp_path / "mixed", quantization_config=qc)
    with pytest.raises(QuantizationError, match="leaves model.layers.1.mlp.experts unquantized"):
        make_engine(ckpt)


@pytest.mark.parametrize("leaf,change", [
    ("gate_up_proj_blocks", lambda t: t[:, :, :1]),  # K/32 of 2 blocks cut to 1
    ("down_proj_scales", lambda t: t[:, :32]),  # rows (H) cut
    ("down_proj_blocks", lambda t: t.to(torch.int16)),
])
def test_malformed_blocks_or_scales_are_refused_naming_the_tensor(pair, tmp_path, leaf, change):
    ckpt = _with_config(pair[0], tmp_path / "bad")
    tensors = load_file(str(ckpt / "model.safetensors"))
    name = f"{EXPERTS}.{leaf}"
    tensors[name] = change(tensors[name]).contiguous()
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(QuantizationError, match=f"checkpoint tensor {name} (has shape|is torch.int16)"):
        make_engine(ckpt)


def test_unquantized_experts_in_an_mxfp4_checkpoint_are_refused(dense, tmp_path):
    ckpt = _with_config(dense, tmp_path / "dense-labelled-mxfp4", quantization_config=PUBLISHED)
    with pytest.raises(QuantizationError, match=r"experts\.(gate_up|down)_proj' is unquantized.*MXFP4"):
        make_engine(ckpt)


def test_tensor_parallel_split_inside_a_scale_block_is_refused(pair):
    cfg = read_model_config(str(pair[0]))  # experts 64 wide: 32 per rank at TP=2, 16 at TP=4
    assert TPShard(1, 2, cfg).expert_intermediate_size == 32
    with pytest.raises(ConfigError, match="--tensor-parallel-size.*MXFP4.*--enable-expert-parallel"):
        TPShard(0, 4, cfg)
    assert list(TPShard(3, 4, cfg, expert_parallel=True).local_experts) == [3]
