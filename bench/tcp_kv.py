"""KV over plain TCP (issue 30, not a test): pull throughput of the TCP data path against a raw
socket between the same two processes, the earlier inline TCP read, and NIXL over UCX's TCP.

Two processes per configuration: a "prefill" process owning a KV cache on --server-device and a
real KVConnector side channel (pins, lease, read), and a "decode" process on --client-device
pulling pinned blocks into its own cache. The cache has the real layout of Llama-3.1-8B in bf16
(32 layers x K,V x 16 tokens x 8 KV heads x 128: 2 MiB a block), and the pulls the `real` block
layout of bench/kv_transfer.py (the ids the BlockManager hands out after churn, both sides).

    raw          one TCP socket, sendall / recv_into of the same bytes host -> host (the limit
                 the issue names), and --raw-streams sockets at once
    tcp          tcp_pull over the data connections (tcp_stream.py), STREAMS streams
    tcp-inline   the earlier read: the block bytes in the side channel's reply
    nixl:<TLS>   NIXL READ with UCX_TLS=<TLS> in both processes (e.g. nixl:tcp, nixl:tcp,cuda_copy)

Each cell: median of --iters timed pulls after one warm-up, GB/s = bytes / wall time of the
pull (lease or read, bytes, device copies, synchronized). Also the device<->host copy rates
into page-locked memory on each side (what the pipeline overlaps with the wire).

    python -m pdserve.bench.tcp_kv --server-device cpu --client-device cpu --sizes-mib 8 32 --block-kib 256
    python -m pdserve.bench.tcp_kv --server-device cuda:0 --client-device cuda:1 --out tcp_kv.md
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from pdserve.bench.ports import free_ports
from pdserve.bench.report import publish
from pdserve.protocol.kv_layout import KVLayout

MiB = 1 << 20
DIGEST = "0" * 32
LAYERS, HEADS, DIM, BLOCK = 32, 8, 128, 16  # Llama-3.1-8B: 2 MiB per block in bf16


def _cache(num_blocks: int, block_kib: int, device: str) -> tuple[torch.Tensor, KVLayout]:
    if block_kib == 2048:
        shape, layout = (num_blocks, LAYERS, 2, BLOCK, HEADS, DIM), KVLayout(LAYERS, HEADS, DIM, "bfloat16", BLOCK)
    else:  # small blocks for a CPU smoke run: one layer, one token, one head
        shape, layout = (num_blocks, 1, 2, 1, 1, block_kib * 256), KVLayout(1, 1, block_kib * 256, "bfloat16", 1)
    cache = torch.empty(shape, dtype=torch.bfloat16, device=device)
    cache.view(torch.int16).random_(-30000, 30000)
    return cache, layout


def _config(transport: str, port: int, role: str):
    from pdserve.bench.kv_transfer import _config as bench_config

    return bench_config(transport, port, role, pull_timeout=30)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# -- the prefill process -----------------------------------------------------------------------------

def _prefill(transport, port, device, num_blocks, block_kib, env, conn):
    os.environ.update(env)
    from pdserve.worker.kv.connector import KVConnector

    bufs = {}
    cache, layout = _cache(num_blocks, block_kib, device)
    c = KVConnector(_config(transport, port, "prefill"), cache, f"bench-prefill-{os.getpid()}", layout)
    c.start_server()
    raw = socket.create_server(("127.0.0.1", 0))
    conn.send(("ready", raw.getsockname()[1]))
    n = 0
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        if msg[0] == "pin":
            n += 1
            conn.send(c.pin(f"r{n}", msg[1], len(msg[1]) * layout.block_size, 0, DIGEST))
        elif msg[0] == "raw":  # nbytes, streams: send them from page-locked memory on that many sockets
            nbytes, streams = msg[1], msg[2]
            if bufs.get(nbytes // streams) is None:
                bufs[nbytes // streams] = torch.empty(nbytes // streams, dtype=torch.uint8,
                                                      pin_memory=torch.cuda.is_available())
            buf = bufs[nbytes // streams]
            conn.send("armed")
            socks = [raw.accept()[0] for _ in range(streams)]
            threads = [threading.Thread(target=s.sendall, args=(memoryview(buf.numpy()),)) for s in socks]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for s in socks:
                s.close()
        elif msg[0] == "d2h":
            conn.send(_copy_rate(cache, msg[1], to_host=True))
    c.shutdown()


def _copy_rate(cache: torch.Tensor, nbytes: int, to_host: bool) -> float:
    if cache.device.type != "cuda":
        return float("nan")
    dev = cache.view(torch.uint8).view(-1)[:nbytes]
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(4):
        torch.cuda.synchronize(cache.device)
        t = time.perf_counter()
        (host.copy_(dev, non_blocking=True) if to_host else dev.copy_(host, non_blocking=True))
        torch.cuda.synchronize(cache.device)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times[1:]) / 1e9


# -- the decode process ------------------------------------------------------------------------------

def _decode(transport, port, device, num_blocks, block_kib, env, cases, plan, conn_out):
    """Pull every case; send back {label: [(bytes, seconds)...]} or an error string."""
    os.environ.update(env)
    from pdserve.worker.kv import tcp_transport
    from pdserve.worker.kv.connector import KVConnector

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_prefill, args=(transport, port, plan["server_device"], num_blocks, block_kib, env,
                                              child))
    proc.start()
    out: dict = {}
    try:
        while not parent.poll(1.0):
            if not proc.is_alive():
                raise RuntimeError(f"the prefill process exited with {proc.exitcode} before it was ready")
        _, raw_port = parent.recv()
        cache, layout = _cache(num_blocks, block_kib, device)
        c = KVConnector(_config(transport, port + 1, "decode"), cache, f"bench-decode-{os.getpid()}", layout)
        block_bytes = c.block_bytes

        def pin(ids):
            parent.send(("pin", ids))
            return parent.recv()

        for label, mode, streams in plan["modes"]:
            if mode == "raw":
                for src, _ in cases:
                    out.setdefault(label, []).append(_raw(parent, raw_port, len(src) * block_bytes, streams,
                                                          cache.device))
                continue
            tcp_transport.STREAMS = streams or tcp_transport.STREAMS
            for src, dst in cases:
                times = []
                for i in range(plan["iters"] + 1):
                    params = pin(src)
                    _sync(device)
                    t = time.perf_counter()
                    if mode == "nixl":
                        c._pull(params, list(range(len(src))), dst, DIGEST)
                    else:
                        tcp_transport.tcp_pull("127.0.0.1", params.remote_port, params,
                                               list(range(len(src))),
                                               dst, c.blocks, 30, c.auth, DIGEST, data_path=mode == "tcp")
                    _sync(device)
                    if i:  # the first pull of a size is a warm-up (connections, NIXL metadata, buffers)
                        times.append(time.perf_counter() - t)
                out.setdefault(label, []).append((len(src) * block_bytes, statistics.median(times)))
        parent.send(("d2h", 256 * MiB))
        out["_d2h"] = parent.recv()
        out["_h2d"] = _copy_rate(cache, 256 * MiB, to_host=False)
        c.shutdown()
    except Exception as e:
        out["_error"] = f"{type(e).__name__}: {e}"
    finally:
        parent.send(("stop",))
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    conn_out.send(out)


def _raw(parent, port: int, nbytes: int, streams: int, device) -> tuple[int, float]:
    """Host -> host over `streams` sockets: the prefill process sends, we recv_into page-locked memory."""
    times = []
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    view, part = memoryview(buf.numpy()), nbytes // streams
    for i in range(4):
        parent.send(("raw", nbytes, streams))
        parent.recv()  # armed: its buffer is ready, it accepts and sends
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(streams)]

        def recv(s, v):
            got = 0
            while got < len(v):
                got += s.recv_into(v[got:])

        t = time.perf_counter()
        threads = [threading.Thread(target=recv, args=(s, view[k * part:(k + 1) * part])) for k, s in enumerate(socks)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if i:
            times.append(time.perf_counter() - t)
        for s in socks:
            s.close()
    return nbytes, statistics.median(times)


# -- the run and its table -----------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.bench.tcp_kv", description=__doc__.splitlines()[0])
    ap.add_argument("--server-device", default="cpu")
    ap.add_argument("--client-device", default="cpu")
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 375, 1024])
    ap.add_argument("--block-kib", type=int, default=2048, help="2048: the real Llama-3.1-8B block")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--configs", default="raw,tcp,tcp-inline,nixl:tcp,nixl:tcp,cuda_copy",
                    help="comma-separated; nixl:<UCX_TLS> takes the rest of its item up to the next config name")
    ap.add_argument("--streams-sweep", type=int, nargs="*", default=[1, 2, 8], help="extra tcp rows (streams)")
    ap.add_argument("--raw-streams", type=int, default=4)
    ap.add_argument("--config-timeout-s", type=float, default=100.0, help="one configuration's limit")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from pdserve.bench.kv_transfer import churned_blocks

    block_bytes = args.block_kib * 1024
    sizes = [max(1, s * MiB // block_bytes) for s in args.sizes_mib]
    num_blocks = max(sizes) * 2 + 16
    cases = [(churned_blocks(num_blocks, n, 1), churned_blocks(num_blocks, n, 2)) for n in sizes]
    configs = _parse_configs(args.configs)
    rows, notes = {}, []
    for k, (name, env) in enumerate(configs):
        if name == "nixl":
            env = with_cuda_copy(env)
            modes = [(f"NIXL, UCX_TLS={env['UCX_TLS']}", "nixl", 0)]
            transport = "nixl"
        elif name == "raw":
            modes = [("raw socket, 1 stream", "raw", 1), (f"raw sockets, {args.raw_streams} streams", "raw",
                                                              args.raw_streams)]
            transport = "tcp"
        elif name == "tcp":
            from pdserve.worker.kv import tcp_stream, tcp_transport

            default = tcp_transport.STREAMS
            modes = [(f"TCP data path, {default} streams, {tcp_stream.CHUNK_BYTES // MiB} MiB chunks", "tcp",
                      default)]
            modes += [(f"TCP data path, {s} stream{'s' if s > 1 else ''}", "tcp", s) for s in args.streams_sweep]
            transport = "tcp"
        else:
            modes = [("TCP inline (before: bytes in the side-channel reply)", "tcp-inline", 0)]
            transport = "tcp"
        ctx = mp.get_context("spawn")
        a, b = ctx.Pipe()
        plan = {"server_device": args.server_device, "modes": modes, "iters": args.iters}
        t0 = time.monotonic()
        proc = ctx.Process(target=_decode, args=(transport, free_ports(2), args.client_device, num_blocks,
                                                 args.block_kib, env, cases, plan, b))
        proc.start()
        out = a.recv() if a.poll(args.config_timeout_s) else {"_error": f"no result within {args.config_timeout_s}s"}
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        print(f"[tcp_kv] {name} {env or ''}: {time.monotonic() - t0:.0f}s {out.get('_error', '')}", flush=True)
        if "_error" in out:
            notes.append(f"- {modes[0][0]}: failed: {out['_error'][:300]}")
        for key, val in out.items():
            if not key.startswith("_"):
                rows[key] = val
        if "_d2h" in out and "_copy" not in rows:
            rows["_copy"] = (out["_d2h"], out["_h2d"])
        if args.out:  # what there is so far: a call cut short still leaves a table
            Path(args.out).write_text(render(dict(rows), args, sizes, block_bytes, notes) + "\n")
    publish(render(rows, args, sizes, block_bytes, notes), args.out)
    return 0


def with_cuda_copy(env: dict) -> dict:
    """NIXL's UCX backend refuses a UCX_TLS without a CUDA transport on a machine with GPUs, even
    for host memory: there, `cuda_copy` is added (and named in the row)."""
    import torch

    tls = env["UCX_TLS"].split(",")
    if torch.cuda.is_available() and not any(t.startswith("cuda") for t in tls):
        return {**env, "UCX_TLS": ",".join([*tls, "cuda_copy"])}
    return env


def _parse_configs(text: str) -> list[tuple[str, dict]]:
    out, parts = [], text.split(",")
    i = 0
    while i < len(parts):
        p = parts[i]
        if p.startswith("nixl:"):
            tls = [p[5:]]
            while i + 1 < len(parts) and parts[i + 1] not in ("raw", "tcp", "tcp-inline") \
                    and not parts[i + 1].startswith("nixl:"):
                i += 1
                tls.append(parts[i])
            out.append(("nixl", {"UCX_TLS": ",".join(tls)}))
        else:
            out.append((p, {}))
        i += 1
    return out


def render(rows, args, sizes, block_bytes, notes) -> str:
    copy = rows.pop("_copy", None)
    raw1 = rows.get("raw socket, 1 stream")
    head = [f"{n * block_bytes / MiB:.0f} MiB" for n in sizes]
    lines = [f"KV pull, {args.server_device} -> {args.client_device}, blocks of {block_bytes // 1024} KiB "
             f"({'Llama-3.1-8B bf16, 16 tokens' if block_bytes == 2 * MiB else 'smoke'}), `real` block layout; "
             f"GB/s (median of {args.iters}; % of the 1-stream raw socket of the same size)", "",
             "| path | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for label, cells in rows.items():
        vals = []
        for k, (nbytes, s) in enumerate(cells):
            gbps = nbytes / s / 1e9
            pct = f" ({100 * raw1[k][1] / s:.0f}%)" if raw1 and not label.startswith("raw socket, 1") else ""
            vals.append(f"{gbps:.2f}{pct}")
        lines.append(f"| {label} | " + " | ".join(vals) + " |")
    if copy:
        lines += ["", f"Page-locked copies, 256 MiB: device -> host {copy[0]:.1f} GB/s ({args.server_device}), "
                      f"host -> device {copy[1]:.1f} GB/s ({args.client_device})."]
    if notes:
        lines += [""] + notes
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
