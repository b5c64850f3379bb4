"""FP8 weights on one GPU (not a test): bf16 vs FP8 per-channel vs FP8 block-128, same run, same card.

    python -m pdserve.bench.fp8 [--out fp8.md] [--smoke]      (tools/gpu/fp8.sh on the device)

Llama-3.1-8B-shaped random weights (transformers' initialisation, bf16), saved once; then three
engines, one after another, each alone on the card:
- bf16: the checkpoint as saved (the baseline);
- FP8 per-channel: the same checkpoint with --quantization fp8 (e4m3 weights with one scale per
  output row, dynamic per-token activations: torch._scaled_mm with row-wise scales);
- FP8 block-128: a checkpoint in the DeepSeek-V3 / Qwen3-FP8 format (`weight_block_size`
  [128, 128], `weight_scale_inv`) quantized here from the same weights (the Triton block GEMM).
Each: bs=1 decode ms/step at input 128 (CUDA graphs; median of 128 steps) with the weight bytes a
step reads over the same-run copy bandwidth, and offline 1024-in/128-out output tok/s.

First, each linear of a Llama-3.1-8B layer alone at M = 1, 16, 1024, 8192 (bf16 cuBLAS against
the FP8 paths with their activation quantization): where the step's time goes if a target is
missed.

Accuracy on a reduced model (the same widths, 2 layers: an fp32 reference of 32 layers would
not fit beside the engines): the first generated token's top-5 logprobs of each engine against
transformers in fp32 on the weights that engine multiplies (the bf16 weights for bf16, the FP8
weights dequantized for FP8), and against fp32 on the bf16 weights (what quantizing cost).
`--smoke` runs a tiny model on CPU (FP8 dequantized there) to check the script; it times nothing.
`--only fused`: the engines alone, each FP8 format twice, its activation quantization fused
into the RMSNorm / SiLU·mul before each linear off (PDSERVE_FP8_FUSED_QUANT=0) and on.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch

from pdserve.bench.model_shapes import MODELS

LLAMA_8B = MODELS["llama-3.1-8b"].hf
TINY = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VARIANTS = ("bf16", "FP8 per-channel", "FP8 block-128")
BLOCK_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
TOPK, CHECK_PROMPTS = 5, 16
# The engine's FP8 switches an A/B can flip, one engine per value ("off", "on"): the flag's name ->
# which variants it applies to (path, quantization, the block-128 checkpoint's path), the two
# labels, and the module attribute it sets with its value off / on (a str: the module's attribute of
# that name). Each is read on every call (CUDA graphs: at capture): an engine holds its value for life.
AB_SWITCHES = {
    "block_split": (lambda path, q, block: path == block, ("K unsplit", "K split"),
                    ("pdserve.kernels.fp8_block_gemm", "SPLIT_MAX_M"), (0, "SPLIT_ROWS")),
    "rowwise_triton": (lambda path, q, block: q == "fp8", ("W8A8 on _scaled_mm", "W8A8 on the Triton GEMM"),
                       ("pdserve.worker.quantization.fp8_linear", "TRITON_ROWWISE_MAX_M"), (0, 128)),
    "fp8_prologue": (lambda path, q, block: path == block or q == "fp8", ("norm apart", "norm in the GEMV"),
                     ("pdserve.worker.quantization.fp8_linear", "FP8_GEMV_PROLOGUE_MAX_M"), (0, 1)),
}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a device-to-device copy_ of 1 GiB (read + write counted once each)."""
    if device != "cuda":
        return 1e10
    a = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync(device)
    return 2 * a.numel() * a.element_size() * 10 / (time.perf_counter() - t0)


def write_bf16(hf: dict, layers: int, device: str, path: str) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pdserve.bench.engine import save_tokenizer

    cfg = LlamaConfig(**{**hf, "num_hidden_layers": layers}, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    save_tokenizer(path, min(hf["vocab_size"], 1024))
    del model
    free(device)
    return path


def is_linear(name: str) -> bool:
    parts = name.split(".")
    return parts[-1] == "weight" and len(parts) > 1 and parts[-2] in LINEARS


def write_block_fp8(src: str, dst: str, device: str) -> str:
    """src's linear weights quantized to e4m3 with one scale per 128x128 block, the rest as is."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pdserve.kernels.reference import quantize_fp8_blocks_ref

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    index = {}
    for f in sorted(os.listdir(src)):
        if not f.endswith(".safetensors"):
            continue
        out = {}
        with safe_open(os.path.join(src, f), framework="pt", device=device) as sf:
            for name in sf.keys():
                w = sf.get_tensor(name)
                if is_linear(name):
                    q, s = quantize_fp8_blocks_ref(w)
                    out[name], out[name[:-len("weight")] + "weight_scale_inv"] = q.cpu(), s.cpu()
                else:
                    out[name] = w.cpu()
        save_file(out, os.path.join(dst, f), metadata={"format": "pt"})
        index.update({n: f for n in out})
        del out
        free(device)
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": index}, fh)
    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as fh:
        cfg = json.load(fh)
    cfg["quantization_config"] = BLOCK_CONFIG
    with open(cfg_path, "w") as fh:
        json.dump(cfg, fh, indent=2)
    return dst


def start_engine(path: str, quantization: str | None, device: str, max_num_seqs: int):
    from pdserve.worker.config.engine import EngineConfig
    from pdserve.worker.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=path, device=device, dtype="bfloat16" if device == "cuda" else "float32",
                                  quantization=quantization, max_model_len=2048, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=16384, enable_prefix_caching=False,
                                  kv_cache_memory=None if device == "cuda" else 1 << 26))


def step_bytes(engine) -> int:
    """Bytes of weights one decode step reads: every parameter but the (untied) embedding table."""
    m = engine.runner.model
    total = sum(p.numel() * p.element_size() for p in m.parameters())
    total += sum(t.numel() * t.element_size() for mod in m.modules() for t in (getattr(mod, "w_scale", None),)
                 if isinstance(t, torch.Tensor))
    if m.lm_head is not None:
        total -= m.embed_tokens.weight.numel() * m.embed_tokens.weight.element_size()
    return total


def speed(variant: str, path: str, quantization: str | None, args, bw: float, block_scaled_mm: bool = True,
          fused_quant: bool = True, gemv_rows: str | None = None, switches: dict[str, bool] | None = None) -> dict:
    """`block_scaled_mm` False: block-scaled layers keep the Triton block GEMM at every M (the
    same-run baseline of cuBLASLt's block scaling). `fused_quant` False: FP8 linears quantize
    their own input (PDSERVE_FP8_FUSED_QUANT=0), not the norm / SiLU·mul before them.
    `gemv_rows`: how many rows FP8 linears take the W8A16 GEMV for: "16" (every layer to 16, none
    past), "64" (every layer to 64), "measured" (to 16, to 64 where the card's table holds a 64-row
    tile: the engine's rule); default: the engine's. `switches`: AB_SWITCHES' names -> on / off for
    this engine (block_split: the Triton W8A8 GEMM splits K up to fp8_block_gemm.SPLIT_ROWS rows where
    its rule says, or never; rowwise_triton: per-channel layers below 128 rows on the Triton GEMM, or
    torch._scaled_mm; fp8_prologue: one-row steps' norm / SiLU·mul inside the FP8 GEMV, or apart);
    one not named: the engine's default. `args.profile`: one more offline run under torch.profiler."""
    import importlib

    from pdserve.bench.engine import decode_step_seconds
    from pdserve.worker.quantization import fp8_linear
    from pdserve.worker.request.sampling_params import SamplingParams

    t0 = time.perf_counter()
    fp8_linear.SCALED_MM_BLOCK = block_scaled_mm  # read at load, per layer
    overrides = [(fp8_linear, "FUSED_ACT_QUANT", fused_quant)]
    if gemv_rows is not None:
        overrides += [(fp8_linear, "FP8_GEMV_MAX_M", 64 if gemv_rows == "64" else 16),
                      (fp8_linear, "FP8_GEMV_MEASURED_ROWS", gemv_rows == "measured")]
    for name, on in (switches or {}).items():
        _, _, (module, attr), values = AB_SWITCHES[name]
        mod = importlib.import_module(module)
        value = values[on]
        overrides.append((mod, attr, getattr(mod, value) if isinstance(value, str) else value))
    before = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in overrides]

    def restore():
        for mod, attr, value in before:
            setattr(mod, attr, value)

    for mod, attr, value in overrides:  # held for this engine's life
        setattr(mod, attr, value)
    try:
        engine = start_engine(path, quantization, args.device, max(8, args.num_prompts))
    except BaseException:
        restore()
        raise
    finally:
        fp8_linear.SCALED_MM_BLOCK = True
    res = {"variant": variant, "start_s": time.perf_counter() - t0, "graphs": engine.runner.graphs is not None,
           "scaled_mm_layers": sum(bool(getattr(m, "scaled_mm_block", False)) for m in engine.runner.model.modules())}
    print(f"{variant}: engine started in {res['start_s']:.0f}s", flush=True)
    try:
        rng = random.Random(7)
        vocab = engine.model_config.vocab_size
        prompt = [rng.randrange(3, vocab) for _ in range(args.decode_input)]
        decode_step_seconds(engine, prompt, 8)  # warm-up
        res["decode_ms"] = 1e3 * statistics.median(decode_step_seconds(engine, prompt, args.decode_steps))
        res["bytes"] = step_bytes(engine)
        res["roof_ms"] = 1e3 * res["bytes"] / bw
        print(f"{variant}: bs=1 decode {res['decode_ms']:.3f} ms/step", flush=True)
        if args.num_prompts:
            prompts = [[rng.randrange(3, vocab) for _ in range(args.offline_input)] for _ in range(args.num_prompts)]
            params = SamplingParams(max_tokens=args.offline_output, temperature=0.0, ignore_eos=True)
            engine.generate(prompts, params)  # warm-up: the same batch mix compiles the same kernels
            sync(args.device)
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params)
            res["offline_tok_s"] = sum(len(o) for o in outs) / (time.perf_counter() - t0)
            print(f"{variant}: offline {res['offline_tok_s']:.0f} tok/s", flush=True)
            if getattr(args, "profile", False) and args.device == "cuda":
                from pdserve.bench.kernel_profile import profile_kernels

                res["kernels"] = profile_kernels(lambda: engine.generate(prompts, params))
    finally:
        restore()
        engine.shutdown()
        del engine
        free(args.device)
    return res


def expand_ab(variants: list, values: list[str] | None, applies, labels: dict, keyed: tuple) -> dict:
    """Each variant `applies(path, quantization)` picks, once per value ("off" / "on"), in place, its
    name suffixed by the value's label (the `keyed` dicts' entries follow the names); -> {new name:
    value == "on"}."""
    chosen: dict[str, bool] = {}
    if not values:
        return chosen
    expanded = [variants[0]]
    for name, path, quant, *rest in variants[1:]:
        if not applies(path, quant):
            expanded.append((name, path, quant, *rest))
            continue
        for v in values:
            label = f"{name}, {labels[v]}"
            chosen[label] = v == "on"
            for d in keyed:
                if name in d:
                    d[label] = d[name]
            expanded.append((label, path, quant, *rest))
    variants[:] = expanded
    return chosen


def first_token_top(path: str, quantization: str | None, prompts, device: str) -> list[dict[int, float]]:
    from pdserve.worker.request.sampling_params import SamplingParams

    engine = start_engine(path, quantization, device, 16)
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=TOPK)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        tops: dict[str, dict[int, float]] = {}
        while engine.has_work():
            for o in engine.step():
                if o.logprobs:
                    tops.setdefault(o.request_id, dict(o.logprobs[0].top))
        return [tops[str(i)] for i in range(len(prompts))]
    finally:
        engine.shutdown()
        del engine
        free(device)


def fp32_references(path: str, prompts, device: str) -> dict[str, list[torch.Tensor]]:
    """transformers in fp32: next-token logprobs on the bf16 weights, and on each FP8 variant's
    dequantized weights (quantized here exactly as pdserve and write_block_fp8 quantize them)."""
    from transformers import AutoModelForCausalLM

    from pdserve.kernels.reference import dequantize_fp8_ref, quantize_fp8_blocks_ref, quantize_fp8_rows_ref

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    originals = {n: p.detach().clone() for n, p in model.named_parameters() if is_linear(n)}

    def logprobs():
        out = []
        with torch.no_grad():
            for p in prompts:
                logits = model(torch.tensor([p], device=device)).logits[0, -1].float()
                out.append(torch.log_softmax(logits, -1).cpu())
        return out

    def dequant_ch(w):
        return dequantize_fp8_ref(*quantize_fp8_rows_ref(w.bfloat16()))

    def dequant_block(w):
        q, s = quantize_fp8_blocks_ref(w.bfloat16())
        return q.float() * s.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]]

    refs = {"bf16": logprobs()}
    params = dict(model.named_parameters())
    for variant, fn in (("FP8 per-channel", dequant_ch), ("FP8 block-128", dequant_block)):
        with torch.no_grad():
            for n, w in originals.items():
                params[n].copy_(fn(w))
        refs[variant] = logprobs()
    del model, originals, params
    free(device)
    return refs


GEMM_SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
               "down_proj": (4096, 14336)}  # Llama-3.1-8B's linears at TP=1: (N, K)


BLOCK_SWEEP = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
               for bm, bn, w, st in ((64, 128, 4, 3), (128, 128, 8, 3), (128, 128, 4, 4), (64, 256, 8, 3),
                                     (128, 256, 8, 3), (64, 64, 4, 4))]


def _cfg_name(c: dict) -> str:
    return " ".join(f"{k.replace('BLOCK_', '').replace('num_', '')[:1].lower()}{v}" for k, v in c.items())



def _linear_weights(n: int, k: int, device: str):
    """A random bf16 linear [n, k] and its FP8 per-channel and block-128 forms (reference quantizers)."""
    from pdserve.kernels.reference import quantize_fp8_blocks_ref, quantize_fp8_rows_ref

    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    w_ch, s_ch = quantize_fp8_rows_ref(w)
    w_bl, s_bl = quantize_fp8_blocks_ref(w)
    return w, w_ch, s_ch.reshape(1, -1).contiguous(), w_bl, s_bl

def gemm_rows(
    device: str, ms: tuple[int, ...], sweep: list | None = None
) -> list[tuple[str, int, float, float, float]]:
    """Each linear of a Llama-3.1-8B layer alone: bf16 F.linear (cuBLAS) against the FP8 paths
    the engine runs: (shape, M, bf16 us, per-channel us, block-128 us). M <= 16: fp8_gemv (FP8
    weights, unquantized activations); larger M: activation quantization included, then
    torch._scaled_mm (per-channel) or fp8_block_gemm. M <= 16: GPU time in a CUDA graph over
    copies of the weight past L2 (as a decode step); larger M: do_bench's median, eager. `sweep`: also time
    other tiles, (shape, M, tiles, us) rows."""
    import torch.nn.functional as F
    from triton.testing import do_bench

    from pdserve.bench.fp8_gemv_tune import graph_us, w8a8_linear
    from pdserve.kernels.fp8_block_gemm import fp8_block_gemm
    from pdserve.kernels.fp8_gemv import fp8_gemv
    from pdserve.kernels.fp8_quant import quantize_fp8
    from pdserve.kernels.reference import quantize_fp8_blocks_ref, quantize_fp8_rows_ref
    from pdserve.worker.quantization.fp8_linear import FP8_GEMV_MAX_M  # where the engine leaves the GEMV

    rows = []
    for name, (n, k) in GEMM_SHAPES.items():
        w, w_ch, s_ch, w_bl, s_bl = _linear_weights(n, k, device)
        copies = [(w, w_ch, s_ch, w_bl, s_bl)]
        while len(copies) * n * k < 256 * 2**20:  # enough distinct weights that L2 cannot hold them
            wc = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
            qc, sc = quantize_fp8_rows_ref(wc)
            copies.append((wc, qc, sc.reshape(1, -1).contiguous(), *quantize_fp8_blocks_ref(wc)))
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)

            def channel():
                return fp8_gemv(x, w_ch, s_ch) if m <= FP8_GEMV_MAX_M else w8a8_linear(x, w_ch, s_ch, None)

            def block():
                return fp8_gemv(x, w_bl, s_bl, 128) if m <= FP8_GEMV_MAX_M else w8a8_linear(x, w_bl, s_bl, 128)

            if m <= FP8_GEMV_MAX_M:  # decode sizes: GPU time in a CUDA graph, weights past L2 (eager is host-bound)
                t = [graph_us(make, len(copies)) for make in (
                    lambda i: lambda: F.linear(x, copies[i][0]),
                    lambda i: lambda: fp8_gemv(x, copies[i][1], copies[i][2]),
                    lambda i: lambda: fp8_gemv(x, copies[i][3], copies[i][4], 128))]
            else:
                t = [1e3 * do_bench(f, warmup=10, rep=50, return_mode="median")
                     for f in (lambda: F.linear(x, w), channel, block)]
            rows.append((f"{name} {n}x{k}", m, *t))
            if sweep is not None and m > FP8_GEMV_MAX_M:  # block-GEMM tiles (fp8_gemv_tune sweeps the GEMV's)
                xq, xs = quantize_fp8(x, 128)
                cands = [("block " + _cfg_name(c),
                          lambda c=c: fp8_block_gemm(xq, xs, w_bl, s_bl, 128, torch.bfloat16, tiles=c))
                         for c in BLOCK_SWEEP]
                for label, f in cands:
                    try:
                        sweep.append((f"{name} {n}x{k}", m, label, 1e3 * do_bench(f, warmup=5, rep=25,
                                                                                  return_mode="median")))
                    except Exception as e:  # a tile the card cannot run: said, skipped
                        sweep.append((f"{name} {n}x{k}", m, f"{label} FAILED {type(e).__name__}", float("nan")))
        del w, w_ch, w_bl, copies
        free(device)
    return rows


BLOCKWISE_MS = (64, 128, 256, 1024, 4096)
BLOCKWISE_COLS = ("bf16", "ch total", "ch quant", "ch GEMM", "triton total", "sm total", "sm quant", "sm GEMM")


def blockwise_rows(device: str, ms: tuple[int, ...] = BLOCKWISE_MS) -> tuple[list, list[str]]:
    """Each Llama-3.1-8B linear alone at prefill sizes (eager, do_bench medians, us): bf16
    F.linear (cuBLAS); per-channel (per-token quantization + _scaled_mm row-wise, and each part
    alone); block-128 on the Triton GEMM (quantization included); block-128 on torch's scaled_mm
    block scaling (cuBLASLt 1x128 x 128x128: total, quantization alone, GEMM alone). Block
    columns are NaN when the probe says the card cannot run it. Returns (rows, notes)."""
    import torch.nn.functional as F
    from triton.testing import do_bench

    from pdserve.kernels import fp8_scaled_mm
    from pdserve.kernels.fp8_block_gemm import fp8_block_gemm
    from pdserve.kernels.fp8_quant import quantize_fp8
    from pdserve.kernels.fp8_scaled_mm import block_linear, probe_blockwise, scaled_mm_blockwise, weight_scale_operand
    from pdserve.kernels.reference import fp8_block_gemm_ref

    ok, detail = probe_blockwise(torch.device(device), torch.bfloat16)
    notes = [f"torch scaled_mm block scaling (BlockWise1x128 x BlockWise128x128) on this card: "
             f"{'supported' if ok else 'UNSUPPORTED'} ({detail})"]
    print(notes[0], flush=True)
    nan = float("nan")
    rows = []
    for name, (n, k) in GEMM_SHAPES.items():
        w, w_ch, s_ch, w_bl, s_bl = _linear_weights(n, k, device)
        s_bl = s_bl.contiguous()
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            xq_ch, xs_ch = quantize_fp8(x)
            xq_bl, xs_bl = quantize_fp8(x, 128, mn_major_scales=True)
            xq_tr, xs_tr = quantize_fp8(x, 128)

            def ch_total():
                xq, xs = quantize_fp8(x)
                return torch._scaled_mm(xq, w_ch.t(), scale_a=xs, scale_b=s_ch, out_dtype=torch.bfloat16)

            def triton_total():
                xq, xs = quantize_fp8(x, 128)
                return fp8_block_gemm(xq, xs, w_bl, s_bl, 128, torch.bfloat16)

            def sm_total():  # what the engine's block layers run from SCALED_MM_BLOCK_MIN_M rows
                return block_linear(x, w_bl, s_bl, torch.bfloat16)

            fns = [lambda: F.linear(x, w), ch_total, lambda: quantize_fp8(x),
                   lambda: torch._scaled_mm(xq_ch, w_ch.t(), scale_a=xs_ch, scale_b=s_ch, out_dtype=torch.bfloat16),
                   triton_total]
            fns += [sm_total, lambda: quantize_fp8(x, 128, mn_major_scales=True, pad_rows_to=fp8_scaled_mm.PAD_M),
                    lambda: scaled_mm_blockwise(xq_bl, xs_bl, w_bl, weight_scale_operand(s_bl), torch.bfloat16)] \
                if ok else []
            t = [1e3 * do_bench(f, warmup=10, rep=40, return_mode="median") for f in fns]
            t += [nan] * (len(BLOCKWISE_COLS) - len(t))
            err = nan
            if ok and m == ms[0]:  # the same product as the Triton GEMM's reference, on this card
                ref = fp8_block_gemm_ref(xq_tr, xs_tr, w_bl, s_bl, 128, torch.float64)
                out = sm_total().double()
                assert out.shape == ref.shape
                err = ((out - ref).norm() / ref.norm()).item()
            rows.append((f"{name} {n}x{k}", m, *t, err))
        del w, w_ch, w_bl
        free(device)
    return rows, notes


def blockwise_table(rows: list) -> list[str]:
    lines = ["Each Llama-3.1-8B linear alone at prefill sizes (eager, do_bench medians, us). ch = FP8 per-channel "
             "(per-token quantization + `_scaled_mm` row-wise); triton = FP8 block-128 on the Triton block GEMM "
             "(1x128 quantization included); sm = FP8 block-128 on torch `scaled_mm` BlockWise1x128 x "
             "BlockWise128x128 (cuBLASLt). x = bf16 time / that time.", "",
             "| linear (N x K) | M | bf16 | ch total | x | ch quant | ch GEMM | triton total | x | sm total | x "
             "| sm quant | sm GEMM | sm rel. err |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    def us(v: float) -> str:
        return "n/a" if v != v else f"{v:.1f}"

    def x(b: float, v: float) -> str:
        return "n/a" if v != v else f"{b / v:.2f}x"

    for name, m, b, cht, chq, chg, tr, smt, smq, smg, err in rows:
        lines.append(f"| {name} | {m} | {us(b)} | {us(cht)} | {x(b, cht)} | {us(chq)} | {us(chg)} | {us(tr)} | "
                     f"{x(b, tr)} | {us(smt)} | {x(b, smt)} | {us(smq)} | {us(smg)} | "
                     f"{'' if err != err else f'{err:.1e}'} |")
    return lines


def error(tops: list[dict[int, float]], ref: list[torch.Tensor]) -> tuple[float, int]:
    """max |logprob - fp32| over each prompt's top-5, and how often the top-1 is fp32's argmax."""
    err = max(abs(lp - ref[i][t].item()) for i, top in enumerate(tops) for t, lp in top.items())
    same = sum(max(top, key=top.get) == int(ref[i].argmax()) for i, top in enumerate(tops))
    return err, same


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench fp8", description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the markdown table here")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script, times nothing")
    ap.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temp dir, removed)")
    ap.add_argument("--num-prompts", type=int, default=64, help="offline prompts (0: no offline run)")
    ap.add_argument("--gemv-configs", help="fp8_gemv tiles measured by bench/fp8_gemv_tune.py (JSON); "
                    "default: kernels/fp8_gemv_configs.py")
    ap.add_argument("--against-committed", action="store_true",
                    help="--gemv-configs laid over kernels/fp8_gemv_configs.py's table (a sweep of some shapes or "
                         "formats); with --only tiles each FP8 format's engine runs with the committed table, then "
                         "with that (judged against the tiles it would replace)")
    ap.add_argument("--gemv-rows", nargs="+", choices=("16", "measured", "64"),
                    help="with speed or tiles: each FP8 engine once per value: the W8A16 GEMV to 16 rows then the "
                         "W8A8 GEMMs (every layer), to 64 rows (every layer), or to 16 and to 64 where the card's "
                         "table holds a 64-row tile (measured: the engine's rule)")
    ap.add_argument("--block-split", nargs="+", choices=("off", "on"),
                    help="with speed: each FP8 block-128 engine once per value: the Triton block GEMM with K never "
                         "split, then split where its rule says (fp8_block_gemm._split_k; the default)")
    ap.add_argument("--rowwise-triton", nargs="+", choices=("off", "on"),
                    help="with speed: each FP8 per-channel engine once per value: W8A8 below 128 rows on "
                         "torch._scaled_mm, then on the Triton GEMM (fp8_linear.TRITON_ROWWISE_MAX_M)")
    ap.add_argument("--fp8-prologue", nargs="+", choices=("off", "on"),
                    help="with speed: each FP8 engine once per value: one-row steps with the RMSNorm / SiLU·mul "
                         "apart, then inside the FP8 GEMV (fp8_linear.FP8_GEMV_PROLOGUE_MAX_M)")
    ap.add_argument("--profile", action="store_true",
                    help="with speed: one more offline run per engine under torch.profiler: its GPU time per kernel "
                         "and per kernel group")
    ap.add_argument("--only", nargs="*", choices=("gemm", "speed", "accuracy", "blockwise", "fused", "tiles"),
                    default=["gemm", "speed", "accuracy"],
                    help="blockwise: the prefill-size GEMM table of torch scaled_mm block scaling against bf16, "
                         "per-channel and the Triton block GEMM; with speed it also adds an engine row for "
                         "block-128 on the Triton GEMM alone (tools/gpu/fp8.sh blockwise runs both). "
                         "fused: the engines only, each FP8 format with the activation quantization fused "
                         "into the norm / SiLU·mul off, then on (tools/gpu/fp8.sh fused). "
                         "tiles: the engines only, each FP8 format with fp8_gemv's rule tiles, then the "
                         "--gemv-configs table without its one-launch sums and early weight loads, then as given "
                         "(tools/gpu/fp8.sh tiles)")
    args = ap.parse_args(argv)
    args.device = "cpu" if args.smoke else "cuda"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("pdserve bench fp8: needs a CUDA GPU (none visible); --smoke runs a CPU check", file=sys.stderr)
        return 2
    from pdserve.kernels.fp8_gemv import measured_batch_rows, use_configs
    from pdserve.kernels.fp8_gemv_configs import CONFIGS

    measured = None
    committed = {card: dict(table) for card, table in CONFIGS.items()}
    if args.gemv_configs:
        with open(args.gemv_configs) as f:
            measured = json.load(f)
        if args.against_committed:  # a sweep of some shapes or formats: its tiles over the committed ones
            measured = {card: {**committed.get(card, {}), **table} for card, table in measured.items()}
        use_configs(measured)
    elif "tiles" in args.only:
        ap.error("--only tiles compares fp8_gemv tables: it needs --gemv-configs")
    hf = TINY if args.smoke else LLAMA_8B
    args.decode_input, args.decode_steps = (16, 8) if args.smoke else (128, 128)
    args.offline_input, args.offline_output = (64, 8) if args.smoke else (1024, 128)
    if args.smoke:
        args.num_prompts = min(args.num_prompts, 4)
    work = args.workdir or tempfile.mkdtemp(prefix="pdserve-bench-fp8-")
    os.makedirs(work, exist_ok=True)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (smoke run)"
    import triton

    bw = copy_bandwidth(args.device)
    header = (f"{name} · torch {torch.__version__} · triton {triton.__version__} · {datetime.date.today()} · "
              f"measured copy bandwidth {bw / 1e9:.0f} GB/s")
    print(header, flush=True)
    notes, speed_rows, acc_rows, gemms, sweep, blockwise = [], [], [], [], [], []

    def report() -> str:
        lines = [header, ""]
        if speed_rows:
            base = speed_rows[0]
            lines += [f"Llama-3.1-8B shape ({hf['num_hidden_layers']} layers), random weights; bs=1 decode at input "
                      f"{args.decode_input} (CUDA graphs, median of {args.decode_steps} steps); offline "
                      f"{args.num_prompts} prompts x {args.offline_input} in / {args.offline_output} out.", "",
                      "| weights | GB read / step | bs=1 ms/step | % of copy BW | vs bf16 | offline tok/s | vs bf16 |",
                      "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
            for r in speed_rows:
                off, base_off = r.get("offline_tok_s"), base.get("offline_tok_s")
                off_s = "" if off is None else f"{off:.0f}"
                off_x = "" if off is None or not base_off else f"{off / base_off:.2f}x"
                lines.append(
                    f"| {r['variant']} | {r['bytes'] / 1e9:.2f} | {r['decode_ms']:.3f} | "
                    f"{100 * r['roof_ms'] / r['decode_ms']:.0f}% | {base['decode_ms'] / r['decode_ms']:.2f}x | "
                    f"{off_s} | {off_x} |")
            by_name = {r["variant"]: r for r in speed_rows}
            pairs = [(name.removesuffix(", fused quant on"), by_name[name.replace(" on", " off")], r)
                     for name, r in by_name.items()
                     if name.endswith(", fused quant on") and name.replace(" on", " off") in by_name]
            if pairs:
                lines += ["", "Activation quantization fused into the norm / SiLU·mul: speed-up of on over off "
                              "(same weights, same run; > 1: fused faster):", "",
                          "| weights | bs=1 decode | offline tok/s |", "| --- | ---: | ---: |"]
                for name, off, on in pairs:
                    ratio = (f"{on['offline_tok_s'] / off['offline_tok_s']:.3f}x"
                             if on.get("offline_tok_s") and off.get("offline_tok_s") else "")
                    lines.append(f"| {name} | {off['decode_ms'] / on['decode_ms']:.3f}x | {ratio} |")
        for r in speed_rows:
            if r.get("kernels"):
                from pdserve.bench.kernel_profile import kernel_lines

                lines += ["", f"{r['variant']}, offline under torch.profiler:", ""]
                lines += kernel_lines(r["kernels"], 8)
        if acc_rows:
            lines += ["", f"First generated token, top-{TOPK} logprobs, {CHECK_PROMPTS} prompts, reduced model "
                          f"(2 layers, same widths): max |logprob - fp32|", "",
                      "| weights | vs fp32 of the same (dequantized) weights | top-1 = its argmax | "
                      "vs fp32 of the bf16 weights | top-1 = its argmax |",
                      "| --- | ---: | ---: | ---: | ---: |"]
            lines += [f"| {v} | {e1:.4f} | {s1}/{CHECK_PROMPTS} | {e2:.4f} | {s2}/{CHECK_PROMPTS} |"
                      for v, e1, s1, e2, s2 in acc_rows]
        if gemms:
            lines += ["", "Each linear of a Llama-3.1-8B layer alone (M <= 16: GPU time in a CUDA graph, weights "
                          "rotated past L2, FP8 = fp8_gemv with activations unquantized; larger M: eager, FP8 "
                          "activation quantization included; do_bench medians, us):", "",
                      "| linear (N x K) | M | bf16 | FP8 per-channel | vs bf16 | FP8 block-128 | vs bf16 |",
                      "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
            lines += [f"| {name} | {m} | {b:.1f} | {c:.1f} | {b / c:.2f}x | {k:.1f} | {b / k:.2f}x |"
                      for name, m, b, c, k in gemms]
        if blockwise:
            lines += [""] + blockwise_table(blockwise)
        if sweep:
            lines += ["", "Tile sweep (us; the engine's choice is the row above's):", "",
                      "| linear | M | tiles | us |", "| --- | ---: | --- | ---: |"]
            lines += [f"| {name} | {m} | {label} | {us:.1f} |" for name, m, label, us in sweep]
        lines += [""] + [f"- {n}" for n in notes]
        text = "\n".join(lines)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        return text

    try:
        if "gemm" in args.only and args.device == "cuda":
            try:
                gemms.extend(gemm_rows(args.device, (1, 16, 1024, 8192), sweep))
            except Exception as e:  # the engines' rows still come
                import traceback

                traceback.print_exc()
                notes.append(f"GEMM table: FAILED: {type(e).__name__}: {e}")
            print(report(), flush=True)
        if "blockwise" in args.only and args.device == "cuda":
            try:
                rows, bw_notes = blockwise_rows(args.device)
                blockwise.extend(rows)
                notes.extend(bw_notes)
            except Exception as e:  # the engines' rows still come
                import traceback

                traceback.print_exc()
                notes.append(f"blockwise GEMM table: FAILED: {type(e).__name__}: {e}")
            print(report(), flush=True)
        if {"speed", "fused", "tiles"} & set(args.only):
            t0 = time.perf_counter()
            bf16 = write_bf16(hf, hf["num_hidden_layers"], args.device, os.path.join(work, "bf16"))
            t1 = time.perf_counter()
            block = write_block_fp8(bf16, os.path.join(work, "block"), args.device)
            notes.append(f"checkpoints: bf16 written in {t1 - t0:.0f}s, block-128 FP8 quantized and written in "
                         f"{time.perf_counter() - t1:.0f}s")
            variants = [("bf16", bf16, None, True, True), ("FP8 per-channel", bf16, "fp8", True, True),
                        ("FP8 block-128", block, None, True, True)]
            if "blockwise" in args.only:  # the same checkpoint with the Triton GEMM at every M: same-run baseline
                variants = [variants[0], variants[2], ("FP8 block-128 (Triton GEMM only)", block, None, False, True),
                            variants[1]]
            if "fused" in args.only:  # each FP8 format with the fused activation quantization off, then on
                variants = [variants[0]] + [(f"{name}, fused quant {'on' if on else 'off'}", p, q, sm, on)
                                            for name, p, q, sm, _ in variants[1:] for on in (False, True)]
            tables = {}  # variant -> the fp8_gemv table its engine runs with
            if "tiles" in args.only:
                if args.against_committed:  # the committed table, then the new one laid over it
                    labelled = (("committed tiles", committed), ("measured tiles", measured))
                else:  # each FP8 format: the rule's tiles, the table without its options, as given
                    plain = {card: {key: {o: v for o, v in cfg.items() if o not in ("REDUCE_IN_KERNEL", "EARLY_W")}
                                    for key, cfg in table.items()} for card, table in measured.items()}
                    labelled = (("rule tiles", {}), ("measured tiles, no one-launch sum, no early weight load", plain),
                                ("measured tiles", measured))
                tables = {f"{name}, {label}": t for name, *_ in variants[1:] for label, t in labelled}
                variants = [variants[0]] + [(f"{name}, {label}", p, q, sm, fq) for name, p, q, sm, fq in variants[1:]
                                            for label, _ in labelled]
            gemv_rows = {}  # variant -> the GEMV's rows its engine runs with
            if args.gemv_rows:
                label = {"16": "GEMV to 16 rows", "64": "GEMV to 64 rows",
                         "measured": "GEMV to 64 rows where the table has a tile"}
                gemv_rows = {f"{name}, {label[r]}": r for name, *_ in variants[1:] for r in args.gemv_rows}
                tables = {f"{name}, {label[r]}": t for name, t in tables.items() for r in args.gemv_rows}
                variants = [variants[0]] + [(f"{name}, {label[r]}", *rest) for name, *rest in variants[1:]
                                            for r in args.gemv_rows]
            # Per format, an A/B of each switch asked for: variant -> {switch: on}.
            switches: dict[str, dict[str, bool]] = {}
            for name, (applies, labels, _, _) in AB_SWITCHES.items():
                chosen = expand_ab(variants, getattr(args, name), lambda path, q: applies(path, q, block),
                                   {"off": labels[0], "on": labels[1]}, (tables, gemv_rows, switches))
                for variant, on in chosen.items():
                    switches[variant] = {**switches.get(variant, {}), name: on}
            for variant, path, quant, block_sm, fused_quant in variants:
                if variant in tables:
                    use_configs(tables[variant])
                if gemv_rows.get(variant) == "measured" and "16" in args.gemv_rows and not any(
                        measured_batch_rows(torch.device(args.device), n, k, path == block)
                        for n, k in GEMM_SHAPES.values()):
                    notes.append(f"{variant}: not run, the engine of 16 rows: no 64-row tile for this format on "
                                 "this card")
                    continue
                try:
                    r = speed(variant, path, quant, args, bw, block_sm, fused_quant, gemv_rows.get(variant),
                              switches.get(variant))
                    speed_rows.append(r)
                    notes.append(f"{variant}: engine start {r['start_s']:.0f}s (CUDA graphs: {r['graphs']}; "
                                 f"layers on cuBLASLt block scaling: {r['scaled_mm_layers']})")
                except Exception as e:  # one variant failing must not hide the others' numbers
                    import traceback

                    traceback.print_exc()
                    notes.append(f"{variant}: FAILED: {type(e).__name__}: {e}")
                print(report(), flush=True)
            shutil.rmtree(os.path.join(work, "bf16"), ignore_errors=True)
            shutil.rmtree(os.path.join(work, "block"), ignore_errors=True)
        if "accuracy" in args.only:
            small = write_bf16(hf, 2, args.device, os.path.join(work, "bf16-2l"))
            small_block = write_block_fp8(small, os.path.join(work, "block-2l"), args.device)
            rng = random.Random(11)
            prompts = [[rng.randrange(3, hf["vocab_size"]) for _ in range(24 + 8 * i)] for i in range(CHECK_PROMPTS)]
            tops = {v: first_token_top(p, q, prompts, args.device)
                    for v, p, q in (("bf16", small, None), ("FP8 per-channel", small, "fp8"),
                                    ("FP8 block-128", small_block, None))}
            refs = fp32_references(small, prompts, args.device)
            for v in VARIANTS:
                e1, s1 = error(tops[v], refs[v])
                e2, s2 = error(tops[v], refs["bf16"])
                acc_rows.append((v, e1, s1, e2, s2))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
