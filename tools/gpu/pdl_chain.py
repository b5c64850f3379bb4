"""Does programmatic dependent launch (PDL) shorten a bs=1 decode step's chain of GEMVs?

A decode step at batch 1 is a chain of small kernels, each of which waits for the one before it to
drain, then ramps up its own loads. With PDL (sm90+: `launch_pdl=True`, `griddepcontrol`), a
kernel's programs may start while the previous kernel ends; everything a GEMV reads before
`gdc_wait()` must not depend on that kernel, and its weights never do. So each GEMV here can load
its first weight tile while the previous one still runs, and only the activations wait.

    python tools/gpu/pdl_chain.py [--models qwen2.5-0.5b llama-3.1-8b] [--out FILE]

For each model's layer shapes (qkv, o, gate_up, down; distinct random weights per layer, L layers:
more bytes than L2 holds), one CUDA graph of the whole chain (each GEMV reads the one before's
output), timed as triton's do_bench median of replays, as:
  cublas      F.linear (what the engine runs at these shapes)
  triton      this file's GEMV, launched plainly
  pdl-wait    the same kernel with PDL, everything after gdc_wait (launch overlap only)
  pdl-pre     PDL, the first weight tile loaded before gdc_wait
against the bytes over the same run's copy bandwidth. The PDL chains must equal the plain Triton
chain bit for bit (a broken ordering would read a stale activation).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

SHAPES = {  # (N, K) of qkv, o, gate_up, down; layers
    "qwen2.5-0.5b": ([(1152, 896), (896, 896), (9728, 896), (896, 4864)], 24),
    "llama-3.1-8b": ([(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)], 32),
}


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, N, K, K_TILES, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          PDL: tl.constexpr, PRE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    rmask = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    if PDL:
        # Every program of this kernel is resident from here, so the next kernel may be launched:
        # its programs only wait (gdc_wait) for this one's memory before reading what it wrote.
        tl.extra.cuda.gdc_launch_dependents()
    if PRE:
        w0 = tl.load(w_rows + cols[None, :], mask=rmask[:, None] & (cols[None, :] < K), other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BLOCK_N], tl.float32)
    if PRE:
        x0 = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
        acc += tl.sum(w0.to(tl.float32) * x0.to(tl.float32)[None, :], 1)
    for t in range(PRE, K_TILES):
        c = t * BLOCK_K + cols
        w = tl.load(w_rows + c[None, :], mask=rmask[:, None] & (c[None, :] < K), other=0.0)
        x = tl.load(x_ptr + c, mask=c < K, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=rmask)


def gemv(x, w, y, cfg, pdl: bool, pre: bool):
    n, k = w.shape
    bn, bk = cfg
    _gemv[(triton.cdiv(n, bn),)](x, w, y, n, k, triton.cdiv(k, bk), BLOCK_N=bn, BLOCK_K=bk,
                                 PDL=pdl, PRE=int(pre), num_warps=4, launch_pdl=pdl)


def graph_ms(fn) -> float:
    from triton.testing import do_bench

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up / compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return do_bench(g.replay, warmup=10, rep=200, return_mode="median")


def copy_gbs() -> float:
    from triton.testing import do_bench

    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=5, rep=50, return_mode="median")
    return 2 * a.numel() / ms / 1e6


def best_config(w, x, y) -> tuple[int, int]:
    """The (BLOCK_N, BLOCK_K) of the plain kernel that times best alone on this shape (in a graph
    of 20 calls over distinct copies, so L2 does not hold the weights)."""
    n, k = w.shape
    ws = [w.clone() for _ in range(max(2, (256 << 20) // w.nbytes))]
    best = None
    for bn in (2, 4, 8, 16):
        for bk in (256, 512, 1024):
            if bn * bk > 16384:
                continue
            ms = graph_ms(lambda: [gemv(x, wi, y, (bn, bk), False, False) for wi in ws]) / len(ws)
            if best is None or ms < best[0]:
                best = (ms, (bn, bk))
    return best[1]


def chain(model: str, bw: float) -> list[str]:
    shapes, layers = SHAPES[model]
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    ws = [[torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for n, k in shapes] for _ in range(layers)]
    width = max(max(n, k) for n, k in shapes)
    bufs = [torch.zeros(width, device=dev, dtype=dt) for _ in range(4 * layers + 1)]
    bufs[0].normal_()
    x1 = torch.randn(width, device=dev, dtype=dt)
    cfgs = [best_config(w, x1, torch.empty(w.shape[0], device=dev, dtype=dt)) for w in ws[0]]

    def run(mode: str):
        i = 0
        for layer in ws:
            for j, w in enumerate(layer):
                n, k = w.shape
                x, y = bufs[i][:k], bufs[i + 1][:n]
                if mode == "cublas":
                    torch.mm(x.view(1, k), w.t(), out=y.view(1, n))
                else:
                    gemv(x, w, y, cfgs[j], pdl=mode.startswith("pdl"), pre=mode == "pdl-pre")
                i += 1

    total = sum(w.nbytes for layer in ws for w in layer)
    roof = 1e3 * total / bw  # ms at the copy bandwidth (bytes / s)
    rows, outs = [], {}
    for mode in ("cublas", "triton", "pdl-wait", "pdl-pre"):
        ms = graph_ms(lambda: run(mode))
        torch.cuda.synchronize()
        outs[mode] = bufs[-1].clone()
        rows.append((mode, ms))
    plain = outs["triton"]
    lines = [f"| {model} | {mode} | {4 * layers} | {ms:.3f} | {100 * roof / ms:.0f}% | {rows[1][1] / ms:.2f}x | "
             f"{'-' if mode == 'cublas' else ('yes' if torch.equal(outs[mode], plain) else 'NO')} |"
             for mode, ms in rows]
    lines.append(f"| {model} | roofline ({total / 1e9:.2f} GB) | | {roof:.3f} | | | |")
    lines.append(f"| {model} | tiles (BLOCK_N, BLOCK_K) qkv/o/gate_up/down | {cfgs} | | | | |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--out")
    args = ap.parse_args()
    bw = copy_gbs() * 1e9
    head = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
            f"same-run copy bandwidth {bw / 1e9:.0f} GB/s. One CUDA graph of the model's GEMV chain (bs=1).", "",
            "| model | chain | kernels | ms | % of copy | vs triton plain | = plain Triton chain |",
            "|---|---|---:|---:|---:|---:|---|"]
    print("\n".join(head), flush=True)
    lines = list(head)
    for m in args.models:
        for line in chain(m, bw):
            print(line, flush=True)
            lines.append(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
