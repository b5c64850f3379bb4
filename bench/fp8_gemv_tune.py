"""Measure kernels/fp8_gemv.py's tiles per shape on this card: the table fp8_gemv_configs.py holds.

    pdserve bench fp8-gemv-tune --out tune.md --json tune.json [--shapes llama-3.1-8b] [--formats block]

For each linear shape (Llama-3.1-8B at TP=1 and TP=2 by default; DeepSeek-V3's FP8 linears outside
the routed experts with `--shapes deepseek-v3`), each scale format asked for (per-channel,
128-column groups) and M = 1 and M = 8 (and 64 with `--m 64`, beside the W8A8 GEMM the engine runs
past 16 rows): every tile of a sweep (row block, K step,
K split) is timed as the engine runs it, in a CUDA graph with the weight's copies rotated past L2
(triton.testing.do_bench median of the replays); the fastest goes to the JSON (at 64 rows only
where it beat W8A8 by 10%: the engine takes the GEMV past 16 rows for the shapes the table holds), beside
bf16 F.linear (cuBLAS) and the rule's default in the markdown table, with the weight bytes per
microsecond against this run's copy bandwidth. Paste the JSON's card entry into
kernels/fp8_gemv_configs.py (or pass it to bench/fp8.py --gemv-configs).
`--block-tiles`: past 16 rows, also the Triton GEMM's tiles and K splits in a second table
(kernels/fp8_block_gemm.py: group scales, what the W8A8 column runs with its rule's choice;
per-channel, fp8_rowwise_gemm, against the W8A8 column's torch._scaled_mm).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys

import torch

# A 64-row tile is kept where the GEMV takes at most this share of W8A8's time: the W8A8 column
# quantizes its own input, which the engine may fuse into the norm / SiLU·mul before the linear
# (a few us at 64 rows), so a narrower win may be none in the engine.
W8A8_MARGIN = 0.9

SHAPES = {  # name -> {linear: (N, K)}
    "llama-3.1-8b": {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
                     "down_proj": (4096, 14336)},
    "llama-3.1-8b-tp2": {"qkv_proj": (3072, 4096), "o_proj": (4096, 2048), "gate_up_proj": (14336, 4096),
                         "down_proj": (4096, 7168)},
    # The FP8 GEMVs of a DeepSeek-V3 decode step at TP=1 (the routed experts go through the MoE
    # op): MLA's projections, the shared expert and the first layers' dense MLP.
    "deepseek-v3": {"q_a_proj": (1536, 7168), "q_b_proj": (24576, 1536), "kv_a_proj_with_mqa": (576, 7168),
                    "o_proj": (7168, 16384), "shared_gate_up_proj": (4096, 7168), "shared_down_proj": (7168, 2048),
                    "dense_gate_up_proj": (36864, 7168), "dense_down_proj": (7168, 18432)},
}


# The Triton block GEMM's tiles at decode batches (--block-tiles): row x column block, K slices.
BLOCK_GEMM_SWEEP = [dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=4, num_stages=3, SPLIT_K=sk)
                    for (bm, bn), sk in itertools.product(((64, 64), (32, 64), (64, 128)), (1, 2, 3, 4, 6, 8))]


def sweep(blocked: bool, m: int = 1) -> list[dict]:
    # Group scales take steps of more than one 128-column group at one row only (fp8_gemv.wide_fits);
    # past 16 rows the x tile is 32-64 rows, and 512-column steps would not fit shared memory.
    steps = ((64, 128, 512) if m == 1 else (64, 128)) if blocked else (128, 256, 512) if m <= 16 else (64, 128, 256)
    tiles = list(itertools.product((16, 32, 64), steps, (1, 2, 4, 8, 16)))
    if m == 1:
        # Narrow strips with long K steps (one row only: the M > 1 path's dot needs 16 rows): many
        # small programs keep more loads in flight; the bf16 GEMV's 2 x 1024 strips beat cuBLAS on an
        # H200 (docs/results/gemv/2026-12-04-h200-narrow-gemv.md), as they do per-channel FP8.
        narrow = (128, 512, 1024) if blocked else (512, 1024)
        tiles += list(itertools.product((2, 4, 8), narrow, (1, 2)))
    configs = [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=s, num_warps=4, num_stages=3) for bn, bk, s in tiles]
    if m == 1:
        # Narrow strips are few elements per thread at 4 warps: other warp counts and deeper
        # pipelines for them (the H100's first table had every best at 4 warps / 3 stages, the only
        # ones tried).
        configs += [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=s, num_warps=w, num_stages=st)
                    for bn, bk, s in itertools.product((2, 4, 8), narrow, (1, 2))
                    for w, st in ((2, 3), (8, 3), (4, 4), (4, 6))]
        # At bs=1 the second launch that sums a split's slices costs about what a slice's reads do:
        # each split tile also with the slices summed by the strip's last program (one launch).
        configs += [dict(c, REDUCE_IN_KERNEL=True) for c in configs if c["SPLIT_K"] > 1]
        # And each with its first weight tile loaded before the PDL wait (overlapping the kernel before).
        configs += [dict(c, EARLY_W=True) for c in configs]
    return configs


def w8a8_linear(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, scale_rows: int | None,
                tiles: dict | None = None) -> torch.Tensor:
    """What an FP8 linear runs past the GEMV's rows, below cuBLASLt's block scaling: the activations
    quantized (per token; per token and 128 columns for group scales), then _scaled_mm row-wise
    (per-channel scale [1, N]) or the Triton block GEMM (group scales). bf16 out. `tiles`: the
    Triton GEMM on these tiles, per-channel too (fp8_rowwise_gemm)."""
    from pdserve.kernels.fp8_block_gemm import fp8_block_gemm, fp8_rowwise_gemm
    from pdserve.kernels.fp8_quant import quantize_fp8

    if scale_rows is None:
        xq, xs = quantize_fp8(x)
        if tiles is not None:
            return fp8_rowwise_gemm(xq, xs, w8, scale, torch.bfloat16, tiles=tiles)
        return torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=scale, out_dtype=torch.bfloat16)
    xq, xs = quantize_fp8(x, 128)
    return fp8_block_gemm(xq, xs, w8, scale, scale_rows, torch.bfloat16, tiles=tiles)


def block_tile_rows(name: str, n: int, k: int, m: int, x, w8s, ss, rows, t_rule: float, us) -> list[str]:
    """Each of BLOCK_GEMM_SWEEP's tiles for the Triton GEMM at m rows, quantization included: group
    scales (rows: 128 or 1) on fp8_block_gemm, per-channel (rows None) on fp8_rowwise_gemm."""
    fmt = "channel" if rows is None else "block"
    out = []
    for cfg in BLOCK_GEMM_SWEEP:
        label = (f"{fmt} m={cfg['BLOCK_M']} n={cfg['BLOCK_N']} stages={cfg['num_stages']} "
                 f"split_k={cfg['SPLIT_K']}")
        try:
            t = us(lambda i, c=cfg: lambda: w8a8_linear(x, w8s[i], ss[i], rows, tiles=c))
        except Exception as e:  # a tile this card cannot run: said, skipped
            out.append(f"| {name} {n}x{k} | {m} | {t_rule:.1f} | {label} FAILED {type(e).__name__} | | |")
            continue
        out.append(f"| {name} {n}x{k} | {m} | {t_rule:.1f} | {label} | {t:.1f} | {t_rule / t:.2f}x |")
    return out


def graph_us(make, copies: int, reps: int = 4) -> float:
    """GPU microseconds of one call, as the engine runs it: captured in a CUDA graph (no host
    launch time), each call on its own copy of the weight (`make(i)` -> a call on copy i), enough
    copies that they do not all fit in L2 (a decode step reads each weight once)."""
    from triton.testing import do_bench

    calls = [make(i) for i in range(copies)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the graph
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for f in calls:
                f()
    return 1e3 * do_bench(graph.replay, warmup=3, rep=30, return_mode="median") / (reps * copies)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench fp8-gemv-tune", description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--formats", nargs="+", default=["channel", "block"], choices=["channel", "block"],
                    help="the scale formats to tune (DeepSeek's checkpoints are block FP8 only)")
    ap.add_argument("--m", nargs="+", type=int, default=[1, 8], choices=[1, 8, 64, 96],
                    help="the batch rows to tune (1: bs=1 decode; 8 stands for 2-16, 64 for 17-64; 96, past the "
                         "GEMV's rows: the --block-tiles table only)")
    ap.add_argument("--out", help="the markdown table")
    ap.add_argument("--json", help="the measured tiles, {card: {key: config}}")
    ap.add_argument("--no-gemv", action="store_true",
                    help="with --block-tiles: only the W8A8 tables (no GEMV sweep, no tiles written)")
    ap.add_argument("--block-tiles", action="store_true",
                    help="past 16 rows: also sweep the Triton W8A8 GEMM's tiles and K splits (both scale formats)")
    args = ap.parse_args(argv)
    if 96 in args.m and not args.block_tiles:
        ap.error("--m 96 is past the GEMV's 64 rows: it times the Triton W8A8 tiles only, with --block-tiles")
    if args.no_gemv and not args.block_tiles:
        ap.error("--no-gemv leaves only the --block-tiles table: give --block-tiles")
    if not torch.cuda.is_available():
        print("fp8_gemv_tune needs a CUDA GPU", file=sys.stderr)
        return 2
    import torch.nn.functional as F
    import triton
    from pdserve.bench.kernels import copy_bandwidth
    from pdserve.kernels import fp8_gemv as g
    from pdserve.kernels.reference import quantize_fp8_blocks_ref, quantize_fp8_rows_ref
    from pdserve.worker.quantization.fp8_linear import FP8_GEMV_MAX_M  # every layer's GEMV rows

    def us(make) -> float:
        return graph_us(make, copies)

    card, bw = torch.cuda.get_device_name(), copy_bandwidth()
    g.use_configs({})  # the rule's default, not an earlier table, is the baseline here
    lines = [
        f"fp8_gemv tiles, {card}, triton {triton.__version__}, {datetime.date.today()}, copy bandwidth "
        f"{bw / 1e9:.0f} GB/s. us: GPU time per call in a CUDA graph, weights rotated past L2 (do_bench medians); GB/s: the FP8 weight's bytes / time.",  # noqa: E501
        "",
        "| shape | linear (N x K) | scales | M | bf16 cuBLAS | W8A8 | default tiles | best tiles | best "
        "| GB/s (% copy) | best without the one-launch sum or the early weight load |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: |",
    ]
    table: dict[str, dict] = {}
    block_lines = ["", "The Triton W8A8 GEMM past 16 rows, activation quantization included (us, as above; "
                   "W8A8: the engine's path, group scales on this GEMM by its rule, kernels/fp8_block_gemm._tiles "
                   "and _split_k; per-channel: torch._scaled_mm):", "",
                   "| linear (N x K) | M | W8A8 | tiles | us | vs W8A8 |",
                   "| --- | ---: | ---: | --- | ---: | ---: |"]
    for shape in args.shapes:
        for name, (n, k) in SHAPES[shape].items():
            # Copies of the weight past L2 (60 MB on an H200): bf16's 2 bytes and FP8's 1 per element.
            copies = max(2, -(-256 * 2**20 // (n * k)))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            quantizers = {"channel": lambda w: (*quantize_fp8_rows_ref(w), None),
                          "block": lambda w: (*quantize_fp8_blocks_ref(w), 128)}
            formats = {fmt: [quantizers[fmt](w) for w in ws] for fmt in args.formats}
            for (fmt, quantized), m in itertools.product(formats.items(), args.m):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                rows = quantized[0][2]
                blocked = rows is not None
                w8s = [q[0] for q in quantized]
                ss = [q[1] if blocked else q[1].reshape(1, -1).contiguous() for q in quantized]
                t_bf16 = us(lambda i: lambda: F.linear(x, ws[i]))
                # Past 16 rows, what the engine ran instead: the activations quantized, then the
                # W8A8 GEMM (per-channel: _scaled_mm row-wise; group scales: the Triton block GEMM,
                # which the engine keeps below fp8_linear.SCALED_MM_BLOCK_MIN_M rows).
                t_w8a8 = float("nan")
                if m > FP8_GEMV_MAX_M:
                    t_w8a8 = us(lambda i: lambda: w8a8_linear(x, w8s[i], ss[i], rows))
                if args.block_tiles and m > FP8_GEMV_MAX_M:
                    new_rows = block_tile_rows(name, n, k, m, x, w8s, ss, rows, t_w8a8, us)
                    block_lines.extend(new_rows)
                    print("\n".join(new_rows), flush=True)
                if args.no_gemv or m > g.MAX_M:
                    continue
                t_default = us(lambda i: lambda: g.fp8_gemv(x, w8s[i], ss[i], rows))
                best = (t_default, g.default_config(n, k, blocked, m, g.num_sms(x.device)))
                plain = best[0]  # the best without the one-launch sum and the early weight load
                for cfg in sweep(blocked, m):
                    try:
                        t = us(lambda i, c=cfg: lambda: g.fp8_gemv(x, w8s[i], ss[i], rows, config=c))
                    except Exception as e:  # a tile this card cannot run: said, skipped
                        print(f"{name} {fmt} M={m} {cfg}: {type(e).__name__}: {e}"[:200], flush=True)
                        continue
                    best = min(best, (t, cfg), key=lambda b: b[0])
                    if not cfg.get("REDUCE_IN_KERNEL") and not cfg.get("EARLY_W"):
                        plain = min(plain, t)
                # Past 16 rows a tile is kept only where the GEMV beat W8A8 by W8A8_MARGIN: the engine
                # takes the GEMV there for exactly the shapes the table holds (fp8_gemv.measured_batch_rows).
                if m <= FP8_GEMV_MAX_M or best[0] < W8A8_MARGIN * t_w8a8:
                    table[g.config_key(n, k, blocked, m)] = best[1]
                else:
                    print(f"{name} {fmt} M={m}: the GEMV's {best[0]:.1f} us against W8A8's {t_w8a8:.1f}: "
                          "no tile kept", flush=True)
                gbs = n * k / (best[0] * 1e-6) / 1e9
                tiles = " ".join(
                    f"{key.replace('BLOCK_', '').replace('num_', '').lower()}={v}" for key, v in best[1].items()
                )
                lines.append(f"| {shape} | {name} {n}x{k} | {fmt} | {m} | {t_bf16:.1f} | {t_w8a8:.1f} | "
                             f"{t_default:.1f} | {tiles} | {best[0]:.1f} | {gbs:.0f} ({100 * gbs * 1e9 / bw:.0f}%) | "
                             f"{plain:.1f} |")
                print(lines[-1], flush=True)
            del ws, formats
            torch.cuda.empty_cache()
    if len(block_lines) > 5:
        lines += block_lines
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({card: table}, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
