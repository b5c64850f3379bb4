"""Mixture of experts on the GPU: Qwen3-30B-A3B-shaped random bf16 weights (issue 27), gpt-oss's MXFP4 experts.

Three subcommands (tools/gpu/moe.sh runs them in one device call):

  kernel      the fused MoE kernel (kernels/fused_moe.py) against a per-expert loop of torch
              matmuls (cuBLAS; transformers' structure, reference.fused_moe_loop_ref) at 1, 8, 64
              and 512 tokens, one layer's experts (E=128, k=8, H=2048, I=768); the default tile
              config and the best of a small sweep; the kernel captured in a CUDA graph at decode
              sizes; bytes of the experts actually hit / time against the same-run copy bandwidth.
  decode      decode batch sizes (1-16 tokens) inside CUDA graphs, before/after in one run: the
              sorted path (align + grouped GEMMs + sum over k; what ran before the decode path)
              against the decode path (two GEMV launches, the sum inside the down pass) with its
              default tiles and the best of a small sweep; the routing kernel with 4 warps (the
              old rule) and 1; a whole MoE layer after the router GEMV (routing + experts) old vs
              new. Each graph holds 4 layers with their own weights (4 x 1.2 GB: the experts hit
              are read from DRAM, not L2); times are per layer.
  fp8         FP8 expert weights (W8A16, kernels/fused_moe.py's FP8 path) against bf16 ones: the
              model's op on one layer's experts at 1, 8, 64 and 512 tokens (decode path up to
              DECODE_MAX_TOKENS, sorted above), default tiles, 128x128 block scales and per-channel
              scales; error of each against the loop on the dequantized weights; expert bytes hit / time.
  mxfp4       gpt-oss's experts (biases + clamped SwiGLU) with MXFP4 weights (W4A16, the kernels decode
              the nibbles) against the same experts in bf16, at gpt-oss-120b's layer (E=128, k=4,
              H=I=2880) and gpt-oss-20b's (E=32): the model's op on routed ids at 1, 8, 64 and 512
              tokens (decode path up to MXFP4_DECODE_MAX_TOKENS, sorted above), default tiles; ms,
              effective GB/s of the weight bytes of the distinct experts hit (packed values +
              exponents + biases), error against the reference on the dequantized weights,
              and at decode sizes whether a CUDA graph replay equals the eager call.
  checkpoint  writes the checkpoint: Qwen3-30B-A3B's shapes (config.json as the public model's)
              with --layers decoder layers (48 in the real model; fewer keep the call short: the
              tables say how many), random bf16 weights, per-expert tensors as on the hub.
  engine      one engine (--tp, --ep): bs=1 decode ms/step (CUDA graphs) against the active-parameter
              roofline (bytes of the weights one decode step reads: attention, router, the k experts
              chosen, lm_head; per rank: divided by the TP size), offline 1024/128 tok/s. Appends a
              JSON line to --rows; `report` turns the lines into a table. --moe-path sorted runs
              the engine as before this change (sorted path at every size with its memset + torch
              sum, routing with 4 warps and sorting as a second launch): the same-run baseline.
              --router-linear and --qk-norm-separate undo one fusion each (the router's gate; the
              q/k norms inside the rotary epilogue): their same-run baselines.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time

import torch

SHAPE = dict(hidden=2048, inter=768, experts=128, top_k=8, heads=32, kv_heads=4, head_dim=128, vocab=151936,
             layers=48, dense_inter=6144)
SWEEP = [  # sorted-path tile configs tried per token count (kernel): the default's kind and the earlier winners
    # (H200, docs/moe-gpu-results.md: 16x32x128 at 8 tokens, 64x64x64 at 64 and 512); four more were
    # dropped to keep tools/gpu/moe.sh within 5 minutes on one card
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
]


DEVICE, DT = "cuda", torch.bfloat16  # the CPU plumbing test (tests/kernels/test_moe_bench.py) swaps these
GRAPH_LAYERS = 4  # layers per CUDA graph in `decode`, each with its own weights
# Decode tiles tried, one kernel at a time (the other at its default): gate|up (BLOCK_N, BLOCK_K,
# warps), down (BLOCK_N, BLOCK_K, warps); the first of each is moe_decode_config's at Qwen3's shape.
DECODE_SWEEP_GU = [(16, 256, 4), (32, 256, 4), (8, 256, 4), (16, 512, 4), (16, 128, 4), (32, 256, 8)]
DECODE_SWEEP_DOWN = [(8, 256, 8), (16, 128, 8), (8, 128, 4), (4, 256, 4), (16, 256, 8)]


def graph_time_us(make_call, calls: int) -> float:
    """us per call of `calls` launches captured in one CUDA graph (bench/gemv.py's timer, 40 ms)."""
    from pdserve.bench.gemv import graph_time_us as timed

    return timed(make_call, calls, rep=40)

def _old_routing(old: bool) -> None:
    """The routing kernel's warps (4 above 64 experts), routing and sort as two launches, and the
    sorted path's sum over k (memset + torch sum) as before the decode-path change, or as now."""
    import pdserve.kernels.fused_moe as fm
    import pdserve.kernels.moe_route as mr

    mr.ONE_WARP_MAX_EXPERTS = 64 if old else 256
    fm.SUM_IN_TORCH = old
    fm.FUSE_ROUTE_ALIGN = not old


def decode(args) -> int:
    from pdserve.kernels.fused_moe import DECODE_MAX_TOKENS, fused_moe, fused_moe_routed, moe_decode_config
    from pdserve.kernels.moe_route import moe_route
    from pdserve.kernels.reference import fused_moe_loop_ref, moe_route_ref

    h, inter, e, k = args.hidden, args.inter, args.experts, args.top_k
    torch.manual_seed(0)
    layers = [(torch.randn(e, 2 * inter, h, device=DEVICE, dtype=DT) * 0.02,
               torch.randn(e, h, inter, device=DEVICE, dtype=DT) * 0.02) for _ in range(GRAPH_LAYERS)]
    bw = args.copy_gbs * 1e9 if args.copy_gbs else _copy_bandwidth()
    card = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    expert_bytes = 3 * inter * h * DT.itemsize
    default = moe_decode_config(k, inter)
    lines = [
        f"MoE at decode batch sizes, before/after in one run: E={e}, k={k}, H={h}, I={inter}, {DT}, {card}, "
        f"same-run copy bandwidth {bw / 1e9:.0f} GB/s. Every time is us per layer inside a CUDA graph of "
        f"{GRAPH_LAYERS} layers with their own weights (triton do_bench median). sorted = align + grouped "
        f"GEMMs + sum over k (before: memset + torch sum; now: one sum launch); decode = two GEMV launches, the sum in the down pass "  # noqa: E501
        f"(default tiles: gate|up {default['GU_BLOCK_N']}x{default['GU_BLOCK_K']} w{default['GU_WARPS']}, down "
        f"{default['DOWN_BLOCK_N']}x{default['DOWN_BLOCK_K']} w{default['DOWN_WARPS']}). Layer = routing + experts "
        f"from the router's logits (before: routing with 4 warps, then the sorted path; after: the model's op, "
        f"fused_moe_routed: 1-warp routing + decode path up to {DECODE_MAX_TOKENS} tokens, routing and sort in one "
        f"launch above). GB/s: bytes of the distinct experts hit / decode best.",
        "",
        "| tokens | experts hit | sorted, before (us) | sorted, one-launch sum (us) | decode, default (us) | decode, best (us) | best tiles (gate-up; down) "  # noqa: E501
        "| sorted / decode best | GB/s (% of copy) | rel err vs loop: sorted / decode | decode bit-stable "
        "| routing 4 warps / 1 warp (us) | MoE layer before / after (us) |",
        "|---:|---:|---:|---:|---:|---:|---|---:|---|---|---|---|---|",
    ]
    for t in args.tokens:
        x = torch.randn(t, h, device=DEVICE, dtype=DT)
        logits = [torch.randn(t, e, device=DEVICE, dtype=DT) for _ in range(GRAPH_LAYERS)]
        routes = [moe_route_ref(lg, k, True) for lg in logits]
        hit = sum(int(torch.unique(ids).numel()) for _, ids in routes) / GRAPH_LAYERS

        def experts(path, cfg=None):
            def make(i):
                (w13, w2), (w, ids) = layers[i % GRAPH_LAYERS], routes[i % GRAPH_LAYERS]
                return lambda: fused_moe(x, w13, w2, w, ids, config=cfg, path=path)
            return graph_time_us(make, GRAPH_LAYERS)

        (w13, w2), (w, ids) = layers[0], routes[0]
        ref = fused_moe_loop_ref(x, w13, w2, w, ids)
        got = {p: fused_moe(x, w13, w2, w, ids, path=p) for p in ("sorted", "decode")}
        errs = [((got[p].float() - ref.float()).norm() / ref.float().norm()).item() for p in ("sorted", "decode")]
        stable = torch.equal(got["decode"], fused_moe(x, w13, w2, w, ids, path="decode"))
        _old_routing(True)  # "sorted" = the path before: its memset + torch sum
        t_sorted = experts("sorted")
        _old_routing(False)
        t_sorted_now = experts("sorted")  # with the one-launch sum (what batches above the limit run now)
        t_default = experts("decode")
        best_gu, best_down = default, default
        for name, sweep in (("GU", DECODE_SWEEP_GU), ("DOWN", DECODE_SWEEP_DOWN)):
            best = None
            for bn, bk, warps in sweep:
                cfg = dict(best_gu if name == "DOWN" else default,
                           **{f"{name}_BLOCK_N": bn, f"{name}_BLOCK_K": bk, f"{name}_WARPS": warps})
                try:
                    us = experts("decode", cfg)
                except Exception as ex:  # a tile the card cannot run: skipped, said
                    print(f"tokens {t}: decode {name} {bn}x{bk} w{warps} failed: {type(ex).__name__}: {ex}"[:300],
                          flush=True)
                    continue
                if best is None or us < best[0]:
                    best = (us, cfg)
            if best is not None and name == "GU":
                best_gu = best[1]
            elif best is not None:
                best_down = best[1]
        t_best = min(t_default, experts("decode", best_down))
        best_cfg = best_down if t_best < t_default else default
        tiles = (f"{best_cfg['GU_BLOCK_N']}x{best_cfg['GU_BLOCK_K']} w{best_cfg['GU_WARPS']}; "
                 f"{best_cfg['DOWN_BLOCK_N']}x{best_cfg['DOWN_BLOCK_K']} w{best_cfg['DOWN_WARPS']}")
        route_us = []
        layer_us = []
        for old in (True, False):
            _old_routing(old)
            route_us.append(graph_time_us(lambda i: lambda: moe_route(logits[i % GRAPH_LAYERS], k, True), GRAPH_LAYERS))

            def make_layer(i, old=old):
                (w13, w2), lg = layers[i % GRAPH_LAYERS], logits[i % GRAPH_LAYERS]

                def before():
                    w, ids = moe_route(lg, k, True)
                    return fused_moe(x, w13, w2, w, ids, path="sorted")
                return before if old else (lambda: fused_moe_routed(x, w13, w2, lg, k, True))  # the model's op
            layer_us.append(graph_time_us(make_layer, GRAPH_LAYERS))
        _old_routing(False)
        gbs = hit * expert_bytes / (t_best * 1e-6) / 1e9
        lines.append(
            f"| {t} | {hit:.1f} | {t_sorted:.1f} | {t_sorted_now:.1f} | {t_default:.1f} | {t_best:.1f} | {tiles} | "
            f"{t_sorted / t_best:.2f}x | {gbs:.0f} ({100 * gbs * 1e9 / bw:.0f}%) | {errs[0]:.1e} / {errs[1]:.1e} | "
            f"{'yes' if stable else 'NO'} | {route_us[0]:.1f} / {route_us[1]:.1f} | "
            f"{layer_us[0]:.1f} / {layer_us[1]:.1f} |"
        )
        print(lines[-1], flush=True)
        _write(args.out, lines)  # a call cut short keeps the rows done
    return 0


def fp8(args) -> int:
    from pdserve.kernels.fused_moe import fused_moe
    from pdserve.kernels.reference import (
        dequantize_moe_fp8_ref,
        fused_moe_loop_ref,
        moe_route_ref,
        quantize_moe_fp8_ref,
    )

    h, inter, e, k = args.hidden, args.inter, args.experts, args.top_k
    torch.manual_seed(0)
    w13 = torch.randn(e, 2 * inter, h, device=DEVICE, dtype=DT) * 0.02
    w2 = torch.randn(e, h, inter, device=DEVICE, dtype=DT) * 0.02
    formats = {"bf16": None}
    for name, block in (("block-128", (128, 128)), ("per-channel", None)):
        q13, q2, s13, s2 = quantize_moe_fp8_ref(w13, w2, block)
        deq = (torch.stack([dequantize_moe_fp8_ref(a, b, block, parts=2) for a, b in zip(q13, s13)]).to(DT),
               torch.stack([dequantize_moe_fp8_ref(a, b, block) for a, b in zip(q2, s2)]).to(DT))
        formats[name] = (q13, q2, dict(w13_scale=s13, w2_scale=s2, block=block), deq)
    card = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    lines = [f"fused MoE with FP8 expert weights (e4m3 + fp32 scales, activations {DT}) vs {DT} weights, one layer: "
             f"E={e}, k={k}, H={h}, I={inter}, {card}. The model's op on routed ids (decode path up to 4 tokens, "
             f"sorted above), default tiles; triton do_bench medians (L2 flushed between calls). GB/s: bytes of the "
             f"distinct experts hit (bf16 2 B, fp8 1 B per weight; scales not counted) / time. Error: relative to "
             f"the per-expert loop on the same weights (FP8: dequantized to {DT}).", "",
             "| tokens | experts hit | bf16 (us) | fp8 block-128 (us) | fp8 per-channel (us) | bf16 / block | "
             "bf16 / channel | GB/s bf16 / block / channel | rel err bf16 / block / channel |",
             "|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for t in args.tokens:
        x = torch.randn(t, h, device=DEVICE, dtype=DT)
        weights, ids = moe_route_ref(torch.randn(t, e, device=DEVICE, dtype=DT), k, True)
        hit = int(torch.unique(ids).numel())
        us, gbs, errs = [], [], []
        for name, fmt in formats.items():
            if fmt is None:
                a, b, extra, (d13, d2) = w13, w2, {}, (w13, w2)
            else:
                a, b, extra, (d13, d2) = fmt
            ref = fused_moe_loop_ref(x, d13, d2, weights, ids).float()
            out = fused_moe(x, a, b, weights, ids, **extra)
            errs.append(((out.float() - ref).norm() / ref.norm()).item())
            us.append(_bench_us(lambda: fused_moe(x, a, b, weights, ids, **extra)))
            gbs.append(hit * 3 * inter * h * a.element_size() / (us[-1] * 1e-6) / 1e9)
        lines.append(f"| {t} | {hit} | {us[0]:.1f} | {us[1]:.1f} | {us[2]:.1f} | {us[0] / us[1]:.2f}x | "
                     f"{us[0] / us[2]:.2f}x | {' / '.join(f'{g:.0f}' for g in gbs)} | "
                     f"{' / '.join(f'{v:.1e}' for v in errs)} |")
        print(lines[-1], flush=True)
        _write(args.out, lines)  # a call cut short keeps the rows done
    return 0


# gpt-oss's expert layers (config.json of the published models): E, k, H, I.
GPT_OSS = {"gpt-oss-120b": dict(experts=128, top_k=4, hidden=2880, inter=2880),
           "gpt-oss-20b": dict(experts=32, top_k=4, hidden=2880, inter=2880)}


def _gpt_oss_experts(e: int, h: int, inter: int):
    """Random MXFP4 experts as published (bytes of every code, exponents around 2^-6, so values
    near a trained layer's scale), their bf16 twins (dequantized one expert at a time: no fp32
    copy of the whole layer) and biases."""
    from pdserve.kernels.mxfp4 import dequantize_mxfp4

    def one(n, k):
        return (torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=DEVICE),
                torch.randint(119, 124, (e, n, k // 32), dtype=torch.uint8, device=DEVICE))

    (q13, s13), (q2, s2) = one(2 * inter, h), one(h, inter)
    d13 = torch.stack([dequantize_mxfp4(q, sc, DT) for q, sc in zip(q13, s13)])
    d2 = torch.stack([dequantize_mxfp4(q, sc, DT) for q, sc in zip(q2, s2)])
    b13 = torch.randn(e, 2 * inter, device=DEVICE, dtype=DT) * 0.1
    b2 = torch.randn(e, h, device=DEVICE, dtype=DT) * 0.1
    return (q13, s13, q2, s2), (d13, d2), (b13, b2)


def capture_graph(fn, reps: int = 1):
    """(graph, the last call's output): `fn` warmed up on a side stream (Triton compiles outside
    the capture), then `reps` calls captured in one CUDA graph, replayed once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            static = fn()
    g.replay()
    torch.cuda.synchronize()
    return g, static


def graph_call_ms(fn, reps: int = 20) -> float:
    """ms a call of fn(r), r = 0 .. reps - 1 once each (say, a routing each, so the experts a call
    reads are not the ones L2 holds from the call before), the calls captured in one CUDA graph:
    triton's do_bench median of its replays, over reps."""
    from triton.testing import do_bench

    calls = itertools.count()
    g, _ = capture_graph(lambda: fn(next(calls) % reps), reps)
    return do_bench(g.replay, warmup=10, rep=100, return_mode="median") / reps


def _graph_equals_eager(fn, eager: torch.Tensor) -> str:
    """Whether `fn` captured in a CUDA graph and replayed gives eager's bits (no host sync inside)."""
    if DEVICE != "cuda":
        return "-"
    _, static = capture_graph(fn)
    return "yes" if torch.equal(static, eager) else "NO"


def mxfp4(args) -> int:
    from pdserve.kernels.fused_moe import decode_max_tokens
    from pdserve.kernels.moe_activation import SwigluOAI

    act = SwigluOAI(alpha=1.702, limit=7.0)  # gpt-oss's
    bw = args.copy_gbs * 1e9 if args.copy_gbs else _copy_bandwidth()
    card = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    lines = [f"gpt-oss's MoE experts, MXFP4 weights (uint8 e2m1 pairs + E8M0 exponents per 32 inputs, decoded in "
             f"the kernels; activations {DT}) vs the same experts in {DT}, biases and the clamped SwiGLU "
             f"(alpha 1.702, limit 7) in both, {card}, same-run copy bandwidth {bw / 1e9:.0f} GB/s. fused_moe on "
             f"routed ids (decode path up to {decode_max_tokens(True)} tokens, sorted above), default tiles; triton "
             f"do_bench medians, L2 flushed between calls. GB/s: weight bytes of the distinct experts hit (bf16: 2 B "
             f"a weight; MXFP4: 0.5 B + one exponent byte per 32; biases in both) / time. Error: "
             f"relative to fused_moe_ref on the dequantized weights (fp32). Graph: a CUDA graph replay equals the "
             f"eager call (decode sizes).", "",
             "| model | E | k | tokens | experts hit | bf16 (ms) | MXFP4 (ms) | bf16 / MXFP4 | GB/s bf16 / MXFP4 "
             "(% of copy) | rel err bf16 / MXFP4 | MXFP4 graph == eager |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for name in args.models:  # one model's weights at a time (freed when _mxfp4_rows returns)
        for row in _mxfp4_rows(name, args.tokens, act, bw):
            lines.append(row)
            print(row, flush=True)
            _write(args.out, lines)  # a call cut short keeps the rows done
    return 0


def _mxfp4_rows(name: str, tokens: list[int], act, bw: float):
    from pdserve.kernels.fused_moe import fused_moe
    from pdserve.kernels.reference import fused_moe_ref, moe_route_ref

    shape = GPT_OSS[name]
    e, k, h, inter = shape["experts"], shape["top_k"], shape["hidden"], shape["inter"]
    torch.manual_seed(0)
    (q13, s13, q2, s2), (d13, d2), (b13, b2) = _gpt_oss_experts(e, h, inter)
    bias_bytes = (2 * inter + h) * b13.element_size()
    per_expert = {"bf16": 3 * h * inter * DT.itemsize + bias_bytes,
                  "mxfp4": 3 * h * inter // 2 + 3 * h * inter // 32 + bias_bytes}
    epilogue = dict(w13_bias=b13, w2_bias=b2, activation=act)
    calls = {"bf16": lambda x, w, ids: fused_moe(x, d13, d2, w, ids, **epilogue),
             "mxfp4": lambda x, w, ids: fused_moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2, **epilogue)}
    for t in tokens:
        x = torch.randn(t, h, device=DEVICE, dtype=DT)
        weights, ids = moe_route_ref(torch.randn(t, e, device=DEVICE, dtype=DT), k, True)
        hit = int(torch.unique(ids).numel())
        ref = fused_moe_ref(x.float(), q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, w13_bias=b13.float(),
                            w2_bias=b2.float(), activation=act)
        ms, gbs, errs = {}, {}, {}
        for fmt, call in calls.items():
            out = call(x, weights, ids)
            errs[fmt] = ((out.float() - ref).norm() / ref.norm()).item()
            ms[fmt] = _bench_us(lambda call=call: call(x, weights, ids)) / 1e3
            gbs[fmt] = hit * per_expert[fmt] / (ms[fmt] * 1e-3) / 1e9
        graph = "-"
        if t <= 64:
            graph = _graph_equals_eager(lambda: calls["mxfp4"](x, weights, ids), calls["mxfp4"](x, weights, ids))
        pct = {fmt: 100 * v * 1e9 / bw for fmt, v in gbs.items()}
        yield (f"| {name} | {e} | {k} | {t} | {hit} | {ms['bf16']:.3f} | {ms['mxfp4']:.3f} | "
               f"{ms['bf16'] / ms['mxfp4']:.2f}x | {gbs['bf16']:.0f} ({pct['bf16']:.0f}%) / "
               f"{gbs['mxfp4']:.0f} ({pct['mxfp4']:.0f}%) | {errs['bf16']:.1e} / {errs['mxfp4']:.1e} | {graph} |")


def _copy_bandwidth() -> float:
    from pdserve.bench.kernels import copy_bandwidth

    return copy_bandwidth()


def _bench_us(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=100, return_mode="median") * 1e3


def _cfg_name(c: dict) -> str:
    return f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} s{c['num_stages']}"


def kernel(args) -> int:
    from pdserve.bench.kernels import copy_bandwidth
    from pdserve.kernels.fused_moe import DECODE_MAX_TOKENS, fused_moe, moe_block_config
    from pdserve.kernels.moe_route import moe_route
    from pdserve.kernels.reference import fused_moe_loop_ref, moe_route_ref

    h, inter, e, k = SHAPE["hidden"], SHAPE["inter"], SHAPE["experts"], SHAPE["top_k"]
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    w13 = torch.randn(e, 2 * inter, h, device=dev, dtype=dt) * 0.02
    w2 = torch.randn(e, h, inter, device=dev, dtype=dt) * 0.02
    bw = copy_bandwidth()
    expert_bytes = 3 * inter * h * 2
    lines = [
        f"fused MoE kernel vs a per-expert loop of torch matmuls (cuBLAS), one layer: E={e}, k={k}, H={h}, "
        f"I={inter}, bf16, router = softmax top-k renormalised over random logits. {torch.cuda.get_device_name()}, "
        f"same-run copy bandwidth {bw / 1e9:.0f} GB/s (read + write). Times: triton do_bench medians.",
        "",
        "| tokens | experts hit | fused, default tiles (us) | fused, best tiles (us) | best tiles | "
        "per-expert loop (us) | loop / fused best | fused in a CUDA graph (us) | expert bytes / best time "
        "(GB/s, % of copy) | rel err vs loop | routing: torch / Triton (us) |",
        "|---:|---:|---:|---:|---|---:|---:|---:|---|---:|---|",
    ]
    for t in args.tokens:
        x = torch.randn(t, h, device=dev, dtype=dt)
        logits = torch.randn(t, e, device=dev, dtype=dt)
        weights, ids = moe_route_ref(logits, k, True)
        route_us = (_bench_us(lambda: moe_route_ref(logits, k, True)), _bench_us(lambda: moe_route(logits, k, True)))
        hit = int(torch.unique(ids).numel())
        ref = fused_moe_loop_ref(x, w13, w2, weights, ids)
        out = fused_moe(x, w13, w2, weights, ids)
        err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        default = moe_block_config(t * k, e)
        t_default = _bench_us(lambda: fused_moe(x, w13, w2, weights, ids))
        # Up to DECODE_MAX_TOKENS the default is the decode path (its own table: `decode`); the sweep is the
        # sorted path's.
        best = (t_default, "decode path" if t <= DECODE_MAX_TOKENS else _cfg_name(default))
        for cfg in SWEEP:
            try:
                us = _bench_us(lambda c=cfg: fused_moe(x, w13, w2, weights, ids, config=c))
            except Exception as ex:  # a tile config the card cannot run (shared memory): skipped, said
                print(f"tokens {t}: {_cfg_name(cfg)} failed: {type(ex).__name__}: {ex}"[:300], flush=True)
                continue
            best = min(best, (us, _cfg_name(cfg)), key=lambda b: b[0])
        t_loop = _bench_us(lambda: fused_moe_loop_ref(x, w13, w2, weights, ids))
        graph_us = "-"
        if t <= 64:  # decode sizes: the kernel and its device-side sort must be capturable
            static = fused_moe(x, w13, w2, weights, ids)
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fused_moe(x, w13, w2, weights, ids)
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(g):
                static = fused_moe(x, w13, w2, weights, ids)
            g.replay()
            torch.cuda.synchronize()
            same = torch.equal(static, out)
            graph_us = f"{_bench_us(g.replay):.1f}" + ("" if same else " (differs from eager!)")
        gbs = hit * expert_bytes / (best[0] * 1e-6) / 1e9
        lines.append(f"| {t} | {hit} | {t_default:.1f} | {best[0]:.1f} | {best[1]} | {t_loop:.1f} | "
                     f"{t_loop / best[0]:.1f}x | {graph_us} | {gbs:.0f} ({100 * gbs * 1e9 / bw:.0f}%) | {err:.1e} | "
                     f"{route_us[0]:.1f} / {route_us[1]:.1f} |")
        print(lines[-1], flush=True)
    _write(args.out, lines)
    return 0


def _hf_config(layers: int):
    from transformers import Qwen3MoeConfig

    # Qwen3-30B-A3B's public config.json, with fewer layers when asked.
    return Qwen3MoeConfig(
        vocab_size=SHAPE["vocab"],
        hidden_size=SHAPE["hidden"],
        intermediate_size=SHAPE["dense_inter"],
        moe_intermediate_size=SHAPE["inter"],
        num_hidden_layers=layers,
        num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["kv_heads"],
        head_dim=SHAPE["head_dim"],
        num_experts=SHAPE["experts"],
        num_experts_per_tok=SHAPE["top_k"],
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        rope_theta=1e6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        architectures=["Qwen3MoeForCausalLM"],
    )


def checkpoint(args) -> int:
    """Random bf16 tensors made on the GPU, one safetensors file per layer (no model object)."""
    from safetensors.torch import save_file

    from pdserve.bench.engine import save_tokenizer

    path = args.checkpoint
    if os.path.exists(os.path.join(path, "config.json")):
        print(f"checkpoint {path} exists")
        return 0
    os.makedirs(path, exist_ok=True)
    if args.config_only:  # engine --load-format dummy makes the weights on the GPU: nothing to write
        _hf_config(args.layers).save_pretrained(path)
        save_tokenizer(path)
        print(f"checkpoint: config of {args.layers} layers (no weights) in {path}", flush=True)
        return 0
    t0 = time.perf_counter()
    torch.manual_seed(0)
    h, inter, hd = SHAPE["hidden"], SHAPE["inter"], SHAPE["head_dim"]
    q, kv = SHAPE["heads"] * hd, SHAPE["kv_heads"] * hd

    def rnd(*shape):
        return (torch.randn(*shape, device="cuda", dtype=torch.bfloat16) * 0.02).cpu()

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    save_file({"model.embed_tokens.weight": rnd(SHAPE["vocab"], h), "lm_head.weight": rnd(SHAPE["vocab"], h),
               "model.norm.weight": ones(h)}, os.path.join(path, "model-embed.safetensors"))
    for i in range(args.layers):
        p = f"model.layers.{i}."
        t = {p + "self_attn.q_proj.weight": rnd(q, h), p + "self_attn.k_proj.weight": rnd(kv, h),
             p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, q),
             p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd),
             p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
             p + "mlp.gate.weight": rnd(SHAPE["experts"], h)}
        for e in range(SHAPE["experts"]):
            t[f"{p}mlp.experts.{e}.gate_proj.weight"] = rnd(inter, h)
            t[f"{p}mlp.experts.{e}.up_proj.weight"] = rnd(inter, h)
            t[f"{p}mlp.experts.{e}.down_proj.weight"] = rnd(h, inter)
        save_file(t, os.path.join(path, f"model-layer{i:03d}.safetensors"))
    _hf_config(args.layers).save_pretrained(path)
    save_tokenizer(path)
    print(f"checkpoint: {args.layers} layers written to {path} in {time.perf_counter() - t0:.0f}s", flush=True)
    return 0


def step_bytes(layers: int, tp: int) -> float:
    """Weight bytes one bs=1 decode step reads per rank (bf16): every layer's attention, router
    and k experts, the final lm_head; each divided by the TP size (an even split is the ideal)."""
    h, inter, hd = SHAPE["hidden"], SHAPE["inter"], SHAPE["head_dim"]
    attn = h * (SHAPE["heads"] + 2 * SHAPE["kv_heads"]) * hd + SHAPE["heads"] * hd * h
    per_layer = attn + SHAPE["experts"] * h + SHAPE["top_k"] * 3 * inter * h
    return 2 * (layers * per_layer + SHAPE["vocab"] * h) / tp


def engine(args) -> int:
    from pdserve.bench.engine import decode_step_seconds
    from pdserve.bench.kernels import copy_bandwidth
    from pdserve.worker.config.engine import EngineConfig
    from pdserve.worker.engine.llm_engine import LLMEngine
    from pdserve.worker.request.sampling_params import SamplingParams

    if args.moe_path == "sorted":  # as before the decode path: sorted at every size, routing with 4 warps
        import pdserve.kernels.fused_moe as fm

        fm.DECODE_MAX_TOKENS = 0
        _old_routing(True)  # and routing + sort as two launches, the sorted path's memset + torch sum
    if args.router_linear:  # the router as F.linear + the routing kernel, as before kernels/moe_gate.py
        from pdserve.worker.models import moe

        moe.FUSED_GATE = False
    if args.gate_norm:  # the norm before the router inside the router's launch (models/moe.py)
        from pdserve.worker.models import moe

        moe.GATE_NORM = True
    if args.down_knobs:  # decode-config knobs on the bf16 / FP8 experts, e.g. {"DOWN_REDUCE_HERE": true}
        from pdserve.kernels import fused_moe as fm

        fm.MOE_ENV_DECODE_KNOBS.update(json.loads(args.down_knobs))
    if args.qk_norm_separate:  # q and k RMSNorm as two launches before the rotary epilogue, as before
        from pdserve.worker.attention.triton_backend import TritonAttentionBackend

        TritonAttentionBackend.fuse_qk_norm = False
    if args.no_fused_gemv:  # attention's qkv / o as cuBLAS (+ the norm's own launch), as on an unmeasured card
        from pdserve.worker.attention.triton_backend import TritonAttentionBackend

        TritonAttentionBackend.fused_gemv = False
    if args.gemv_table:  # a bench/gemv.py sweep's entries over the shipped table, this run only
        from pdserve.bench.gemv import use_swept_table

        print(f"GEMV table: {use_swept_table(args.gemv_table, torch.device('cuda'))} swept entries", flush=True)
    bw = copy_bandwidth()
    t0 = time.perf_counter()
    eng = LLMEngine(EngineConfig(model=args.checkpoint, device="cuda", dtype="bfloat16", max_model_len=2048,
                                 max_num_seqs=max(8, args.num_prompts), max_num_batched_tokens=8192,
                                 enable_prefix_caching=False, tensor_parallel_size=args.tp,
                                 enable_expert_parallel=args.ep, quantization=args.quantization,
                                 load_format=args.load_format))
    row = {
        "tp": args.tp,
        "ep": args.ep,
        "moe_path": args.moe_path,
        "router_linear": args.router_linear,
        "qk_norm_separate": args.qk_norm_separate,
        "gate_norm": args.gate_norm,
        "down_knobs": args.down_knobs,
        "no_fused_gemv": args.no_fused_gemv,
        "gemv_table": args.gemv_table,
        "quantization": args.quantization,
        "layers": args.layers,
        "load_format": args.load_format,
        "start_s": time.perf_counter() - t0,
        "copy_gbs": bw / 1e9,
        "card": torch.cuda.get_device_name(),
        "graphs": eng.runner.graphs is not None,
    }
    print(f"TP={args.tp} EP={args.ep}: started in {row['start_s']:.0f}s", flush=True)
    try:
        rng = random.Random(7)
        vocab = SHAPE["vocab"]
        prompt = [rng.randrange(3, vocab) for _ in range(128)]
        decode_step_seconds(eng, prompt, 8)  # warm-up
        row["decode_ms"] = 1e3 * statistics.median(decode_step_seconds(eng, prompt, args.decode_steps))
        row["roofline_ms"] = 1e3 * step_bytes(args.layers, args.tp) / bw
        print(f"TP={args.tp} EP={args.ep}: bs=1 {row['decode_ms']:.2f} ms/step", flush=True)
        if args.profile:
            from pdserve.bench.engine import profile_decode

            row["gpu_ms"] = profile_decode(eng, prompt, args.profile)
        if args.num_prompts:
            params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
            prompts = [[rng.randrange(3, vocab) for _ in range(1024)] for _ in range(args.num_prompts)]
            eng.generate(prompts[:8], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # compiles
            t1 = time.perf_counter()
            outs = eng.generate(prompts, params)
            row["offline_tok_s"] = sum(len(o) for o in outs) / (time.perf_counter() - t1)
            row["num_prompts"] = args.num_prompts
    finally:
        eng.shutdown()
    with open(args.rows, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)
    return 0


def report(args) -> int:
    rows = [json.loads(line) for line in open(args.rows)] if os.path.exists(args.rows) else []
    if not rows:
        print("no engine rows")
        return 1
    r0 = rows[0]
    weights = "random bf16 weights made on the GPU (--load-format dummy)" if r0.get("load_format") == "dummy" \
        else "random bf16 weights"
    lines = [f"Qwen3-30B-A3B shapes with {r0['layers']} of 48 decoder layers, {weights}, {r0['card']}, "
             f"CUDA graphs, prefix caching off. Roofline: the weight bytes a bs=1 step reads per rank "
             f"(attention, router, k=8 experts per layer, lm_head; TP-divided) / the same run's copy bandwidth. "
             f"Offline: prompts of 1024 random tokens, 128 generated each, output tok/s.", "",
             "| TP | expert parallel | MoE path | bs=1 ms/step | roofline ms | % of roofline | offline 1024/128 tok/s "
             "| start s |",
             "|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        off = f"{r['offline_tok_s']:.0f} ({r['num_prompts']} prompts)" if "offline_tok_s" in r else "-"
        path = r.get("moe_path", "auto")
        path = "decode <= 4 tokens (new)" if path == "auto" else "sorted, 4-warp routing (before)"
        if r.get("router_linear"):
            path += ", router as F.linear + moe_route"
        if r.get("qk_norm_separate"):
            path += ", q/k norms as 2 launches"
        if r.get("gate_norm"):
            path += ", the router's norm in its launch"
        if r.get("down_knobs"):
            path += f", knobs {r['down_knobs']}"
        if r.get("no_fused_gemv"):
            path += ", attention on cuBLAS (no GEMV table)"
        if r.get("gemv_table"):
            path += ", the swept GEMV table"
        if r.get("quantization"):  # the roofline counts bf16 weight bytes: not this row's
            path += f", --quantization {r['quantization']}"
            roof = "- | -"
        else:
            roof = f"{r['roofline_ms']:.2f} | {100 * r['roofline_ms'] / r['decode_ms']:.0f}%"
        lines.append(f"| {r['tp']} | {'yes' if r['ep'] else 'no'} | {path} | {r['decode_ms']:.2f} | {roof} | {off} | "
                     f"{r['start_s']:.0f} |")
    _write(args.out, lines)
    return 0


def _write(path: str | None, lines: list[str]) -> None:
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if path:
        with open(path, "w") as f:
            f.write(text)


def _layer_args(p: argparse.ArgumentParser, tokens: list[int]) -> argparse.ArgumentParser:
    """One MoE layer's shape (Qwen3-30B-A3B's by default), the token counts and --out."""
    p.add_argument("--tokens", type=int, nargs="+", default=tokens)
    p.add_argument("--hidden", type=int, default=SHAPE["hidden"])
    p.add_argument("--inter", type=int, default=SHAPE["inter"])
    p.add_argument("--experts", type=int, default=SHAPE["experts"])
    p.add_argument("--top-k", type=int, default=SHAPE["top_k"])
    p.add_argument("--out")
    return p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench moe", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernel")
    k.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    k.add_argument("--out")
    d = _layer_args(sub.add_parser("decode"), [1, 2, 4, 8, 16])
    d.add_argument("--copy-gbs", type=float, help="skip the copy-bandwidth measurement, use this")
    _layer_args(sub.add_parser("fp8"), [1, 8, 64, 512])
    m = sub.add_parser("mxfp4")
    m.add_argument("--models", nargs="+", choices=tuple(GPT_OSS), default=list(GPT_OSS))
    m.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512])
    m.add_argument("--copy-gbs", type=float, help="skip the copy-bandwidth measurement, use this")
    m.add_argument("--out")
    c = sub.add_parser("checkpoint")
    c.add_argument("--checkpoint", required=True)
    c.add_argument("--layers", type=int, default=12)
    c.add_argument("--config-only", action="store_true", help="config.json and the tokenizer, no weights (for "
                   "engine --load-format dummy: all 48 layers without the disk)")
    e = sub.add_parser("engine")
    e.add_argument("--checkpoint", required=True)
    e.add_argument("--layers", type=int, required=True, help="the checkpoint's layers (for the roofline)")
    e.add_argument("--tp", type=int, default=1)
    e.add_argument("--ep", action="store_true")
    e.add_argument("--quantization", choices=("fp8",), help="quantize the bf16 checkpoint at load (FP8 experts, "
                   "per channel, and FP8 attention linears)")
    e.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="dummy: random weights made on the GPU (a --config-only checkpoint)")
    e.add_argument("--decode-steps", type=int, default=64)
    e.add_argument("--num-prompts", type=int, default=64, help="offline batch (0: none)")
    e.add_argument("--rows", required=True)
    e.add_argument("--no-fused-gemv", action="store_true",
                   help="the attention projections on cuBLAS, not the measured GEMV table (the same-run baseline)")
    e.add_argument("--gemv-table", metavar="GEMV_MD",
                   help="a bench/gemv.py sweep's output: its MEASURED entries over the shipped ones (this run only)")
    e.add_argument("--moe-path", choices=("auto", "sorted"), default="auto",
                   help="sorted: the MoE kernels as before the decode path (the same-run baseline)")
    e.add_argument("--router-linear", action="store_true", help="the router as F.linear + the routing kernel "
                   "(before kernels/moe_gate.py's one launch): the same-run baseline of the gate")
    e.add_argument("--qk-norm-separate", action="store_true", help="q and k RMSNorm as two launches a layer "
                   "before the rotary epilogue (not inside it): the same-run baseline of that fusion")
    e.add_argument("--gate-norm", action="store_true", help="the add + RMSNorm before the router inside the "
                   "router's launch (models/moe.py GATE_NORM; off by default: no faster on an H200)")
    e.add_argument("--down-knobs", metavar="JSON", help='decode-config knobs for bf16 / FP8 experts, e.g. '
                   '\'{"DOWN_REDUCE_HERE": true}\' (kernels/fused_moe.py)')
    e.add_argument("--profile", metavar="FILE", help="also profile bs=1 decode steps; the kernel table goes here")
    r = sub.add_parser("report")
    r.add_argument("--rows", required=True)
    r.add_argument("--out")
    args = ap.parse_args(argv)
    if args.cmd != "checkpoint" and not torch.cuda.is_available():
        print("bench moe needs a CUDA GPU", file=sys.stderr)
        return 2
    return {"kernel": kernel, "decode": decode, "fp8": fp8, "mxfp4": mxfp4, "checkpoint": checkpoint,
            "engine": engine, "report": report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
