"""Qwen3-30B-A3B's MoE decode layer with the down pass split over expert slots (DOWN_SPLIT_K on bf16
weights) against the one-program-per-strip down pass, in CUDA graphs; then the engine's bs=1 step
with a chosen variant (tools/gpu/moe_down_split.sh).

    python tools/gpu/moe_down_split.py time --out FILE [--best JSON]  # the variants at 1/2/4 tokens
    python tools/gpu/moe_down_split.py engine --knobs JSON ARGS   # bench/moe.py engine, knobs on bf16 decode

Random bf16 experts of the published shapes (E = 128, H = 2048, I = 768, top-8); each graph replays
20 calls with 20 different routings, so the experts read are not the ones L2 holds from the call
before.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from pdserve.bench import moe as bench_moe
from pdserve.kernels import fused_moe as fm

E, H, I, TOP_K = 128, 2048, 768, 8
VARIANTS = {
    "default (one program a strip)": {},
    "split 1": dict(DOWN_SPLIT_K=1),
    "split 1, 16 rows": dict(DOWN_SPLIT_K=1, DOWN_BLOCK_N=16),
    "split 1, 32 rows": dict(DOWN_SPLIT_K=1, DOWN_BLOCK_N=32),
    "split 1, 32 rows, 4 warps": dict(DOWN_SPLIT_K=1, DOWN_BLOCK_N=32, DOWN_WARPS=4),
    "split 1, 64 rows, 4 warps": dict(DOWN_SPLIT_K=1, DOWN_BLOCK_N=64, DOWN_WARPS=4),
    "split 1, 32 rows, K 128": dict(DOWN_SPLIT_K=1, DOWN_BLOCK_N=32, DOWN_BLOCK_K=128),
    "split 2, 32 rows": dict(DOWN_SPLIT_K=2, DOWN_BLOCK_N=32),
    "split 2, 64 rows": dict(DOWN_SPLIT_K=2, DOWN_BLOCK_N=64),
    "split 2, 16 rows, 4 warps": dict(DOWN_SPLIT_K=2, DOWN_BLOCK_N=16, DOWN_WARPS=4),
    # The partials summed by the last program to arrive, in the launch (no finish launch).
    "the one-token default, sum in the launch": dict(fm.BF16_ONE_TOKEN_DOWN, DOWN_REDUCE_HERE=True),
    "split 1, 16 rows, K 128, sum in the launch": dict(fm.BF16_ONE_TOKEN_DOWN, DOWN_BLOCK_N=16, DOWN_REDUCE_HERE=True),
    "split 2, 32 rows, sum in the launch": dict(DOWN_SPLIT_K=2, DOWN_BLOCK_N=32, DOWN_REDUCE_HERE=True),
}


def time_variants(out: str | None) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device="cuda", generator=g).bfloat16() * 0.02
    w2 = torch.randn(E, H, I, device="cuda", generator=g).bfloat16() * 0.02
    lines = [f"{torch.cuda.get_device_name()}, Qwen3-30B-A3B MoE layer (bf16), us a call (20 routings a CUDA graph)",
             "", "| variant | knobs | 1 token | 2 tokens | 4 tokens | rel. err vs default (4) |",
             "|---|---|---:|---:|---:|---:|"]
    gen = torch.Generator().manual_seed(0)
    routes = {t: [torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(t)]).int().cuda()
                  for _ in range(20)] for t in (1, 2, 4)}
    xs = {t: torch.randn(t, H, device="cuda", generator=g).bfloat16() for t in (1, 2, 4)}
    topw = {t: torch.full((t, TOP_K), 1.0 / TOP_K, device="cuda") for t in (1, 2, 4)}

    def call(t, r, knobs):
        cfg = dict(fm.moe_decode_config(TOP_K, I), **knobs)
        return fm.fused_moe(xs[t], w13, w2, topw[t], routes[t][r], config=cfg, path="decode")

    ref = call(4, 0, {}).float()
    best = (float("inf"), {})
    for name, knobs in VARIANTS.items():
        cells = [f"{1e3 * bench_moe.graph_call_ms(lambda r, t=t: call(t, r, knobs), 20):.1f}" for t in (1, 2, 4)]
        err = ((call(4, 0, knobs).float() - ref).norm() / ref.norm()).item()
        best = min(best, (float(cells[0]), knobs), key=lambda b: b[0])
        lines.append(f"| {name} | {json.dumps(knobs)} | " + " | ".join(cells) + f" | {err:.1e} |")
        print(lines[-1], flush=True)
    if out:
        with open(out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return best[1]


def main() -> None:
    mode = sys.argv[1]
    if mode == "time":
        ap = argparse.ArgumentParser()
        ap.add_argument("--out")
        ap.add_argument("--best", help="write the fastest variant's knobs at 1 token here (JSON)")
        args = ap.parse_args(sys.argv[2:])
        best = time_variants(args.out)
        if args.best:
            with open(args.best, "w") as f:
                json.dump(best, f)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--knobs", default="{}")
    known, rest = ap.parse_known_args(sys.argv[2:])
    knobs = json.loads(known.knobs)
    plain = fm.moe_decode_config

    def with_knobs(top_k, inter, group_k=None, fp8=False, mxfp4=False, tokens=None):
        cfg = plain(top_k, inter, group_k=group_k, fp8=fp8, mxfp4=mxfp4, tokens=tokens)
        return cfg if mxfp4 else dict(cfg, **knobs)

    fm.moe_decode_config = with_knobs
    sys.exit(bench_moe.main(["engine"] + rest))


if __name__ == "__main__":
    main()
