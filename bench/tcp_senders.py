"""The engine's step thread beside its TCP KV senders, in its process or their own (not a test).

    pdserve bench tcp-senders [--device cpu|cuda] [--mib 64] [--gbps 1] [--seconds 4] [--rounds 3] [--out F]

Over TCP a prefill worker sends the KV itself (worker/kv/tcp_stream.py). With the senders as
threads of the engine's process (`--kv-tcp-senders thread`), every piece they send takes the
GIL a few times, inside whatever the step thread is doing; an eager prefill step (Python and
a dispatch per op, the GIL released in each op) then runs longer: on an H200 2.5-3.5x per launch
with four sender threads, P/D over TCP's TTFT cost against NIXL (docs/tcp-kv-gpu-results.md).
`--kv-tcp-senders process` moves them into a child process (tcp_sender_process.py).

This process is the prefill worker's KV half: a cache of 2 MiB blocks (Llama-3.1-8B's in bf16),
its pin table, side channel and the real TcpServer; its main thread stands in for the step
thread: a forward of small ops (32 layers of eight), timed step by step. A second process pulls
a kept pin of --mib MiB over the real data path (4 streams, 32 MiB chunks) again and again, at
most --gbps GB/s (a link's rate). Per round, in this order: no reader (`alone`), the senders as
threads, the senders in their own process. Columns: the step's p50 / p90 in ms, the p50 as a
multiple of `alone`'s in the same round, steps that took over twice alone's p50, and the bytes
the reader got per second. On a machine with few cores the senders' copies and syscalls take
CPU in either mode; what differs is only whose interpreter they run in.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import time

import torch

from pdserve.bench.ports import free_ports
from pdserve.bench.report import markdown_table, publish

MiB = 1 << 20
BLOCK_BYTES = 2 * MiB
SECRET = "bench-tcp-senders"
DIGEST = "0" * 32


def _reader(port: int, params: dict, nblocks: int, gbps: float, device: str, stop, got) -> None:
    """The decode side: pull the pin's blocks again and again (kept), paced to `gbps`."""
    from pdserve.protocol.kv_layout import KVLayout
    from pdserve.protocol.kv_transfer import KVTransferParams
    from pdserve.worker.kv.auth import SideChannelAuth
    from pdserve.worker.kv.tcp_transport import tcp_pull

    torch.set_num_threads(1)
    p = KVTransferParams(remote_host="127.0.0.1", remote_port=port, num_prompt_tokens=1, first_token_id=0,
                         transport="tcp", kv_layout=KVLayout(1, 1, 1, "uint8", 1), **params)
    cache = torch.zeros(nblocks, BLOCK_BYTES, dtype=torch.uint8, device=device)
    auth, ids = SideChannelAuth(SECRET), list(range(nblocks))
    t0, total = time.monotonic(), 0
    while not stop.is_set():
        total += tcp_pull("127.0.0.1", port, p, ids, ids, cache, 30, auth, DIGEST, keep=True)
        with got.get_lock():
            got.value = total
        ahead = total / (gbps * 1e9) - (time.monotonic() - t0)
        if ahead > 0:
            stop.wait(ahead)


class _Step:
    """A stand-in for an eager step's launches: 32 layers of eight small ops each."""

    def __init__(self, device: str):
        g = torch.Generator().manual_seed(0)
        self.w = [torch.randn(256, 256, generator=g).to(device) * 0.05 for _ in range(32)]
        self.x = torch.randn(16, 256, generator=g).to(device)
        self.cuda = device.startswith("cuda")

    def __call__(self) -> float:
        t0 = time.perf_counter()
        x = self.x
        for w in self.w:
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            h = torch.nn.functional.silu(h @ w) * h
            x = x + h.tanh()
        if self.cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3


def _window(step: _Step, seconds: float) -> list[float]:
    out, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        out.append(step())
    return out


def _measure(mode: str | None, args, step: _Step, cache: torch.Tensor, alone_p50: float | None):
    """One cell: the step timed for --seconds with a reader pulling from `mode`'s senders."""
    from pdserve.worker.kv import side_channel
    from pdserve.worker.kv.auth import SideChannelAuth
    from pdserve.worker.kv.pins import PinTable
    from pdserve.worker.kv.tcp_transport import TcpServer

    if mode is None:
        times = _window(step, args.seconds)
        return times, 0.0
    auth, pins, port = SideChannelAuth(SECRET), PinTable(ttl=3600), free_ports(1)
    tcp = TcpServer(cache, pins, lambda n: None, "127.0.0.1", auth, num_layers=1, senders=mode)
    channel = side_channel.SideChannelServer("127.0.0.1", port, {"read": tcp.handle_read}, auth,
                                             identity=side_channel.destination("bench", "127.0.0.1", port))
    pins.on_change = channel.wake
    channel.start()
    ctx = mp.get_context("spawn")
    stop, got = ctx.Event(), ctx.Value("q", 0)
    nblocks = args.mib * MiB // BLOCK_BYTES
    token, _ = pins.add("bench", list(range(nblocks)), DIGEST)
    params = {"remote_request_id": "bench", "transfer_token": token, "remote_engine_id": "bench",
              "remote_block_ids": tuple(range(nblocks))}
    reader = ctx.Process(target=_reader, args=(port, params, nblocks, args.gbps, args.reader_device, stop, got),
                         daemon=True)
    try:
        reader.start()
        deadline = time.monotonic() + 60
        while got.value == 0:  # the reader is up and its first pull landed (the child too, if any)
            if time.monotonic() > deadline or not reader.is_alive():
                raise RuntimeError("the reader never completed a pull")
            time.sleep(0.01)
        b0, t0 = got.value, time.monotonic()
        times = _window(step, args.seconds)
        gbs = (got.value - b0) / (time.monotonic() - t0) / 1e9
    finally:
        stop.set()
        reader.join(30)
        channel.stop()
        tcp.close()
    return times, gbs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="the cache's and the step's device")
    ap.add_argument("--reader-device", default="cpu", help="the reader's cache device")
    ap.add_argument("--mib", type=int, default=64, help="bytes per pull, MiB")
    ap.add_argument("--gbps", type=float, default=1.0, help="the reader's pace, GB/s (a link's rate)")
    ap.add_argument("--seconds", type=float, default=4.0, help="each cell's window")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="this process's torch threads (the step's ops)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cache = torch.randint(0, 256, (args.mib * MiB // BLOCK_BYTES + 1, BLOCK_BYTES), dtype=torch.uint8)
    cache = cache.to(args.device)
    if cache.device.type == "cpu":
        cache.share_memory_()  # as the connector does for process senders, before anything else maps it
    step = _Step(args.device)
    _window(step, 1.0)  # warm
    rows = []
    for r in range(args.rounds):
        alone = None
        for mode in (None, "thread", "process"):
            times, gbs = _measure(mode, args, step, cache, alone)
            p50, p90 = statistics.median(times), statistics.quantiles(times, n=10)[-1]
            alone = alone or p50
            slow = sum(t > 2 * alone for t in times) / len(times)
            rows.append([str(r + 1), mode or "alone", f"{p50:.2f}", f"{p90:.2f}", f"{p50 / alone:.2f}",
                         f"{slow:.1%}", str(len(times)), f"{gbs:.2f}" if mode else "-"])
            print(f"round {r + 1} {mode or 'alone'}: p50 {p50:.2f} ms, p90 {p90:.2f}, {gbs:.2f} GB/s", flush=True)
    head = (f"# The step thread beside the TCP KV senders\n\n{platform.node()}: {os.cpu_count()} CPUs, "
            f"{platform.processor() or platform.machine()}, torch {torch.__version__}, device {args.device}; "
            f"pulls of {args.mib} MiB (2 MiB blocks) paced to {args.gbps} GB/s, {args.seconds:.0f} s a cell, "
            f"step = 32 layers x 8 small ops, torch threads {args.threads}\n")
    table = markdown_table(["round", "senders", "step p50 ms", "p90 ms", "x alone", "> 2x alone", "steps",
                            "reader GB/s"], rows, right={2, 3, 4, 5, 6, 7})
    publish(head + "\n" + table, args.out)


if __name__ == "__main__":
    main()
