"""Two processes on one GPU: how long does one's GPU work wait while the other computes?

The hand-off bench's one-card stacks run the prefill and the decode worker as two processes on one
card. Without MPS the GPU time-slices between their contexts, so work the decode process issues
(a NIXL READ's copies out of the prefill's IPC-mapped cache, a decode step) may wait while the
prefill process's kernels run. This measures that directly, without NIXL or an engine: process A
owns a buffer (shared with B by CUDA IPC, as UCX maps the prefill's cache) and, on command, keeps
the card busy with back-to-back bf16 GEMMs (a prefill step's shape of work); process B times a
tiny kernel and copies out of A's buffer with A idle and with A busy.

    python tools/gpu/timeslice.py [--busy-s 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

MiB = 1 << 20
SIZES_MIB = (1, 48, 376)  # a block group, a layer group of 3000 tokens of Llama-3.1-8B, all its KV


def owner(conn, nbytes: int, gemm: int) -> None:
    src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    a = torch.randn(gemm, gemm, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)
    torch.mm(a, a, out=out)
    torch.cuda.synchronize()
    conn.send(src)
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            return
        end = time.perf_counter() + cmd
        gemms = 0
        while time.perf_counter() < end:
            for _ in range(4):  # a few queued, then a sync: the card stays busy, the queue bounded
                torch.mm(a, a, out=out)
            gemms += 4
            if gemms == 4:
                conn.send("busy")
            torch.cuda.synchronize()
        conn.send(gemms)


def timed(fn, iters: int) -> float:
    """Median ms of fn() then a synchronize."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def measure(src: torch.Tensor, dst: torch.Tensor, tiny: torch.Tensor, iters: int) -> dict[str, float]:
    rows = {"tiny kernel (one add) + sync": timed(lambda: tiny.add_(1), iters)}
    for mib in SIZES_MIB:
        n = mib * MiB
        rows[f"copy {mib} MiB out of the other process's buffer"] = timed(lambda n=n: dst[:n].copy_(src[:n]), iters)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy-s", type=float, default=2.0, help="how long A keeps the card busy per row")
    ap.add_argument("--gemm", type=int, default=8192, help="A's square bf16 GEMM size")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a GPU")
    nbytes = max(SIZES_MIB) * MiB
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=owner, args=(child, nbytes, args.gemm), daemon=True)
    proc.start()
    try:
        src = parent.recv()
        dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        tiny = torch.zeros(1, device="cuda")
        measure(src, dst, tiny, 2)  # warm: IPC mapping, first launches
        idle = measure(src, dst, tiny, args.iters)
        # One busy period per row so each row's samples all fall inside it.
        busy, gemms = {}, []
        for row in idle:
            parent.send(args.busy_s)
            if parent.recv() != "busy":
                raise RuntimeError("A did not start its GEMMs")
            time.sleep(0.02)  # A's queue is full and running
            one = measure(src, dst, tiny, args.iters)
            busy[row] = one[row]
            gemms.append(parent.recv())
        gemm_ms = args.busy_s * 1e3 / (sum(gemms) / len(gemms))
        lines = [f"# Two processes on one {torch.cuda.get_device_name(0)}: B's work while A computes "
                 f"({time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__})", "",
                 f"A: back-to-back {args.gemm}x{args.gemm} bf16 GEMMs, ~{gemm_ms:.2f} ms each, 4 queued at a time; "
                 f"B: median of {args.iters}, ms (a synchronize after each).", "",
                 "| B's work | A idle | A busy | busy / idle |", "| --- | ---: | ---: | ---: |"]
        for row in idle:
            lines.append(f"| {row} | {idle[row]:.3f} | {busy[row]:.3f} | {busy[row] / idle[row]:.1f}x |")
        text = "\n".join(lines)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        del src
        torch.cuda.synchronize()
        return 0
    finally:
        parent.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
