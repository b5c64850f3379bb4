"""DeepSeek-V3 on the GPU (issue 47): its published shapes and FP8 128x128 block weights.

Four subcommands (tools/gpu/deepseek.sh runs them in one device call):

  checkpoint  DeepSeek-V3's config.json as published (hidden 7168, 128 heads, MLA with q_lora_rank
              1536 and kv_lora_rank 512 + 64 rope dims, 256 routed experts of 2048 + 1 shared, top-8
              of 4 of 8 groups, YaRN x40, quant_method fp8 with weight_block_size [128, 128]) with
              --layers decoder layers, the first --dense-layers of them dense (3 of 61 in the model;
              fewer layers keep the call short: the table says how many), and a tokenizer; no weights:
              the engine makes random FP8 block weights on the GPU (--load-format dummy).
  engine      one engine process (eager, or with decode CUDA graphs; bf16 or fp8 latent cache):
              bs=1 decode ms/step at a --context-token prompt against the active-parameter roofline
              (and with --offline N, offline 1024/128 output tok/s of N prompts at once):
              the bytes one bs=1 step reads (every layer's MLA projections, the dense MLP or the router
              + 8 routed + 1 shared experts, the lm_head; FP8 weights 1 byte + their block scales, the
              router fp32 and lm_head bf16 as pdserve holds them; the latent cache of the context) over
              the same run's copy bandwidth. Two rooflines: the published weights, and what pdserve's
              decode reads (the key/value up-projections absorbed as bf16 [H, 128, 512] matrices
              instead of kv_b_proj's FP8 one, attention/mla.py). Appends a JSON line to --rows.
  report      the rows as a markdown table.
  kernel      kernels/mla_decode.py against reference.mla_decode_ref (128 heads, R 512, P 64, bf16
              queries) at 1k/8k/32k context and batch 1/8/64, bf16 and fp8 latent caches: us, bytes
              of latent read per second and their share of the same run's copy bandwidth, the
              kernel's max relative error against the reference; and (bf16, where it fits in
              EXPANDED_MAX_TOKENS) torch's scaled_dot_product_attention over the same context
              expanded into per-head keys (192) and values (128), what attention without the
              latent reads per token (80 KB instead of 1152 B).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

DEVICE = "cuda"  # the CPU plumbing test (tests/bench/test_deepseek_bench.py) swaps it and the two below


def _bandwidth() -> float:
    from pdserve.bench.kernels import copy_bandwidth

    return copy_bandwidth()


def _bench_us(fn, rep: int) -> float:
    from triton.testing import do_bench

    return 1e3 * do_bench(fn, warmup=max(3, rep // 10), rep=rep, return_mode="median")


# DeepSeek-V3's published config.json (auto_map and training-only keys left out).
V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def config(layers: int, dense_layers: int) -> dict:
    if not 0 <= dense_layers <= layers:
        raise SystemExit(f"--dense-layers must be in [0, --layers], got {dense_layers} of {layers}")
    return {**V3, "num_hidden_layers": layers, "first_k_dense_replace": dense_layers}


def checkpoint(args) -> int:
    from pdserve.bench.engine import save_tokenizer

    path = args.checkpoint
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config(args.layers, args.dense_layers), f, indent=2)
    save_tokenizer(path)
    print(f"checkpoint: DeepSeek-V3's config with {args.layers} layers ({args.dense_layers} dense), no weights, "
          f"in {path}", flush=True)
    return 0


def _fp8(rows: int, cols: int) -> float:
    """Bytes of one FP8 128x128-block matrix: its e4m3 values and fp32 block scales."""
    return rows * cols + 4 * -(-rows // 128) * -(-cols // 128)


def step_bytes(cfg: dict, context: int, kv_bytes: int, absorbed: bool) -> dict[str, float]:
    """Bytes a bs=1 decode step reads at `context` cached tokens, by part. `absorbed`: the key/value
    up-projections as pdserve's decode reads them (bf16 [H, N + V, R]) instead of kv_b_proj (FP8)."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v, r, qr = (cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"],
                            cfg["q_lora_rank"])
    layers, dense = cfg["num_hidden_layers"], cfg["first_k_dense_replace"]
    up = 2 * heads * (nope + v) * r if absorbed else _fp8(heads * (nope + v), r)
    attn = _fp8(qr, h) + _fp8(heads * (nope + rope), qr) + _fp8(r + rope, h) + up + _fp8(h, heads * v)
    experts = cfg["num_experts_per_tok"] + cfg["n_shared_experts"]
    moe = 4 * cfg["n_routed_experts"] * (h + 1) + experts * (2 * _fp8(cfg["moe_intermediate_size"], h)
                                                             + _fp8(h, cfg["moe_intermediate_size"]))
    mlp = 2 * _fp8(cfg["intermediate_size"], h) + _fp8(h, cfg["intermediate_size"])
    return {"attention": layers * attn, "mlp": dense * mlp + (layers - dense) * moe,
            "lm_head": 2 * cfg["vocab_size"] * h, "kv": layers * context * (r + rope) * kv_bytes}


def engine(args) -> int:
    from pdserve.bench.engine import decode_step_seconds
    from pdserve.worker.config.engine import EngineConfig
    from pdserve.worker.engine.llm_engine import LLMEngine

    with open(os.path.join(args.checkpoint, "config.json")) as f:
        cfg = json.load(f)
    bw = _bandwidth()
    t0 = time.perf_counter()
    eng = LLMEngine(EngineConfig(model=args.checkpoint, device=DEVICE, dtype="bfloat16",
                                 max_model_len=max(args.context, OFFLINE_IN) + 256,
                                 max_num_seqs=max(8, args.offline), enable_prefix_caching=False,
                                 load_format=args.load_format, enforce_eager=args.eager,
                                 kv_cache_dtype=args.kv_cache_dtype))
    kv_bytes = eng.kv_cache.tensor.element_size()
    row = {"layers": cfg["num_hidden_layers"], "dense_layers": cfg["first_k_dense_replace"],
           "kv_cache_dtype": args.kv_cache_dtype, "context": args.context, "load_format": args.load_format,
           "graphs": eng.runner.graphs is not None, "start_s": time.perf_counter() - t0, "copy_gbs": bw / 1e9,
           "card": _card(),
           "kv_bytes_per_token": eng.kv_cache.block_bytes // eng.runner.block_size}
    label = f"{'graphs' if row['graphs'] else 'eager'} kv={args.kv_cache_dtype}"
    print(f"{label}: started in {row['start_s']:.0f}s", flush=True)
    try:
        rng = random.Random(7)
        prompt = [rng.randrange(3, 1024) for _ in range(args.context)]  # the tokenizer's ids
        decode_step_seconds(eng, prompt, 8)  # warm-up
        row["decode_ms"] = 1e3 * statistics.median(decode_step_seconds(eng, prompt, args.decode_steps))
        for name, absorbed in (("published", False), ("pdserve", True)):
            parts = step_bytes(cfg, args.context, kv_bytes, absorbed)
            row[f"bytes_{name}"] = parts
            row[f"roofline_{name}_ms"] = 1e3 * sum(parts.values()) / bw
        print(f"{label}: bs=1 {row['decode_ms']:.2f} ms/step", flush=True)
        if args.profile:
            from pdserve.bench.engine import profile_decode

            row["gpu_ms"] = profile_decode(eng, prompt, args.profile, title=f"bs=1 decode ({label})")
        if args.offline:
            row.update(offline(eng, args.offline, rng))
            print(f"{label}: offline {row['offline']} {row['offline_tok_s']:.0f} output tok/s", flush=True)
    finally:
        eng.shutdown()
    with open(args.rows, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
    return 0


OFFLINE_IN, OFFLINE_OUT = 1024, 128


def offline(eng, num_prompts: int, rng: random.Random) -> dict:
    """Offline 1024-in/128-out: num_prompts random prompts at once, greedy, every one to 128
    tokens; output tokens / wall seconds, after an untimed short run of the same batch (the
    prefill and decode shapes compile there, not in the timed run)."""
    from pdserve.worker.request.sampling_params import SamplingParams

    prompts = [[rng.randrange(3, 1024) for _ in range(OFFLINE_IN)] for _ in range(num_prompts)]
    eng.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    outs = eng.generate(prompts, SamplingParams(max_tokens=OFFLINE_OUT, temperature=0.0, ignore_eos=True))
    seconds = time.perf_counter() - t0
    return {"offline": f"{num_prompts} x {OFFLINE_IN}/{OFFLINE_OUT}", "offline_s": seconds,
            "offline_tok_s": sum(len(o) for o in outs) / seconds}


def report(args) -> int:
    rows = [json.loads(line) for line in open(args.rows)] if os.path.exists(args.rows) else []
    if not rows:
        print("no engine rows")
        return 1
    r0 = rows[0]
    gb = {k: v / 1e9 for k, v in r0["bytes_published"].items()}
    lines = [f"DeepSeek-V3 shapes with {r0['layers']} of 61 decoder layers ({r0['dense_layers']} dense, the rest "
             f"MoE), random FP8 128x128-block weights made on the GPU (--load-format dummy), {r0['card']}, bs=1 "
             f"greedy decode after a {r0['context']}-token prompt, prefix caching off. Roofline: bytes one step "
             f"reads / the same run's copy bandwidth ({r0['copy_gbs']:.0f} GB/s); published weights: attention "
             f"{gb['attention']:.2f} GB, MLPs/experts {gb['mlp']:.2f} GB, lm_head {gb['lm_head']:.2f} GB, "
             f"latent KV {gb['kv'] * 1e3:.1f} MB (bf16); 'pdserve' counts the absorbed bf16 up-projections its "
             f"decode reads instead of kv_b_proj.", "",
             "| decode | KV cache | KV bytes/token | bs=1 ms/step | roofline ms (published) | % | "
             "roofline ms (pdserve) | % | offline output tok/s | start s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        pub, pd = r["roofline_published_ms"], r["roofline_pdserve_ms"]
        ms = r["decode_ms"]
        lines.append(f"| {'CUDA graphs' if r['graphs'] else 'eager'} | {r['kv_cache_dtype']} | "
                     f"{r['kv_bytes_per_token']} | {ms:.2f} | {pub:.2f} | {100 * pub / ms:.0f}% | "
                     f"{pd:.2f} | {100 * pd / ms:.0f}% | {_offline_cell(r)} | {r['start_s']:.0f} |")
    _write(args.out, lines)
    return 0


def _offline_cell(row: dict) -> str:
    return f"{row['offline_tok_s']:.0f} ({row['offline']})" if "offline_tok_s" in row else "-"


HEADS, LATENT, ROPE, BLOCK = 128, 512, 64, 16  # V3's MLA, the engine's default block size
NOPE, V_DIM = 128, 128
EXPANDED_MAX_TOKENS = 8 * 32768  # batch x context of the expanded baseline: 21 GB of K and V in bf16


def _card() -> str:
    return torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE


def kernel(args) -> int:
    from pdserve.kernels.reference import FP8_KV_DTYPE

    bw = _bandwidth()
    old = _old_decode(args.old) if args.old else None
    if args.sweep:
        return _sweep(args, bw)
    lines = [f"kernels/mla_decode.py vs reference.mla_decode_ref, {HEADS} heads, latent {LATENT} + rope {ROPE}, "
             f"bf16 queries, block size {BLOCK}, {_card()}, copy bandwidth {bw / 1e9:.0f} GB/s "
             f"(read + write of a 2 GiB copy). GB/s: latent bytes read / kernel time"
             + (f"; old: {os.path.basename(args.old)}, timed in the same run" if old else "") + ".", "",
             "| cache | context | batch | kernel us | GB/s | % of copy | old us | reference us | speed-up "
             "| max rel. error | expanded K/V (SDPA) us |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for dtype in (torch.bfloat16, FP8_KV_DTYPE):
        for ctx in args.contexts:
            for b in args.batches:
                row = _kernel_row(dtype, ctx, b, bw, old)  # its cache freed before the expanded baseline's K/V
                fits = dtype == torch.bfloat16 and b * ctx <= EXPANDED_MAX_TOKENS
                lines.append(f"{row} {_expanded_us(b, ctx):.0f} |" if fits else f"{row} - |")
                print(lines[-1], flush=True)
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
    _write(args.out, lines)
    return 0


def _old_decode(path: str):
    """mla_decode from another copy of kernels/mla_decode.py (the same-run baseline)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mla_decode_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.mla_decode


def _mla_inputs(dtype: torch.dtype, ctx: int, b: int):
    from pdserve.kernels.reference import FP8_KV_DTYPE

    torch.manual_seed(0)
    nblk = b * -(-ctx // BLOCK)
    cache = (torch.randn(nblk, BLOCK, 1, LATENT + ROPE, device=DEVICE) * 0.5).to(dtype)
    tables = torch.randperm(nblk, device=DEVICE, dtype=torch.int32).view(b, -1)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=DEVICE)
    q = torch.randn(b, HEADS, LATENT, device=DEVICE, dtype=torch.bfloat16) * 0.05
    q_pe = torch.randn(b, HEADS, ROPE, device=DEVICE, dtype=torch.bfloat16) * 0.05
    kv_scale = torch.ones(1, device=DEVICE) if dtype == FP8_KV_DTYPE else None
    return (q, q_pe, cache, tables, lens, 192**-0.5), {"kv_scale": kv_scale}


def _latent_gbs(dtype: torch.dtype, ctx: int, b: int, us: float) -> float:
    return b * ctx * (LATENT + ROPE) * torch.empty(0, dtype=dtype).element_size() / (us * 1e-6) / 1e9


def _kernel_row(dtype: torch.dtype, ctx: int, b: int, bw: float, old=None) -> str:
    from pdserve.kernels.mla_decode import mla_decode
    from pdserve.kernels.reference import mla_decode_ref

    args, kw = _mla_inputs(dtype, ctx, b)
    want = mla_decode_ref(*args, **kw).float()
    err = ((mla_decode(*args, **kw).float() - want).abs().max() / want.abs().max()).item()
    us = _bench_us(lambda: mla_decode(*args, **kw), 100)
    old_us = f"{_bench_us(lambda: old(*args, **kw), 100):.1f}" if old else "-"
    ref_us = _bench_us(lambda: mla_decode_ref(*args, **kw), 20)
    gbs = _latent_gbs(dtype, ctx, b, us)
    name = "bf16" if dtype == torch.bfloat16 else "fp8"
    return (f"| {name} | {ctx} | {b} | {us:.1f} | {gbs:.0f} | {100 * gbs * 1e9 / bw:.0f}% | {old_us} | {ref_us:.0f} | "
            f"{ref_us / us:.1f}x | {err:.1e} |")


# The sweep's shapes (cache, context, batch) and tiles: what picks mla_decode_config's default.
SWEEP_SHAPES = [("bf16", 1024, 1), ("bf16", 32768, 1), ("bf16", 8192, 8), ("bf16", 8192, 64), ("fp8", 8192, 8),
                ("fp8", 1024, 1)]
SWEEP_TILES = [(h, n, w, st) for h in (32, 64) for n in (16, 32, 64) for w, st in ((4, 2), (8, 1), (8, 2), (8, 3))]


def _sweep(args, bw: float) -> int:
    """Every SWEEP_TILES tile at SWEEP_SHAPES: us (and % of copy bandwidth) per tile, the best per shape."""
    from pdserve.kernels.mla_decode import MlaDecodeConfig, mla_decode
    from pdserve.kernels.reference import FP8_KV_DTYPE, mla_decode_ref

    dtypes = {"bf16": torch.bfloat16, "fp8": FP8_KV_DTYPE}
    lines = [f"kernels/mla_decode.py tiles (heads, tokens, warps, stages), {HEADS} heads, block size {BLOCK}, "
             f"{_card()}, copy bandwidth {bw / 1e9:.0f} GB/s: us (% of copy); '-': failed or wrong.", "",
             "| tile | " + " | ".join(f"{c} {ctx} b{b}" for c, ctx, b in SWEEP_SHAPES) + " |",
             "|---|" + "---:|" * len(SWEEP_SHAPES)]
    best: dict[int, tuple[float, tuple]] = {}
    inputs = {}
    for tile in SWEEP_TILES:
        cells = []
        for i, (c, ctx, b) in enumerate(SWEEP_SHAPES):
            if i not in inputs:
                a, kw = _mla_inputs(dtypes[c], ctx, b)
                inputs[i] = (a, kw, mla_decode_ref(*a, **kw).float())
            a, kw, want = inputs[i]
            cfg = MlaDecodeConfig(*tile)
            try:
                got = mla_decode(*a, **kw, config=cfg).float()
                if ((got - want).abs().max() / want.abs().max()).item() > 2e-2:
                    raise ValueError("wrong")
                us = _bench_us(lambda: mla_decode(*a, **kw, config=cfg), 30)
            except Exception as e:  # a tile past the shared memory, or a wrong answer: reported, not fatal
                print(f"tile {tile} at {c} {ctx} b{b}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                cells.append("-")
                continue
            cells.append(f"{us:.1f} ({100 * _latent_gbs(dtypes[c], ctx, b, us) * 1e9 / bw:.0f}%)")
            if i not in best or us < best[i][0]:
                best[i] = (us, tile)
        lines.append(f"| {tile} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    lines.append("")
    lines += [f"- best at {c} {ctx} b{b}: {best[i][1]} {best[i][0]:.1f} us" for i, (c, ctx, b) in
              enumerate(SWEEP_SHAPES) if i in best]
    _write(args.out, lines)
    return 0


def _expanded_us(b: int, ctx: int) -> float:
    """One query token per sequence over keys and values expanded per head (contiguous, as a
    non-latent cache would hand them to attention): the baseline MLA's decode saves."""
    import torch.nn.functional as F

    q = torch.randn(b, HEADS, 1, NOPE + ROPE, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(b, HEADS, ctx, NOPE + ROPE, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn(b, HEADS, ctx, V_DIM, device=DEVICE, dtype=torch.bfloat16)
    return _bench_us(lambda: F.scaled_dot_product_attention(q, k, v), 50)


def _write(path: str | None, lines: list[str]) -> None:
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if path:
        with open(path, "w") as f:
            f.write(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench deepseek", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("checkpoint")
    c.add_argument("--checkpoint", required=True)
    c.add_argument("--layers", type=int, default=4)
    c.add_argument("--dense-layers", type=int, default=1, help="the first N layers dense (the model: 3 of 61)")
    e = sub.add_parser("engine")
    e.add_argument("--checkpoint", required=True)
    e.add_argument("--eager", action="store_true", help="--enforce-eager: no decode CUDA graphs")
    e.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    e.add_argument("--load-format", choices=("auto", "dummy"), default="dummy")
    e.add_argument("--context", type=int, default=1024, help="prompt tokens before the timed decode steps")
    e.add_argument("--decode-steps", type=int, default=64)
    e.add_argument("--rows", required=True)
    e.add_argument("--profile", metavar="FILE", help="also profile bs=1 decode steps; the kernel table goes here")
    e.add_argument("--offline", type=int, default=0, metavar="N",
                   help=f"also offline {OFFLINE_IN}/{OFFLINE_OUT}: N prompts at once (max_num_seqs N)")
    r = sub.add_parser("report")
    r.add_argument("--rows", required=True)
    r.add_argument("--out")
    k = sub.add_parser("kernel")
    k.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768])
    k.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    k.add_argument("--old", metavar="PATH", help="another copy of kernels/mla_decode.py, timed beside (a baseline)")
    k.add_argument("--sweep", action="store_true", help="time SWEEP_TILES at SWEEP_SHAPES instead of the table")
    k.add_argument("--out")
    args = ap.parse_args(argv)
    if args.cmd in ("engine", "kernel") and DEVICE == "cuda" and not torch.cuda.is_available():
        print("bench deepseek engine/kernel need a CUDA GPU", file=sys.stderr)
        return 2
    return {"checkpoint": checkpoint, "engine": engine, "report": report, "kernel": kernel}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
