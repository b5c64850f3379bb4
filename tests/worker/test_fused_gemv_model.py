"""The model's small-batch GEMV path (kernels/fused_gemv.py wired in models/llama.py) against the
same engine without it: same greedy tokens, same logprobs up to fp32 rounding.

On CPU (CI) the Triton backend and the GEMV run under TRITON_INTERPRET=1 (tests/conftest.py sets
it) on CPU tensors; the path is forced on through the backend's `fused_gemv` switch (by default it
runs only the shapes kernels/fused_gemv.MEASURED names for the card, and "cpu" has none). Steps of
<= 8 tokens (every decode step here, and the short prompts' prefills) take it; the 37-token
prompt's prefill shows the fallback in the same run. A spy on the launcher proves the path ran:
without it, equal tokens would prove nothing.
"""

from __future__ import annotations


import pytest
import torch

from pdserve.kernels import fused_gemv as gemv_module
from pdserve.worker.attention.triton_backend import TritonAttentionBackend
from pdserve.worker.engine.llm_engine import LLMEngine
from pdserve.worker.request.sampling_params import SamplingParams
from tests.worker.gloo_pair import join_gloo_group, run_gloo_pair
from tests.checkpoints import checkpoint_factory, write_word_tokenizer
from tests.helpers.engines import DEVICE, ON_GPU, device_engine

PROMPTS = [[5, 17, 300, 42, 9, 1000, 77], list(range(100, 137)), [3, 4]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_factory(tmp_path_factory, write_word_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture
def gemv_calls(monkeypatch):
    """Counts launches of the GEMV by prologue (the real kernel still runs)."""
    calls: dict[str, int] = {}
    real = gemv_module.fused_gemv

    def spy(x, weight, prologue="none", **kw):
        calls[prologue] = calls.get(prologue, 0) + 1
        return real(x, weight, prologue, **kw)

    monkeypatch.setattr(gemv_module, "fused_gemv", spy)
    return calls


def make_engine(ckpt, monkeypatch, fused: bool | None, static_decode: bool) -> LLMEngine:
    monkeypatch.setattr(TritonAttentionBackend, "fused_gemv", fused)  # read at model build
    return device_engine(ckpt, attention_backend="triton", static_decode=static_decode, max_num_seqs=4)


def run(engine: LLMEngine, params: SamplingParams):
    """Greedy tokens and the chosen tokens' logprobs per prompt."""
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    for rid, prompt in zip(ids, PROMPTS):
        engine.add_request(rid, prompt, params)
    tokens = {rid: [] for rid in ids}
    logprobs = {rid: [] for rid in ids}
    pending = set(ids)
    while pending:
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            logprobs[o.request_id] += [lp.logprob for lp in o.logprobs or []]
            if o.finished:
                pending.discard(o.request_id)
    return [tokens[r] for r in ids], [logprobs[r] for r in ids]


# llama: plain; qwen2: q/k/v bias (added by the attention epilogue) and tied embeddings; qwen3:
# per-head q/k norms (the projection's output is normed before rotary).
@pytest.mark.parametrize("arch,static_decode", [("llama", True), ("qwen2", False), ("qwen3", True)])
def test_gemv_path_matches_unfused_path(checkpoint, monkeypatch, gemv_calls, arch, static_decode):
    ckpt = checkpoint(arch)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    plain = make_engine(ckpt, monkeypatch, False, static_decode)
    assert not any(layer.gemv_qkv or layer.gemv_mlp for layer in plain.runner.model.layers)
    want_tokens, want_lp = run(plain, params)
    assert all(len(lp) == 6 for lp in want_lp)
    del plain
    assert gemv_calls == {}  # the switch off: never launched
    fused = make_engine(ckpt, monkeypatch, True, static_decode)
    layers = fused.runner.model.layers
    assert all(layer.gemv_qkv and layer.gemv_mlp and layer.self_attn.gemv_o for layer in layers)
    got_tokens, got_lp = run(fused, params)
    assert got_tokens == want_tokens
    for got, want in zip(got_lp, want_lp):
        assert got == pytest.approx(want, abs=1e-4)
    # Every layer: qkv and gate/up with the norm (rms_norm), down with SiLU·mul, o_proj plain,
    # in each decode step (and the short prompts' prefills).
    n = len(layers)
    assert gemv_calls["rms_norm"] == 2 * gemv_calls["silu_mul"] == 2 * gemv_calls["none"]
    assert gemv_calls["silu_mul"] >= n * 5  # at least the 5 decode steps after the prefill


def test_measured_table_hands_a_shape_back_to_cublas(checkpoint, monkeypatch, gemv_calls):
    # MEASURED None for down_proj's shape (tiny checkpoint: hidden 64, intermediate 128): that
    # stage runs unfused (silu_and_mul, then down_proj), the other GEMVs still fused.
    ckpt = checkpoint("llama")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    table = {("rms_norm", 64 + 2 * 32, 64, 1): gemv_module.GemvConfig(16, 32, 2)}
    table |= {("silu_mul", 64, 128, bucket): None for bucket in (1, 2, 4, 8)}
    monkeypatch.setitem(gemv_module.MEASURED, gemv_module.card_name(torch.device(DEVICE)), table)
    want, _ = run(make_engine(ckpt, monkeypatch, False, False), params)
    got, _ = run(make_engine(ckpt, monkeypatch, True, False), params)
    assert got == want
    assert "silu_mul" not in gemv_calls and gemv_calls["rms_norm"] > 0 and gemv_calls["none"] > 0


def test_default_switch_takes_only_the_measured_shapes(checkpoint, monkeypatch, gemv_calls):
    # The engine's default (switch None): the GEMV where this card's table names a config for the
    # shape, cuBLAS where it names None or nothing. Here only o_proj's shape (tiny llama: 64 x 64)
    # has a config; the qkv norm GEMV's shape is absent and down_proj's is None.
    ckpt = checkpoint("llama")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    monkeypatch.setitem(gemv_module.MEASURED, gemv_module.card_name(torch.device(DEVICE)), {})
    want, _ = run(make_engine(ckpt, monkeypatch, None, False), params)
    assert gemv_calls == {}  # no entry for the card: never launched
    table = {("none", 64, 64, bucket): gemv_module.GemvConfig(16, 32, 1) for bucket in (1, 2, 4, 8)}
    table |= {("silu_mul", 64, 128, bucket): None for bucket in (1, 2, 4, 8)}
    monkeypatch.setitem(gemv_module.MEASURED, gemv_module.card_name(torch.device(DEVICE)), table)
    engine = make_engine(ckpt, monkeypatch, None, False)
    assert all(layer.gemv_qkv == "measured" for layer in engine.runner.model.layers)
    got, _ = run(engine, params)
    assert got == want
    assert set(gemv_calls) == {"none"} and gemv_calls["none"] > 0


def _tp_rank_main(rank: int, port, results) -> None:
    """One rank of a 2-process gloo group: the dense MLP's GEMV path on the rank's shards
    (column-parallel gate/up rows, row-parallel down columns, then the all-reduce) against the
    unsharded unfused MLP."""
    import traceback

    import torch.nn.functional as F

    try:
        from pdserve.kernels.reference import rms_norm_ref, silu_and_mul_ref
        from pdserve.worker.config.model import ModelConfig
        from pdserve.worker.models.llama import MLP, RMSNorm
        from pdserve.worker.parallel.group import shutdown_tensor_parallel
        from pdserve.worker.parallel.shard import TPShard

        join_gloo_group(rank, port, results)
        torch.manual_seed(0)  # the same full weights on both ranks
        cfg = ModelConfig("LlamaForCausalLM", 101, 32, 48, 1, 4, 2, 8, 1e-5, 128, False, True, False, False, 1e4,
                          (), ())
        wg, wu, wd = torch.randn(48, 32), torch.randn(48, 32), torch.randn(32, 48)
        nw, x, res = 1 + 0.1 * torch.randn(32), torch.randn(3, 32), torch.randn(3, 32)
        mlp = MLP(cfg, TPShard(rank, 2, cfg))
        mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, wg, 0)
        mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, wu, 1)
        mlp.down_proj.weight_loader(mlp.down_proj.weight, wd)
        norm = RMSNorm(32, 1e-5)
        norm.weight.data.copy_(nw)
        with torch.no_grad():
            got, got_res = mlp.forward_gemv(x, norm, res)
        h, want_res = rms_norm_ref(x, nw, 1e-5, res)
        want = F.linear(silu_and_mul_ref(torch.cat([F.linear(h, wg), F.linear(h, wu)], -1)), wd)
        out = {"mlp": ((got - want).norm() / want.norm()).item(), "residual": torch.equal(got_res, want_res)}
        shutdown_tensor_parallel()
        results.put((rank, out))
    except BaseException:
        results.put((rank, traceback.format_exc()))


@pytest.mark.skipif(ON_GPU, reason="CPU gloo ranks with interpreted kernels; the GPU runs TP in tools/gpu/tp.sh")
def test_gemv_mlp_over_tp2_shards_equals_the_full_mlp():
    got = run_gloo_pair(_tp_rank_main)
    for rank in (0, 1):
        assert isinstance(got[rank], dict), got[rank]
        assert got[rank]["mlp"] < 1e-5 and got[rank]["residual"]  # fp32 relative: the sums differ in order only


def test_fp8_mlp_runs_its_norm_and_silu_mul_inside_the_fp8_gemv_at_one_row(monkeypatch):
    # An FP8 MLP on the kernel path (kernels/fp8_gemv.py under the interpreter): one-row steps take
    # the norm into gate_up's GEMV and SiLU·mul into down's (fp8_prologue_gemv), the same bits as
    # the norm and SiLU·mul kernels apart; other row counts, or the switch at 0, run them apart.
    from pdserve.kernels import fp8_gemv as fp8_module
    from pdserve.worker.config.model import ModelConfig
    from pdserve.worker.config.quantization import Fp8Config
    from pdserve.worker.models.llama import MLP, RMSNorm, triton_ops
    from pdserve.worker.parallel.shard import TPShard
    from pdserve.worker.quantization import fp8_linear

    cfg = ModelConfig("LlamaForCausalLM", 101, 64, 96, 1, 4, 2, 16, 1e-5, 128, False, False, False, False, 1e4,
                      (), (), quantization=Fp8Config("online", "channel", "token"))
    torch.manual_seed(0)
    ops = triton_ops()
    mlp = MLP(cfg, TPShard(0, 1, cfg), ops, "model.layers.0.mlp")
    mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, torch.randn(96, 64) * 0.1, 0)
    mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, torch.randn(96, 64) * 0.1, 1)
    mlp.down_proj.weight_loader(mlp.down_proj.weight, torch.randn(64, 96) * 0.1)
    mlp = mlp.to(DEVICE, torch.bfloat16)
    for linear in (mlp.gate_up_proj, mlp.down_proj):
        linear.quant.process_weights_after_loading(linear, torch.bfloat16, kernels=True)
    norm = RMSNorm(64, 1e-5, ops).to(DEVICE, torch.bfloat16)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(64))
    calls: list[str] = []
    real = fp8_module.fp8_prologue_gemv

    def spy(x, *args, **kw):
        calls.append(args[3] if len(args) > 3 else kw.get("prologue", "none"))
        return real(x, *args, **kw)

    monkeypatch.setattr(fp8_module, "fp8_prologue_gemv", spy)
    for rows in (1, 3):
        x, res = (torch.randn(rows, 64, device=DEVICE).bfloat16() for _ in range(2))
        with torch.no_grad():
            monkeypatch.setattr(fp8_linear, "FP8_GEMV_PROLOGUE_MAX_M", 0)
            apart, apart_res = mlp.forward_gemv(x, norm, res)
            assert "rms_norm" not in calls and "silu_mul" not in calls
            monkeypatch.setattr(fp8_linear, "FP8_GEMV_PROLOGUE_MAX_M", 1)
            fused, fused_res = mlp.forward_gemv(x, norm, res)
        assert torch.equal(fused_res, apart_res)
        if ON_GPU:  # the norm kernel sums the row's squares in one reduction, the GEMV K tile by K tile
            assert ((fused - apart).float().norm() / apart.float().norm()).item() < 1e-2
        else:
            assert torch.equal(fused, apart)
        assert (calls.count("rms_norm"), calls.count("silu_mul")) == ((1, 1) if rows == 1 else (0, 0))
        calls.clear()
