"""KV transfer benchmark: GB/s and fixed per-request cost by size, NIXL and TCP, vs a torch copy.

A "prefill" process owns a KV cache and pins block ranges; this process plays the decode
worker and pulls them through the real KVConnector (side channel, leases, releases and all).
The baseline is a plain torch copy of the same number of bytes on the same device(s), measured
in the same run. Contiguous block runs (one descriptor) and scattered blocks (one descriptor
per block) are both measured, since allocation order decides which a real request gets.

    python -m pdserve.bench.kv_transfer --device cpu
    python -m pdserve.bench.kv_transfer --device cuda            # one GPU: VRAM -> VRAM
    python -m pdserve.bench.kv_transfer --device cuda --cross-gpu  # cuda:0 -> cuda:1
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

MiB = 1 << 20
BENCH_DIGEST = "0" * 32  # pins are bound to a prompt digest; the bench's pins have no prompt


def _config(transport: str, port: int):
    from pdserve.worker.config import EngineConfig

    return EngineConfig(role="prefill", kv_transfer=transport, kv_host="127.0.0.1", kv_port=port, kv_pin_ttl=3600,
                        kv_pull_timeout=120)


def _server(transport, port, device, num_blocks, block_bytes, plan, conn):
    """Prefill side: pin every planned request, send their params, serve until told to stop."""
    from pdserve.worker.kv.connector import KVConnector

    cache = torch.randint(0, 255, (num_blocks, block_bytes), dtype=torch.uint8, device=device)
    c = KVConnector(_config(transport, port), cache, f"bench-server-{transport}", "bench")
    c.start_server()
    params = []
    for i, block_ids in enumerate(plan):
        p = c.pin(f"r{i}", block_ids, len(block_ids), 0, BENCH_DIGEST)
        params.append(p)
    conn.send(params)
    conn.recv()  # stop
    c.shutdown()


def _block_counts(sizes_mib, block_bytes) -> list[int]:
    # A one-block pull first: its time is the per-request fixed cost, near enough.
    return [1] + [max(1, mib * MiB // block_bytes) for mib in sizes_mib]


def _plan(sizes_mib, block_bytes, iters, scattered):
    plan = []
    stride = 2 if scattered else 1
    for n in _block_counts(sizes_mib, block_bytes):
        plan += [list(range(0, n * stride, stride))] * iters
    return plan


def _torch_copy_gbps(nbytes, src_dev, dst_dev, iters) -> float:
    # Filled first so the timed copies measure bandwidth, not first-touch page faults.
    src = torch.ones(nbytes, dtype=torch.uint8, device=src_dev)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=dst_dev)
    times = []
    for _ in range(iters + 1):
        if dst.is_cuda or src.is_cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        if dst.is_cuda or src.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times[1:]) / 1e9


def bench_transport(transport, sizes_mib, block_bytes, iters, scattered, server_dev, client_dev):
    from pdserve.worker.kv.connector import KVConnector
    from pdserve.worker.config import EngineConfig

    max_blocks = max(1, max(sizes_mib) * MiB // block_bytes) * (2 if scattered else 1)
    plan = _plan(sizes_mib, block_bytes, iters, scattered)
    port = 20000 + os.getpid() % 20000
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_server, args=(transport, port, server_dev, max_blocks, block_bytes, plan, child))
    proc.start()
    try:
        while not parent.poll(1.0):  # a server that died (e.g. UCX refused its UCX_TLS) must not hang us
            if not proc.is_alive():
                raise RuntimeError(f"the {transport} server process exited with {proc.exitcode} before it was ready")
        params = parent.recv()
        cache = torch.zeros(max_blocks, block_bytes, dtype=torch.uint8, device=client_dev)
        cfg = EngineConfig(role="decode", kv_transfer=transport, kv_port=port + 1, kv_pull_timeout=120,
                           kv_peer_allow=("127.0.0.1",))
        c = KVConnector(cfg, cache, f"bench-client-{transport}", "bench")
        # Warm-up: the first NIXL pull also fetches and adds the peer's agent metadata.
        warm = c.pin("warm", [0], 1, 0, BENCH_DIGEST)  # a local pin just to get a well-formed params dict shape
        c.pins.release("warm", warm["transfer_token"])
        rows, k = [], 0
        for _ in _block_counts(sizes_mib, block_bytes):
            times = []
            for _ in range(iters):
                p = params[k]
                k += 1
                n = len(p["remote_block_ids"])
                dst = list(range(0, n * (2 if scattered else 1), 2 if scattered else 1))
                if client_dev != "cpu":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                c._pull(p, list(range(n)), dst, BENCH_DIGEST)
                if client_dev != "cpu":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            nbytes = len(params[k - 1]["remote_block_ids"]) * block_bytes
            # Skip the first iteration (connection / agent setup) when there is more than one.
            steady = times[1:] if len(times) > 1 else times
            rows.append((nbytes, statistics.median(steady)))
        c.shutdown()
        return rows
    finally:
        parent.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def fixed_cost_ms(rows) -> float:
    """A one-block pull's time less its bytes at the largest transfer's bandwidth."""
    (one_bytes, one_s), (big_bytes, big_s) = rows[0], rows[-1]
    return max(0.0, one_s - one_bytes * big_s / big_bytes) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench kv-transfer", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--cross-gpu", action="store_true", help="server on cuda:0, client on cuda:1")
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    ap.add_argument("--block-kib", type=int, default=256, help="bytes per KV block (all layers), KiB")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--transports", nargs="+", default=["nixl", "tcp"], choices=("nixl", "tcp"))
    ap.add_argument("--ucx-tls", default=None,
                    help="set UCX_TLS for both sides (e.g. cuda_ipc,cuda_copy,tcp for VRAM->VRAM on one host)")
    args = ap.parse_args(argv)
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls  # inherited by the spawned prefill process
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device visible")
    if args.cross_gpu and torch.cuda.device_count() < 2:
        ap.error("--cross-gpu needs two GPUs")
    server_dev = "cuda:0" if args.device == "cuda" else "cpu"
    client_dev = ("cuda:1" if args.cross_gpu else "cuda:0") if args.device == "cuda" else "cpu"
    block_bytes = args.block_kib * 1024
    card = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    print(f"# KV transfer: {server_dev} -> {client_dev} ({card}), block {args.block_kib} KiB, "
          f"{args.iters} iters (median, first excluded), torch {torch.__version__}, "
          f"UCX_TLS={os.environ.get('UCX_TLS', '(default)')}, "
          f"UCX_CUDA_IPC_ENABLE_GET_ZCOPY={os.environ.get('UCX_CUDA_IPC_ENABLE_GET_ZCOPY', '(pdserve: y on CUDA)')}, "
          f"{time.strftime('%Y-%m-%d')}")
    results = {}
    for transport in args.transports:
        for scattered in (False, True):
            label = f"{transport}{' scattered' if scattered else ''}"
            print(f"  measuring {label} ...", file=sys.stderr, flush=True)
            results[label] = bench_transport(transport, args.sizes_mib, block_bytes, args.iters, scattered,
                                             server_dev, client_dev)
    labels = list(results)
    print("| size | torch copy GB/s | " + " | ".join(f"{l} GB/s (% of copy)" for l in labels) + " |")
    print("|---" * (2 + len(labels)) + "|")
    for i in range(len(args.sizes_mib) + 1):
        nbytes = results[labels[0]][i][0]
        copy = _torch_copy_gbps(nbytes, server_dev, client_dev, args.iters)
        cells = []
        for l in labels:
            gbps = results[l][i][0] / results[l][i][1] / 1e9
            cells.append(f"{gbps:.2f} ({100 * gbps / copy:.0f}%)")
        size = f"{nbytes / MiB:.0f} MiB" if nbytes >= MiB else f"{nbytes // 1024} KiB (1 block)"
        print(f"| {size} | {copy:.2f} | " + " | ".join(cells) + " |")
    print("| fixed cost per request (ms) | - | " + " | ".join(f"{fixed_cost_ms(results[l]):.2f}" for l in labels) + " |")
    print("| 1-block pull latency (ms) | - | " + " | ".join(f"{results[l][0][1] * 1e3:.2f}" for l in labels) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
