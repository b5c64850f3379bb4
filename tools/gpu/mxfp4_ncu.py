"""gpt-oss-120b's MXFP4 decode GEMVs at one token: a few launch-shape variants timed in CUDA graphs,
and a plain loop for Nsight Compute to attach to (tools/gpu/mxfp4_ncu.sh).

    python tools/gpu/mxfp4_ncu.py time --out FILE     # the variants, ms per layer call, in CUDA graphs
        [--fused-moe PATH ...]                         # + other fused_moe.py files' defaults, same run
    python tools/gpu/mxfp4_ncu.py loop [--knobs JSON] [--fused-moe PATH]  # 12 eager calls (for ncu)

Random packed experts of the published shapes (E = 128, H = I = 2880, top-4, biases, the clamped
SwiGLU); each graph replays 20 calls with 20 different routings, so the experts read are not the
ones L2 holds from the call before.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from mxfp4_kernel import ACT, load_old  # this folder's: the script's own directory is on sys.path

from pdserve.bench.moe import graph_call_ms
from pdserve.kernels import fused_moe as fm

E, H, I, TOP_K = 128, 2880, 2880, 4
# Launch-shape knobs over moe_decode_config's MXFP4 default, one hypothesis each.
VARIANTS = {
    "default": {},
    "gate|up prefetch": dict(GU_PREFETCH=True),
    "gate|up 8 warps": dict(GU_WARPS=8),
    "gate|up 8 rows, 2 warps": dict(GU_BLOCK_N=8, GU_WARPS=2),
    "down 32 rows split 4": dict(DOWN_BLOCK_N=32, DOWN_SPLIT_K=4),
    # More rows a thread: each thread's activations reused over its rows (x's loads are 4x the
    # weights' bytes through L1 at 16 rows), K split to keep the program count.
    "gate|up 32 rows": dict(GU_BLOCK_N=32),
    "gate|up 32 rows split 2": dict(GU_BLOCK_N=32, GU_SPLIT_K=2),
    "gate|up 32 rows split 3": dict(GU_BLOCK_N=32, GU_SPLIT_K=3),
    "gate|up 64 rows split 4": dict(GU_BLOCK_N=64, GU_SPLIT_K=4),
    "gate|up 64 rows split 2, 8 warps": dict(GU_BLOCK_N=64, GU_SPLIT_K=2, GU_WARPS=8),
    "down 32 rows split 2": dict(DOWN_BLOCK_N=32, DOWN_SPLIT_K=2),
    "down 64 rows split 4": dict(DOWN_BLOCK_N=64, DOWN_SPLIT_K=4),
    "down 64 rows split 8": dict(DOWN_BLOCK_N=64, DOWN_SPLIT_K=8),
    "down 32 rows split 3": dict(DOWN_BLOCK_N=32, DOWN_SPLIT_K=3),
}


def layer():
    dev = "cuda"
    w13 = torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, device=dev)
    s13 = torch.randint(119, 124, (E, 2 * I, H // 32), dtype=torch.uint8, device=dev)
    w2 = torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, device=dev)
    s2 = torch.randint(119, 124, (E, H, I // 32), dtype=torch.uint8, device=dev)
    b13 = torch.randn(E, 2 * I, device=dev, dtype=torch.bfloat16) * 0.1
    b2 = torch.randn(E, H, device=dev, dtype=torch.bfloat16) * 0.1
    return w13, s13, w2, s2, b13, b2


def call(weights, x, ids, topw, knobs, fm=fm):
    w13, s13, w2, s2, b13, b2 = weights
    cfg = dict(fm.moe_decode_config(TOP_K, I, mxfp4=True, tokens=1), **knobs)
    return fm.fused_moe(x, w13, w2, topw, ids, config=cfg, path="decode", w13_scale=s13, w2_scale=s2,
                        w13_bias=b13, w2_bias=b2, activation=ACT)


def routings(n: int):
    g = torch.Generator().manual_seed(0)
    ids = [torch.randperm(E, generator=g)[:TOP_K].view(1, TOP_K).to(torch.int32).cuda() for _ in range(n)]
    topw = torch.full((1, TOP_K), 0.25, device="cuda")
    return ids, topw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("time", "loop"))
    ap.add_argument("--knobs", default="{}", help="JSON knobs over the default (loop)")
    ap.add_argument("--out")
    ap.add_argument("--fused-moe", action="append", default=[], help="another kernels/fused_moe.py (time)")
    args = ap.parse_args()
    weights = layer()
    x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    ids, topw = routings(20)
    if args.mode == "loop":
        knobs, mod = json.loads(args.knobs), load_old(args.fused_moe[0]) if args.fused_moe else fm
        for r in range(12):
            call(weights, x, ids[r], topw, knobs, mod)
        torch.cuda.synchronize()
        return
    ref = call(weights, x, ids[0], topw, {}).float()
    lines = [f"{torch.cuda.get_device_name()}, gpt-oss-120b layer, 1 token, ms a call (20 routings a CUDA graph)", "",
             "| variant | knobs | ms | vs default | rel. err vs default |", "|---|---|---:|---:|---:|"]
    runs = [(name, knobs, fm) for name, knobs in VARIANTS.items()]
    runs += [(os.path.basename(path), {}, load_old(path)) for path in args.fused_moe]
    base = None
    for name, knobs, mod in runs:
        try:
            t = graph_call_ms(lambda r, k=knobs, m=mod: call(weights, x, ids[r], topw, k, m), 20)
            out = call(weights, x, ids[0], topw, knobs, mod).float()
            err = ((out - ref).norm() / ref.norm()).item()
            base = base or t
            lines.append(f"| {name} | {json.dumps(knobs)} | {t:.4f} | {base / t:.2f}x | {err:.1e} |")
        except Exception as e:  # a variant the kernel cannot run: said, the rest go on
            lines.append(f"| {name} | {json.dumps(knobs)} | failed: {type(e).__name__}: {str(e)[:80]} | | |")
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
