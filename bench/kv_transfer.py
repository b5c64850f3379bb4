"""KV transfer benchmark: GB/s by size and block layout, NIXL and TCP, vs a torch copy; where the
fixed cost of a pull goes; what a per-lease NIXL registration would cost.

A "prefill" process owns a KV cache and pins block lists; this process plays the decode worker
and pulls them through the real KVConnector (side channel, lease, READ, release notification).
The baseline is a plain torch copy of the same number of bytes on the same device(s), measured
in the same run; and, to tell NIXL and UCX's cost from the copy engine's, the same descriptors
copied without them: one cudaMemcpyAsync per merged run (what UCX's cuda_ipc transport issues
per descriptor), issued from Python and replayed from a CUDA graph, from a local source and from
one mapped from another process (`descriptor_copies`).
Block layouts (the same ids on both sides except "real"):

  contiguous  ids 0..n-1: one descriptor
  scattered   every other id: one descriptor per block (the worst case)
  real        a prompt's blocks as the BlockManager places them after churn: a random
              alloc/grow/free workload with prefix caching runs through the real BlockManager
              on each side (different seeds), then a request of n blocks is allocated; the
              descriptor count is the runs of (source, destination) pairs that merge, which
              is what NIXL posts on either path (tests/worker/test_kv_nixl.py checks it against
              NIXL's telemetry); --eviction-slack churns with that BlockManager eviction_slack

NIXL is measured with descriptor lists prepared once per peer (`prepped`: a pull is
make_prepped_xfer with block indices) and built per pull (`dlist`), both with the READ posted
before the lease round trip; and `serial`: prepped, lease first (see --nixl-modes).

    python -m pdserve.bench.kv_transfer --device cpu --sizes-mib 1 16 64
    python -m pdserve.bench.kv_transfer --device cuda --ucx-tls cuda_ipc,cuda_copy,tcp
    python -m pdserve.bench.kv_transfer --device cuda --cross-gpu   # cuda:0 -> cuda:1
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

from pdserve.bench.ports import free_ports
from pdserve.bench.report import publish
from pdserve.protocol.kv_layout import KVLayout

MiB = 1 << 20
BENCH_DIGEST = "0" * 32  # pins are bound to a prompt digest; the bench's pins have no prompt


def _progress_delay() -> str:
    from pdserve.worker.kv.nixl_transport import progress_delay_us

    us = progress_delay_us()
    return f"{us} us" if us else "0 (busy poll)"


def _config(transport: str, port: int, role: str, pull_timeout: float = 120):
    """A bench connector's config (also bench/tcp_kv.py's): `pull_timeout` is the decode side's."""
    from pdserve.worker.config.engine import EngineConfig

    if role == "prefill":
        return EngineConfig(role="prefill", kv_transfer=transport, kv_host="127.0.0.1", kv_port=port,
                            kv_pin_ttl=3600, kv_pull_timeout=120)
    return EngineConfig(role="decode", kv_transfer=transport, kv_port=port, kv_pull_timeout=pull_timeout,
                        kv_peer_allow=("127.0.0.1",))


# -- block layouts ------------------------------------------------------------------------------

def churned_blocks(num_blocks: int, n: int, seed: int, eviction_slack: float = 0.0) -> list[int]:
    """The block ids the real BlockManager gives a new n-block request after a random workload
    of mixed lengths turning the cache over about four times (block_churn.py)."""
    from pdserve.bench.block_churn import churned_blocks as churned

    return churned(num_blocks, n, seed, eviction_slack)


def layout(kind: str, n: int, num_blocks: int, seed: int, eviction_slack: float = 0.0) -> tuple[list[int], list[int]]:
    """(source ids on the prefill side, destination ids on the decode side) for an n-block pull."""
    if kind == "contiguous":
        ids = list(range(n))
        return ids, ids
    if kind == "scattered":
        ids = list(range(0, 2 * n, 2))
        return ids, ids
    return churned_blocks(num_blocks, n, seed, eviction_slack), churned_blocks(num_blocks, n, seed + 1, eviction_slack)


def num_runs(src: list[int], dst: list[int]) -> int:
    from pdserve.worker.kv.block_runs import merge_runs

    return len(merge_runs(src, dst))


# -- the prefill process --------------------------------------------------------------------------

def kv_cache(num_blocks: int, block_bytes: int, device, fill: bool = False) -> tuple[torch.Tensor, KVLayout]:
    """A cache shaped as the worker's [blocks, layers, 2, block size, kv heads, head dim] (one
    layer, one token, one head: only each block's bytes matter here), and its layout."""
    shape = (num_blocks, 1, 2, 1, 1, block_bytes // 2)
    cache = (torch.randint(0, 255, shape, dtype=torch.uint8, device=device) if fill
             else torch.zeros(shape, dtype=torch.uint8, device=device))
    return cache, KVLayout(1, 1, block_bytes // 2, "uint8", 1)


def _server(transport, port, device, num_blocks, block_bytes, pins, conn):
    """Prefill side: pin every block list, send their params, serve until told to stop."""
    from pdserve.worker.kv.connector import KVConnector

    cache, layout = kv_cache(num_blocks, block_bytes, device, fill=True)
    c = KVConnector(_config(transport, port, "prefill"), cache, f"bench-server-{transport}", layout)
    c.start_server()
    conn.send([c.pin(f"r{i}", ids, len(ids), 0, BENCH_DIGEST) for i, ids in enumerate(pins)])
    conn.recv()  # stop
    c.shutdown()


def _torch_copy_gbps(nbytes, src_dev, dst_dev, iters) -> float:
    # Filled first so the timed copies measure bandwidth, not first-touch page faults.
    src = torch.ones(nbytes, dtype=torch.uint8, device=src_dev)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=dst_dev)
    return nbytes / _median_s(lambda: dst.copy_(src), dst.device, iters) / 1e9


def _median_s(fn, device, iters: int) -> float:
    """Median seconds of fn() with the device synchronized around it; one untimed call first."""
    times = []
    for _ in range(iters + 1):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def descriptor_copies(cases, num_blocks: int, block_bytes: int, src_dev, dst_dev, iters: int) -> dict:
    """The same descriptors without NIXL or UCX: one `cudaMemcpyAsync` per merged run of blocks
    (what UCX's cuda_ipc transport issues for each descriptor of a READ), host-issued in a loop,
    and on CUDA the same copies replayed from a CUDA graph (memcpy nodes: no host cost per
    descriptor). Each from a source in this process and from one another process owns (CUDA IPC,
    as UCX maps the prefill's cache; CPU: shared memory): a copy out of IPC-mapped memory may take
    the copy engine where a local one runs as a kernel, so the IPC columns bound what any transport
    over cuda_ipc reaches with these descriptors. Returns {(layout, size index, column): (bytes,
    median seconds)}."""
    import torch.multiprocessing as tmp

    nbytes_all = num_blocks * block_bytes
    ctx = tmp.get_context("spawn")
    parent, child = ctx.Pipe()
    owner = ctx.Process(target=_ipc_source, args=(child, nbytes_all, str(src_dev)), daemon=True)
    owner.start()
    try:
        if not parent.poll(120):
            raise RuntimeError("the process owning the IPC source did not send it within 120 s")
        sources = {"": torch.ones(nbytes_all, dtype=torch.uint8, device=src_dev), ", IPC source": parent.recv()}
        dst = torch.zeros(nbytes_all, dtype=torch.uint8, device=dst_dev)
        out = {}
        for kind, i, s_ids, d_ids in cases:
            for label, src in sources.items():
                for col, (nbytes, seconds) in _copy_runs(src, dst, s_ids, d_ids, block_bytes, iters).items():
                    out[(kind, i, f"memcpy per descriptor{label}{col}")] = (nbytes, seconds)
        del sources, src
        _sync(dst_dev)
        return out
    finally:
        parent.send("stop")
        owner.join(30)
        if owner.is_alive():
            owner.kill()


def _ipc_source(conn, nbytes: int, device: str) -> None:
    """Own a source filled with ones and send it (torch's reductions: a CUDA IPC handle, or shared
    memory on a CPU); keep it alive until told to stop."""
    import torch.multiprocessing  # noqa: F401  registers the tensor reductions on this side too

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    _sync(device)
    conn.send(src)
    conn.recv()


def _copy_runs(src: torch.Tensor, dst: torch.Tensor, s_ids: list[int], d_ids: list[int], bb: int,
               iters: int) -> dict:
    """One layout's copies, one `copy_` per merged run: {column suffix: (bytes, median s)}, and a
    check that exactly the destination blocks landed (a baseline moving other bytes measures nothing)."""
    from pdserve.worker.kv.block_runs import merge_runs

    pairs = [(dst[d * bb:(d + c) * bb], src[s * bb:(s + c) * bb]) for s, d, c in merge_runs(s_ids, d_ids)]

    def copy_all():
        for d_view, s_view in pairs:
            d_view.copy_(s_view, non_blocking=True)

    columns = {", issued": copy_all}
    if dst.is_cuda:
        copy_all()  # warm (first touch, lazy peer mapping) before the capture
        torch.cuda.synchronize(dst.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            copy_all()
        columns[", CUDA graph"] = graph.replay
    out = {col: (len(s_ids) * bb, _median_s(fn, dst.device, iters)) for col, fn in columns.items()}
    landed = dst.view(-1, bb)[:, 0].nonzero().flatten().tolist()
    if landed != sorted(d_ids):
        raise RuntimeError(f"the descriptor copies wrote blocks {landed[:8]}..., not {sorted(d_ids)[:8]}...")
    dst.zero_()
    return out


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# -- one transport: every layout, size and mode against one prefill process -----------------------

def bench_transport(transport, cases, modes, num_blocks, block_bytes, iters, breakdown_iters, server_dev,
                    client_dev, notify_after_read=True):
    """cases: [(layout, size index, src ids, dst ids)]. Returns ({(layout, i, mode): (bytes, s)},
    {mode: {part: median s}} for NIXL 1-block pulls taken apart)."""
    from pdserve.worker.kv import side_channel
    from pdserve.worker.kv.connector import KVConnector

    pins = [[0]]  # warm-up: the first NIXL pull also fetches and adds the peer's agent metadata
    for _, _, src, _ in cases:
        pins += [src] * (iters * len(modes))
    nixl_breakdown = transport == "nixl" and breakdown_iters > 0
    if nixl_breakdown:
        pins += [[0]] * (2 * 2 * breakdown_iters * len(modes))  # notification after / on the READ; 2 per step
    port = free_ports(2)  # the prefill side's, and the decode side's + 1
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_server, args=(transport, port, server_dev, num_blocks, block_bytes, pins, child))
    proc.start()
    try:
        while not parent.poll(1.0):  # a server that died (e.g. UCX refused its UCX_TLS) must not hang us
            if not proc.is_alive():
                raise RuntimeError(f"the {transport} server process exited with {proc.exitcode} before it was ready")
        params = iter(parent.recv())
        cache, layout = kv_cache(num_blocks, block_bytes, client_dev)
        c = KVConnector(_config(transport, port + 1, "decode"), cache, f"bench-client-{transport}", layout)
        c._pull(next(params), [0], [0], BENCH_DIGEST)
        if c.kv.leases:
            c.kv.notify_after_read = notify_after_read
        rows = {}
        for kind, i, src, dst in cases:
            for mode in modes:
                if c.kv.leases:
                    c.kv.use_prepped = mode != "dlist"
                    c.kv.overlap_lease = mode != "serial"
                times = []
                for _ in range(iters):
                    _sync(client_dev)
                    t = time.perf_counter()
                    c._pull(next(params), list(range(len(src))), dst, BENCH_DIGEST)
                    _sync(client_dev)
                    times.append(time.perf_counter() - t)
                rows[(kind, i, mode)] = (len(src) * block_bytes, statistics.median(times))
        parts = {}
        if nixl_breakdown:
            for mode in [m for m in modes if m != "serial"]:  # the breakdown times its steps one after another
                for after in (True, False):
                    c.kv.use_prepped, c.kv.notify_after_read, c.kv.overlap_lease = mode == "prepped", after, True
                    label = f"nixl {mode}, release notification {'after the READ' if after else 'on the READ'}"
                    parts[label] = _breakdown(c, side_channel, params, breakdown_iters, client_dev)
        c.shutdown()
        return rows, parts
    finally:
        parent.send("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def _breakdown(c, side_channel, params, iters, client_dev) -> dict[str, float]:
    """A 1-block NIXL pull's steps timed one by one, as NixlTransport.pull runs them: the
    lease round trip on the side channel, then NIXL's prepare / post / wait for DONE / release
    the handle / send the release notification (when it is not attached to the READ)."""
    samples: dict[str, list[float]] = {}
    for _ in range(iters):
        p = next(params)
        peer = c.kv.known_peer(p.remote_engine_id)
        t0 = time.perf_counter()
        reply, _ = side_channel.call(p.remote_host, p.remote_port, "lease", {
            "request_id": p.remote_request_id, "token": p.transfer_token, "indices": [0],
            "prompt_digest": BENCH_DIGEST, "want_metadata": False}, c.timeout, c.auth, p.remote_engine_id)
        t = {"lease": time.perf_counter() - t0}
        notif = {"op": "release", "request_id": p.remote_request_id, "token": p.transfer_token,
                 "bytes": c.block_bytes}
        c.kv.read(peer, reply["block_ids"], [0], notif, c.timeout, t)
        _sync(client_dev)
        t["total"] = time.perf_counter() - t0
        q = next(params)  # the same pull through the connector, interleaved: what the main table measures
        t0 = time.perf_counter()
        c._pull(q, [0], [0], BENCH_DIGEST)
        _sync(client_dev)
        t["pull"] = time.perf_counter() - t0
        for k, v in t.items():
            samples.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in samples.items()}


# -- what registering each lease's blocks (instead of the whole cache) would cost ------------------

def lease_registration_cost(device: str, block_bytes: int, n_blocks: int, iters: int) -> dict[str, float]:
    """Median seconds per lease to register n blocks with NIXL, export their partial metadata
    (descriptors only: the connection is made once), load it on the peer, and deregister. Two
    agents in this process; the bytes are never moved (the pull itself is measured above)."""
    from pdserve.worker.kv.nixl_transport import import_nixl

    nixl_agent, nixl_agent_config = import_nixl()
    owner = nixl_agent(f"bench-reg-owner-{os.getpid()}", nixl_agent_config(enable_listen_thread=False,
                                                                           backends=["UCX"]))
    peer = nixl_agent(f"bench-reg-peer-{os.getpid()}", nixl_agent_config(enable_listen_thread=False,
                                                                         backends=["UCX"]))
    cache = torch.zeros(2 * n_blocks, block_bytes, dtype=torch.uint8, device=device)
    mem = "VRAM" if cache.is_cuda else "DRAM"
    dev = cache.device.index or 0
    samples: dict[str, list[float]] = {}
    for i in range(iters + 1):
        start = cache.data_ptr() + (i % 2) * n_blocks * block_bytes  # alternate spans: nothing cached by address
        t0 = time.perf_counter()
        reg = owner.register_memory([(start, n_blocks * block_bytes, dev, "")], mem)
        t1 = time.perf_counter()
        md = owner.get_partial_agent_metadata(reg, inc_conn_info=i == 0)  # connection info once
        t2 = time.perf_counter()
        peer.add_remote_agent(md)
        t3 = time.perf_counter()
        owner.deregister_memory(reg)
        t4 = time.perf_counter()
        if i:  # the first lease pays one-off setup (the connection)
            for k, v in (("register", t1 - t0), ("partial metadata", t2 - t1), ("peer loads it", t3 - t2),
                         ("deregister", t4 - t3), ("total", t4 - t0)):
                samples.setdefault(k, []).append(v)
    return {k: statistics.median(v) for k, v in samples.items()}


def fixed_cost_ms(rows) -> float:
    """A one-block pull's time less its bytes at the largest transfer's bandwidth."""
    (one_bytes, one_s), (big_bytes, big_s) = rows[0], rows[-1]
    return max(0.0, one_s - one_bytes * big_s / big_bytes) * 1e3


# -- report -------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench kv-transfer", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--cross-gpu", action="store_true", help="server on cuda:0, client on cuda:1")
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    ap.add_argument("--block-kib", type=int, default=256, help="bytes per KV block (all layers), KiB")
    ap.add_argument("--iters", type=int, default=5, help="pulls per size, layout and mode (median reported)")
    ap.add_argument("--transports", nargs="+", default=["nixl", "tcp"], choices=("nixl", "tcp"))
    ap.add_argument("--layouts", nargs="+", default=["contiguous", "scattered", "real"],
                    choices=("contiguous", "scattered", "real"))
    ap.add_argument("--nixl-modes", nargs="+", default=["prepped", "dlist", "serial"],
                    choices=("prepped", "dlist", "serial"),
                    help="prepped: descriptor lists prepared once per peer, READ overlapped with the lease; dlist: "
                         "descriptor lists built per pull; serial: prepped, but the lease round trip before the READ")
    ap.add_argument("--notify", default="after", choices=("after", "on-read"),
                    help="NIXL release notification: sent after the READ is DONE (pdserve's default) or attached to it")
    ap.add_argument("--spin-us", type=float, default=None,
                    help="NIXL completion polling: busy-check this long before backing off (default: the transport's)")
    ap.add_argument("--breakdown-iters", type=int, default=20, help="1-block NIXL pulls taken apart (0: skip)")
    ap.add_argument("--lease-registration-blocks", type=int, default=64,
                    help="blocks per lease in the per-lease registration cost (0: skip)")
    ap.add_argument("--seed", type=int, default=0, help="churn workload seed of the real layout")
    ap.add_argument("--eviction-slack", type=float, default=0.0,
                    help="BlockManager eviction_slack of the real layout's churn (0: strict LRU, the default)")
    ap.add_argument("--ucx-tls", default=None,
                    help="set UCX_TLS for both sides (e.g. cuda_ipc,cuda_copy,tcp for VRAM->VRAM on one host)")
    ap.add_argument("--no-descriptor-copies", action="store_true",
                    help="skip the baseline that copies the same descriptors without NIXL (one cudaMemcpyAsync "
                         "each, issued and from a CUDA graph)")
    ap.add_argument("--out", default=None, help="also write the report (markdown) to this file")
    args = ap.parse_args(argv)
    if min(args.sizes_mib) < 1 or args.iters < 1 or args.block_kib < 1 or args.breakdown_iters < 0 \
            or args.eviction_slack < 0:
        ap.error("--sizes-mib, --iters and --block-kib must be >= 1, --breakdown-iters and --eviction-slack >= 0")
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls  # inherited by the spawned prefill process
    if args.spin_us is not None:  # only this (decode) process polls
        from pdserve.worker.kv import nixl_transport

        nixl_transport.SPIN_S = args.spin_us * 1e-6
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device visible")
    if args.cross_gpu and torch.cuda.device_count() < 2:
        ap.error("--cross-gpu needs two GPUs")
    server_dev = "cuda:0" if args.device == "cuda" else "cpu"
    client_dev = ("cuda:1" if args.cross_gpu else "cuda:0") if args.device == "cuda" else "cpu"
    block_bytes = args.block_kib * 1024
    counts = [1] + [max(1, mib * MiB // block_bytes) for mib in args.sizes_mib]  # 1 block: the fixed cost
    # The real layout's caches: twice the largest pull, so the churn leaves live requests around it.
    num_blocks = max(64, 2 * max(counts))
    cases = []
    for kind in args.layouts:
        for i, n in enumerate(counts):
            src, dst = layout(kind, n, num_blocks, args.seed + 1000 * i, args.eviction_slack)
            cases.append((kind, i, src, dst))
    card = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    lines = [
        f"# KV transfer: {server_dev} -> {client_dev} ({card}), block {args.block_kib} KiB, "
        f"median of {args.iters}, torch {torch.__version__}, nixl {_nixl_version()}, "
        f"UCX_TLS={os.environ.get('UCX_TLS', '(default)')}, "
        f"UCX_CUDA_IPC_ENABLE_GET_ZCOPY={os.environ.get('UCX_CUDA_IPC_ENABLE_GET_ZCOPY', '(pdserve: y on CUDA)')}, "
        f"NIXL progress thread poll timeout {_progress_delay()}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}",
        "",
    ]
    results, parts = {}, {}
    for transport in args.transports:
        modes = args.nixl_modes if transport == "nixl" else ["-"]
        print(f"  measuring {transport} ...", file=sys.stderr, flush=True)
        rows, br = bench_transport(transport, cases, modes, num_blocks, block_bytes, args.iters,
                                   args.breakdown_iters, server_dev, client_dev, args.notify == "after")
        for (kind, i, mode), v in rows.items():
            results[(kind, i, transport if mode == "-" else f"{transport} {mode}")] = v
        parts.update(br)
    if not args.no_descriptor_copies:
        print("  measuring the same descriptors as plain copies ...", file=sys.stderr, flush=True)
        results.update(descriptor_copies(cases, num_blocks, block_bytes, server_dev, client_dev, args.iters))
    columns = list(dict.fromkeys(col for _, _, col in results))
    lines += ["| size | layout | descriptors | MiB per descriptor | torch copy GB/s | "
              + " | ".join(f"{col} GB/s (% of copy)" for col in columns) + " |",
              "|---" * (5 + len(columns)) + "|"]
    copies = {}
    for kind, i, src, dst in cases:
        nbytes = len(src) * block_bytes
        if nbytes not in copies:
            copies[nbytes] = _torch_copy_gbps(nbytes, server_dev, client_dev, args.iters)
        cells = []
        for col in columns:
            b, s = results[(kind, i, col)]
            cells.append(f"{b / s / 1e9:.2f} ({100 * b / s / 1e9 / copies[nbytes]:.0f}%)")
        size = f"{nbytes / MiB:.0f} MiB" if nbytes >= MiB else f"{nbytes // 1024} KiB"
        runs = num_runs(src, dst)
        lines.append(f"| {size} | {kind} | {runs} | {nbytes / runs / MiB:.2f} | {copies[nbytes]:.2f} | "
                     + " | ".join(cells) + " |")
    for kind in args.layouts:
        fixed = [fixed_cost_ms([results[(kind, 0, col)], results[(kind, len(counts) - 1, col)]]) for col in columns]
        lines.append(f"| fixed cost per pull (ms) | {kind} | | | | " + " | ".join(f"{f:.2f}" for f in fixed) + " |")
    if parts:
        names = ["lease", "prepare", "post", "wait", "release", "notify", "total", "pull"]
        lines += ["", f"1-block NIXL pull taken apart (median of {args.breakdown_iters}, ms):", "",
                  "| step | " + " | ".join(parts) + " |", "|---" * (1 + len(parts)) + "|"]
        labels = {
            "lease": "lease (side-channel round trip)",
            "prepare": "prepare (make_prepped_xfer / initialize_xfer)",
            "post": "post (transfer)",
            "wait": "wait for DONE",
            "release": "release_xfer_handle",
            "notify": "send_notif (release), after DONE",
            "total": "total",
            "pull": "KVConnector._pull end to end (READ during the lease where the release comes after)",
        }
        for k in names:
            lines.append(f"| {labels[k]} | " + " | ".join(f"{parts[m][k] * 1e3:.3f}" for m in parts) + " |")
    if "nixl" in args.transports and args.lease_registration_blocks > 0:
        n = args.lease_registration_blocks
        cost = lease_registration_cost(server_dev, block_bytes, n, 20)
        lines += ["", f"Per-lease NIXL registration of {n} blocks ({n * block_bytes / MiB:.0f} MiB), median of 20, "
                      f"ms (not used by pdserve: see docs/security.md):", "",
                  "| register | partial metadata | peer loads it | deregister | total |", "|---|---|---|---|---|",
                  "| " + " | ".join(f"{cost[k] * 1e3:.3f}" for k in ("register", "partial metadata", "peer loads it",
                                                                         "deregister", "total")) + " |"]
    publish("\n".join(lines), args.out)
    return 0


def _nixl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("nixl-cu13", "nixl-cu12", "nixl"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "not installed"


if __name__ == "__main__":
    sys.exit(main())
