"""The MXFP4 fused MoE op before/after on one GPU, with bf16 as the same-run baseline.

gpt-oss's expert layer (biases, clamped SwiGLU) at gpt-oss-120b's shape (E=128, k=4, H=I=2880) and
gpt-oss-20b's (E=32): fused_moe on routed ids with bf16 weights, with MXFP4 weights through the
kernels as they were (--old: a copy of the previous kernels/fused_moe.py, loaded by path) and
through the current ones, default tiles; triton do_bench medians (L2 flushed between calls);
GB/s = weight bytes of the distinct experts hit / time (bf16: 2 B a weight; MXFP4: 0.5 B + one
exponent byte per 32; biases in both); error relative to fused_moe_ref on the dequantized weights
(fp32); whether a CUDA graph replay equals the eager call; up to 64 tokens also ms a call with
20 calls in one CUDA graph (no host launch cost; one weight set, so repeats may hit L2). --sweep:
alternative MXFP4 tiles per token count (decode path at 1 and 4 tokens, sorted at 8, 64 and
512). Run by tools/gpu/mxfp4_kernel.sh.

--decode-sweep (tools/gpu/mxfp4_decode.sh): the decode path's configs (DECODE_VARIANTS: tiles and
the split / nibble-major knobs of moe_decode_config) at --sweep-tokens, gpt-oss-120b's layer, each
timed in CUDA graphs of 20 calls with 20 different routings (so a call's experts are mostly not in
L2 from the previous one, as in a model's layer after layer): the whole op and each pass alone
(gate|up with its finish, down with its finish), next to bf16 and the MXFP4 sorted path timed the
same way; then the best config per token count. Writes decode_sweep.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import torch
from triton.testing import do_bench

from pdserve.bench.moe import GPT_OSS, _gpt_oss_experts, _graph_equals_eager, capture_graph
from pdserve.kernels import fused_moe as new
from pdserve.kernels.moe_activation import SwigluOAI
from pdserve.kernels.reference import fused_moe_ref, moe_route_ref

ACT = SwigluOAI(alpha=1.702, limit=7.0)
# (GU_BLOCK_N, GU_BLOCK_K, GU_WARPS, DOWN_BLOCK_N, DOWN_BLOCK_K, DOWN_WARPS, GU_PREFETCH)
DECODE_SWEEP = [(16, 512, 4, 16, 256, 8, False), (16, 512, 4, 16, 256, 8, True), (16, 256, 4, 16, 256, 4, True),
                (16, 256, 4, 16, 256, 4, False), (32, 256, 4, 32, 256, 4, True), (8, 512, 4, 8, 256, 4, True),
                (32, 512, 8, 32, 512, 8, False), (16, 1024, 4, 16, 512, 4, False), (8, 256, 4, 8, 128, 4, True)]
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, MX_ONE_DOT, MX_DOT_SCALED)
SORTED_SWEEP = [(16, 64, 128, 4, 3, False, False), (16, 64, 128, 4, 3, True, False),
                (16, 128, 128, 8, 3, True, False), (64, 64, 128, 4, 3, False, False),
                (64, 128, 128, 8, 3, True, False),
                (16, 64, 128, 4, 3, False, True), (16, 32, 256, 4, 3, False, True), (16, 64, 256, 4, 4, False, True),
                (16, 128, 128, 8, 3, False, True), (64, 64, 128, 4, 3, False, True), (64, 128, 128, 8, 3, False, True),
                (64, 128, 256, 8, 3, False, True), (128, 128, 128, 8, 3, False, True)]
SORTED_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "MX_ONE_DOT", "MX_DOT_SCALED")
# The sorted path on tl.dot_scaled in --decode-sweep's CUDA graphs, beside the decode configs.
SORTED_DOT_GRAPH = [(16, 64, 128, 4, 3), (16, 32, 256, 4, 3), (16, 64, 256, 4, 4), (16, 128, 128, 8, 3)]


# The decode path's configs for --decode-sweep: moe_decode_config's keys; "default" is its own (k256's
# tiles with x nibble-major and the down pass split in 2, since the H200 sweep of 2026-12-02), "plain"
# the GEMVs before it (512-input gate|up steps, one down program per column strip).
_TILES = dict(default=None,
              plain=dict(GU_BLOCK_N=16, GU_BLOCK_K=512, GU_WARPS=4, DOWN_BLOCK_N=16, DOWN_BLOCK_K=256, DOWN_WARPS=8),
              n8=dict(GU_BLOCK_N=8, GU_BLOCK_K=512, GU_WARPS=4, DOWN_BLOCK_N=8, DOWN_BLOCK_K=256, DOWN_WARPS=4,
                      GU_PREFETCH=True),
              k256=dict(GU_BLOCK_N=16, GU_BLOCK_K=256, GU_WARPS=4, DOWN_BLOCK_N=16, DOWN_BLOCK_K=256, DOWN_WARPS=4),
              k1024=dict(GU_BLOCK_N=16, GU_BLOCK_K=1024, GU_WARPS=8, DOWN_BLOCK_N=16, DOWN_BLOCK_K=512,
                         DOWN_WARPS=8))
# Labels in the sweep's table: gu3 = GU_SPLIT_K 3, dn2 = DOWN_SPLIT_K 2, xnm = GU_X_NM, ...
_SHORT = dict(GU_SPLIT_K="gu", DOWN_SPLIT_K="dn", GU_X_NM="xnm", GU_PREFETCH="pf", GU_BLOCK_N="gn",
              GU_WARPS="gw", DOWN_BLOCK_N="dn_n", DOWN_WARPS="dw")
DECODE_VARIANTS = [
    ("default", {}), ("plain", {}), ("n8", {}), ("k256", {}),
    ("default", dict(DOWN_SPLIT_K=1)), ("default", dict(DOWN_SPLIT_K=2)), ("default", dict(DOWN_SPLIT_K=3)),
    ("default", dict(DOWN_SPLIT_K=6)),
    ("default", dict(GU_X_NM=True)), ("default", dict(GU_X_NM=True, DOWN_SPLIT_K=2)),
    ("default", dict(GU_X_NM=True, GU_SPLIT_K=2, DOWN_SPLIT_K=2)),
    ("default", dict(GU_X_NM=True, GU_SPLIT_K=3, DOWN_SPLIT_K=3)),
    ("default", dict(GU_X_NM=True, GU_SPLIT_K=6, DOWN_SPLIT_K=6)),
    ("default", dict(GU_SPLIT_K=2, DOWN_SPLIT_K=2)),
    ("n8", dict(GU_X_NM=True, DOWN_SPLIT_K=2)), ("n8", dict(GU_X_NM=True, GU_SPLIT_K=2, DOWN_SPLIT_K=3)),
    ("k256", dict(GU_X_NM=True, DOWN_SPLIT_K=2)), ("k256", dict(GU_X_NM=True, GU_SPLIT_K=2, DOWN_SPLIT_K=3)),
    ("k256", dict(GU_X_NM=True, GU_SPLIT_K=4, DOWN_SPLIT_K=4)),
    ("k1024", dict(GU_X_NM=True, GU_SPLIT_K=3, DOWN_SPLIT_K=2)),
    ("default", dict(DOWN_BLOCK_N=32, DOWN_WARPS=4, DOWN_SPLIT_K=3)),
    ("default", dict(GU_BLOCK_N=32, GU_WARPS=8, GU_X_NM=True, GU_SPLIT_K=3, DOWN_SPLIT_K=3)),
]


def load_old(path: str):
    spec = importlib.util.spec_from_file_location("pdserve.kernels.fused_moe_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def rel(out, ref) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def graph_ms(fn, reps: int = 20) -> float:
    """ms a call with `reps` calls captured in one CUDA graph (no host launch cost: the engine's
    decode steps run so); one weight set, so an expert's repeats may be served by L2."""
    g, _ = capture_graph(fn, reps)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return sorted(times)[2]


def copy_gbs() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = do_bench(lambda: b.copy_(a), warmup=10, rep=100, return_mode="median")
    return 2 * a.numel() / (t * 1e-3) / 1e9


def model_rows(name: str, args, old, bw: float, lines: list[str], sweep: list[str]) -> None:
    shape = GPT_OSS[name]
    e, k, h, inter = shape["experts"], shape["top_k"], shape["hidden"], shape["inter"]
    torch.manual_seed(0)
    (q13, s13, q2, s2), (d13, d2), (b13, b2) = _gpt_oss_experts(e, h, inter)
    per_expert = 3 * h * inter // 2 + 3 * h * inter // 32 + (2 * inter + h) * 2
    epi = dict(w13_bias=b13, w2_bias=b2, activation=ACT)
    mx = dict(w13_scale=s13, w2_scale=s2, **epi)
    for t in args.tokens:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        w, ids = moe_route_ref(torch.randn(t, e, device="cuda", dtype=torch.bfloat16), k, True)
        hit = int(torch.unique(ids).numel())
        ref = fused_moe_ref(x.float(), q13, q2, w, ids, w13_scale=s13, w2_scale=s2, w13_bias=b13.float(),
                            w2_bias=b2.float(), activation=ACT)
        calls = {"bf16": lambda: new.fused_moe(x, d13, d2, w, ids, **epi),
                 "old": lambda: old.fused_moe(x, q13, q2, w, ids, **mx),
                 "new": lambda: new.fused_moe(x, q13, q2, w, ids, **mx)}
        err = {f: rel(c(), ref) for f, c in calls.items() if f != "bf16"}
        times = {f: ms(c) for f, c in calls.items()}
        graph = _graph_equals_eager(calls["new"], calls["new"]()) if t <= 64 else "-"
        in_graph = " / ".join(f"{graph_ms(c):.3f}" for c in calls.values()) if t <= 64 else "-"
        gbs = hit * per_expert / (times["new"] * 1e-3) / 1e9
        row = (f"| {name} | {t} | {hit} | {times['bf16']:.3f} | {times['old']:.3f} | {times['new']:.3f} | "
               f"{times['bf16'] / times['new']:.2f}x | {times['old'] / times['new']:.2f}x | "
               f"{gbs:.0f} ({100 * gbs / bw:.0f}%) | {in_graph} | {err['old']:.1e} / {err['new']:.1e} | {graph} |")
        lines.append(row)
        print(row, flush=True)
        with open(f"{args.out}/mxfp4.md", "w") as f:
            f.write("\n".join(lines) + "\n")
        if not args.sweep or name != args.models[0]:
            continue
        variants = []
        if t in (1, 4):
            for c in DECODE_SWEEP:
                cfg = dict(zip(("GU_BLOCK_N", "GU_BLOCK_K", "GU_WARPS", "DOWN_BLOCK_N", "DOWN_BLOCK_K",
                                "DOWN_WARPS", "GU_PREFETCH"), c))
                variants.append(("decode", cfg))
        if t in (8, 64, 512):
            for c in SORTED_SWEEP:
                cfg = dict(zip(SORTED_KEYS, c))
                variants.append(("sorted", cfg))
        for path, cfg in variants:
            try:
                out = new.fused_moe(x, q13, q2, w, ids, config=cfg, path=path, **mx)
                e_ = rel(out, ref)
                tm = ms(lambda: new.fused_moe(x, q13, q2, w, ids, config=cfg, path=path, **mx))
                txt = f"{tm:.3f}" + ("" if e_ < 1e-2 else f" (err {e_:.1e}!)")
            except Exception as exc:  # a tile the compiler refuses: noted, the sweep goes on
                txt = f"failed: {type(exc).__name__}: {str(exc)[:80]}"
            row = f"| {name} | {t} | {path} | {tuple(cfg.values())} | {txt} |"
            sweep.append(row)
            print(row, flush=True)
            with open(f"{args.out}/sweep.md", "w") as f:
                f.write("\n".join(sweep) + "\n")


def graph_calls_ms(calls) -> float:
    """ms a call with the calls (one per routing) captured in one CUDA graph, median of 5 replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    return sorted(times)[2]


def decode_sweep(args, bw: float) -> list[str]:
    """--decode-sweep: every DECODE_VARIANTS config at each --sweep-tokens count, whole op and per
    pass, in CUDA graphs over 20 routings; bf16 and the MXFP4 sorted path as baselines."""
    name = "gpt-oss-120b"
    shape = GPT_OSS[name]
    e, k, h, inter = shape["experts"], shape["top_k"], shape["hidden"], shape["inter"]
    torch.manual_seed(0)
    (q13, s13, q2, s2), (d13, d2), (b13, b2) = _gpt_oss_experts(e, h, inter)
    epi = dict(w13_bias=b13, w2_bias=b2, activation=ACT)
    mx = dict(w13_scale=s13, w2_scale=s2, **epi)
    base = new.moe_decode_config(k, inter, mxfp4=True)
    per_expert = 3 * h * inter // 2 + 3 * h * inter // 32 + (2 * inter + h) * 2
    lines = [f"{torch.cuda.get_device_name()}, copy bandwidth {bw:.0f} GB/s. {name} MoE layer, MXFP4 decode path "
             f"configs; ms a call in CUDA graphs of 20 calls, each with its own routing (per pass: gate|up = "
             f"gate|up kernel (+ finish), down = down kernel (+ finish)). default = {base}; labels: tiles (n8 / k256 / "
             f"k1024: {_TILES}) then knobs ({_SHORT}).", "",
             "| tokens | config | op ms | gate\\|up ms | down ms | vs bf16 | vs default | GB/s (% copy) | err |",
             "|---:|---|---:|---:|---:|---:|---:|---|---|"]
    best_lines = []

    def flush():
        with open(f"{args.out}/decode_sweep.md", "w") as f:
            f.write("\n".join(lines + [""] + best_lines) + "\n")

    for t in args.sweep_tokens:
        routes = []
        for _ in range(20):
            x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
            w, ids = moe_route_ref(torch.randn(t, e, device="cuda", dtype=torch.bfloat16), k, True)
            routes.append((x, w, ids))
        x0, w0, ids0 = routes[0]
        ref = fused_moe_ref(x0.float(), q13, q2, w0, ids0, w13_scale=s13, w2_scale=s2, w13_bias=b13.float(),
                            w2_bias=b2.float(), activation=ACT)
        hit = sum(int(torch.unique(r[2]).numel()) for r in routes) / len(routes)
        bf16 = graph_calls_ms([lambda r=r: new.fused_moe(r[0], d13, d2, r[1], r[2], **epi) for r in routes])
        srt = graph_calls_ms([lambda r=r: new.fused_moe(r[0], q13, q2, r[1], r[2], path="sorted", **mx)
                              for r in routes])
        baselines = [("bf16", bf16), ("MXFP4 sorted (default tiles)", srt)]
        for c in SORTED_DOT_GRAPH:
            cfg = dict(zip(SORTED_KEYS, c), MX_DOT_SCALED=True)
            try:
                baselines.append((f"MXFP4 sorted dot_scaled {c}", graph_calls_ms(
                    [lambda r=r: new.fused_moe(r[0], q13, q2, r[1], r[2], config=cfg, path="sorted", **mx)
                     for r in routes])))
            except Exception as exc:  # a tile the compiler refuses: noted, the sweep goes on
                baselines.append((f"MXFP4 sorted dot_scaled {c} failed: {type(exc).__name__}: {str(exc)[:80]}",
                                  float("nan")))
        for label, ms_ in baselines:
            row = f"| {t} | {label} | {ms_:.3f} | - | - | {bf16 / ms_:.2f}x | - | - | - |"
            lines.append(row)
            print(row, flush=True)
        results = []
        for tiles, knobs in DECODE_VARIANTS:
            cfg = dict(base if _TILES[tiles] is None else _TILES[tiles], **knobs)
            label = " ".join([tiles] + [_SHORT.get(a, a) + ("" if b is True else str(b)) for a, b in knobs.items()])
            try:
                out = new.fused_moe(x0, q13, q2, w0, ids0, config=cfg, path="decode", **mx)
                err = rel(out, ref)
                op = graph_calls_ms([lambda r=r: new.fused_moe(r[0], q13, q2, r[1], r[2], config=cfg, path="decode",
                                                               **mx) for r in routes])
                inters = [new._decode_gate_up(r[0], q13, r[1].reshape(-1).contiguous(), r[2], 0, cfg, s13, None, b13,
                                              ACT) for r in routes]
                gu = graph_calls_ms([lambda r=r: new._decode_gate_up(r[0], q13, r[1].reshape(-1).contiguous(), r[2],
                                                                      0, cfg, s13, None, b13, ACT) for r in routes])
                dn = graph_calls_ms([lambda r=r, i=i: new._decode_down(i, q2, r[1].reshape(-1).contiguous(), r[2], 0,
                                                                        cfg, s2, None, b2, ACT, out_dtype=r[0].dtype)
                                     for r, i in zip(routes, inters)])
            except Exception as exc:  # a config the compiler refuses: noted, the sweep goes on
                row = f"| {t} | {label} | failed: {type(exc).__name__}: {str(exc)[:100]} | | | | | | |"
                lines.append(row)
                print(row, flush=True)
                continue
            results.append((op, label, gu, dn))
            default_ms = results[0][0] if results[0][1] == "default" else float("nan")
            gbs = hit * per_expert / (op * 1e-3) / 1e9
            row = (f"| {t} | {label} | {op:.3f} | {gu:.3f} | {dn:.3f} | {bf16 / op:.2f}x | {default_ms / op:.2f}x | "
                   f"{gbs:.0f} ({100 * gbs / bw:.0f}%) | {err:.1e}{'' if err < 1e-2 else ' !'} |")
            lines.append(row)
            print(row, flush=True)
            flush()
        if results:
            op, label, gu, dn = min(results)
            by_gu, by_dn = min(results, key=lambda r: r[2]), min(results, key=lambda r: r[3])
            best_lines.append(f"- {t} tokens: best op `{label}` {op:.3f} ms (bf16 {bf16:.3f}, sorted {srt:.3f}, "
                              f"default {results[0][0]:.3f}); best gate|up `{by_gu[1]}` {by_gu[2]:.3f} ms, "
                              f"best down `{by_dn[1]}` {by_dn[3]:.3f} ms")
            print(best_lines[-1], flush=True)
        flush()
    return lines + [""] + best_lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="the previous kernels/fused_moe.py")
    ap.add_argument("--models", nargs="+", default=["gpt-oss-120b", "gpt-oss-20b"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--decode-sweep", action="store_true", help="the decode configs per pass (decode_sweep.md)")
    ap.add_argument("--sweep-tokens", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--no-rows", action="store_true", help="skip the bf16 / old / new rows (mxfp4.md)")
    args = ap.parse_args()
    old = load_old(args.old)
    bw = copy_gbs()
    card = torch.cuda.get_device_name()
    lines = [f"{card}, torch {torch.__version__}, same-run copy bandwidth {bw:.0f} GB/s (1 GiB device-to-device, "
             f"read + write). gpt-oss expert layer (biases, clamped SwiGLU), bf16 activations, fused_moe on routed "
             f"ids, default tiles, do_bench medians with L2 flushed. GB/s and % of copy: MXFP4 new.", "",
             "| model | tokens | experts hit | bf16 ms | old MXFP4 ms | new MXFP4 ms | new vs bf16 | new vs old | "
             "new GB/s (% copy) | in a CUDA graph: bf16 / old / new ms | err old / new | graph |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|"]
    sweep = ["| model | tokens | path | tiles | ms |", "|---|---:|---|---|---:|"]
    for name in [] if args.no_rows else args.models:  # one model's weights at a time (freed when model_rows returns)
        model_rows(name, args, old, bw, lines, sweep)
        torch.cuda.empty_cache()
    if args.decode_sweep:  # after the rows: a cut run still has them
        decode_sweep(args, bw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
