"""The engine's step thread beside its TCP KV data connections, in its process or their own (not a test).

    pdserve bench tcp-io [--side prefill|decode] [--device cpu|cuda] [--mib 64] [--gbps 1] [--seconds 4]
                         [--rounds 3] [--out F]

Over TCP a prefill worker sends the KV itself and a decode worker receives it (worker/kv/
tcp_stream.py). With their data connections as threads of the engine's process
(`--kv-tcp-io thread`), every piece they move takes the GIL a few times, inside whatever the
step thread is doing; an eager prefill step (Python and a dispatch per op, the GIL released in
each op) then runs longer: on an H200 2.5-3.5x per launch beside four sender threads, P/D over
TCP's TTFT cost against NIXL (docs/tcp-kv-gpu-results.md). `--kv-tcp-io process` moves them into
child processes (tcp_sender_process.py, tcp_receiver_process.py).

This process's main thread stands in for the step thread: a forward of small ops (32 layers of
eight), timed step by step. `--side prefill`: this process is the prefill worker's KV half (a
cache of 2 MiB blocks, Llama-3.1-8B's in bf16; its pin table, side channel and the real
TcpServer) and another process pulls a kept pin of --mib MiB over the real data path (4
streams, --chunk-mib chunks) again and again, at most --gbps GB/s. `--side decode`: the other process
serves and this one pulls, on a thread as a pull pool does. Per round, in this order: no reader
(`alone`), this side's connections as threads, in their own process. Columns: the step's p50 /
p90 in ms, the p50 as a multiple of `alone`'s in the same round, steps over twice alone's p50,
and the bytes the reader got per second. On a machine with few cores the copies and syscalls
take CPU in either mode; what differs is only whose interpreter they run in.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import threading
import time

import torch

from pdserve.bench.ports import free_ports
from pdserve.bench.report import markdown_table, publish
from pdserve.worker.kv.auth import SideChannelAuth

MiB = 1 << 20
BLOCK_BYTES = 2 * MiB
SECRET = "bench-tcp-io"
DIGEST = "0" * 32


def _pull_loop(port: int, params: dict, cache: torch.Tensor, gbps: float, stop, got, receiver=None) -> None:
    """The decode side: pull the pin's blocks again and again (kept), paced to `gbps`."""
    from pdserve.protocol.kv_layout import KVLayout
    from pdserve.protocol.kv_transfer import KVTransferParams
    from pdserve.worker.kv.tcp_transport import tcp_pull

    p = KVTransferParams(remote_host="127.0.0.1", remote_port=port, num_prompt_tokens=1, first_token_id=0,
                         transport="tcp", kv_layout=KVLayout(1, 1, 1, "uint8", 1), **params)
    auth, ids = SideChannelAuth(SECRET), list(range(cache.shape[0]))
    t0, total, paced = None, 0, 0
    while not stop.is_set():
        n = tcp_pull("127.0.0.1", port, p, ids, ids, cache, 30, auth, DIGEST, keep=True, receiver=receiver)
        total += n
        with got.get_lock():
            got.value = total
        if t0 is None:  # paced from the first pull's end: a slow start is not made up for with a burst
            t0 = time.monotonic()
            continue
        paced += n
        ahead = paced / (gbps * 1e9) - (time.monotonic() - t0)
        if ahead > 0:
            stop.wait(ahead)


def _reader(port: int, params: dict, nblocks: int, gbps: float, device: str, stop, got) -> None:
    """--side prefill: the decode side, a process of its own (receivers as its threads)."""
    torch.set_num_threads(1)
    _pull_loop(port, params, torch.zeros(nblocks, BLOCK_BYTES, dtype=torch.uint8, device=device), gbps, stop, got)


class _Serving:
    """The prefill side: a cache, its pin of `nblocks`, the side channel and the TcpServer
    (`senders`: where its senders run)."""

    def __init__(self, cache: torch.Tensor, nblocks: int, senders: str):
        from pdserve.worker.kv import side_channel
        from pdserve.worker.kv.pins import PinTable
        from pdserve.worker.kv.tcp_transport import TcpServer

        auth, pins, self.port = SideChannelAuth(SECRET), PinTable(ttl=3600), free_ports(1)
        self.tcp = TcpServer(cache, pins, lambda n: None, "127.0.0.1", auth, num_layers=1, senders=senders)
        self.channel = side_channel.SideChannelServer(
            "127.0.0.1", self.port, {"read": self.tcp.handle_read}, auth,
            identity=side_channel.destination("bench", "127.0.0.1", self.port))
        pins.on_change = self.channel.wake
        self.channel.start()
        token, _ = pins.add("bench", list(range(nblocks)), DIGEST)
        self.params = {"remote_request_id": "bench", "transfer_token": token, "remote_engine_id": "bench",
                       "remote_block_ids": tuple(range(nblocks))}

    def close(self) -> None:
        self.channel.stop()
        self.tcp.close()


def _server(nblocks: int, device: str, chunk_bytes: int, conn, stop) -> None:
    """--side decode: the prefill side, a process of its own (senders as its threads)."""
    from pdserve.worker.kv import tcp_stream

    torch.set_num_threads(1)
    tcp_stream.CHUNK_BYTES = chunk_bytes
    cache = torch.randint(0, 256, (nblocks, BLOCK_BYTES), dtype=torch.uint8).to(device)
    serving = _Serving(cache, nblocks, "thread")
    conn.send((serving.port, serving.params))
    stop.wait()
    serving.close()


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


def _measure(mode: str | None, args, step: _Step, cache: torch.Tensor):
    """One cell: the step timed for --seconds while a reader pulls, `mode` (None: no reader)
    saying where this side's data connections run."""
    from pdserve.worker.kv.tcp_receiver_process import ReceiverProcess

    if mode is None:
        return _window(step, args.seconds), 0.0
    ctx = mp.get_context("spawn")
    stop, got = ctx.Event(), ctx.Value("q", 0)
    nblocks = args.mib * MiB // BLOCK_BYTES
    serving = receiver = puller = other = None
    try:
        if args.side == "prefill":  # serve here, pull in another process
            serving = _Serving(cache, nblocks, mode)
            other = ctx.Process(target=_reader, args=(serving.port, serving.params, nblocks, args.gbps,
                                                      args.reader_device, stop, got), daemon=True)
            other.start()
        else:  # serve in another process, pull here (on a thread, as a pull pool's)
            here, there = ctx.Pipe()
            other = ctx.Process(target=_server, args=(nblocks, args.reader_device, args.chunk_mib * MiB, there, stop),
                                daemon=True)
            other.start()
            if not here.poll(60):
                raise RuntimeError("the prefill process never served")
            port, params = here.recv()
            dst = cache[:nblocks]  # the receiver's own tensor: tcp_pull hands it reads into this one only
            receiver = ReceiverProcess(dst, SideChannelAuth(SECRET)) if mode == "process" else None
            puller = threading.Thread(target=_pull_loop, args=(port, params, dst, args.gbps, stop, got, receiver),
                                      daemon=True)
            puller.start()
        deadline = time.monotonic() + 60
        while got.value == 0:  # the first pull landed (every process is up)
            if time.monotonic() > deadline or not other.is_alive():
                raise RuntimeError("the reader never completed a pull")
            time.sleep(0.01)
        b0, t0 = got.value, time.monotonic()
        times = _window(step, args.seconds)
        deadline = time.monotonic() + 60
        while got.value == b0 and other.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)  # a window shorter than one pull (a loaded machine): the rate includes the next one
        gbs = (got.value - b0) / (time.monotonic() - t0) / 1e9
    finally:
        stop.set()
        if puller is not None:
            puller.join(30)
        if other is not None:
            other.join(30)
        if receiver is not None:
            receiver.close()
        if serving is not None:
            serving.close()
    return times, gbs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--side", choices=("prefill", "decode"), default="prefill",
                    help="which side this process (the step thread's) is: its senders or its receivers vary")
    ap.add_argument("--device", default="cpu", help="the cache's and the step's device")
    ap.add_argument("--reader-device", default="cpu", help="the reader's cache device")
    ap.add_argument("--mib", type=int, default=64, help="bytes per pull, MiB")
    ap.add_argument("--gbps", type=float, default=1.0, help="the reader's pace, GB/s (a link's rate)")
    ap.add_argument("--chunk-mib", type=int, default=32, help="the data path's chunk (tcp_stream.CHUNK_BYTES): "
                    "smaller chunks, more pieces a byte, more GIL takes")
    ap.add_argument("--seconds", type=float, default=4.0, help="each cell's window")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="this process's torch threads (the step's ops)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from pdserve.worker.kv import tcp_stream

    tcp_stream.CHUNK_BYTES = args.chunk_mib * MiB  # this side's (a senders' child takes it at start)
    torch.set_num_threads(args.threads)
    cache = torch.randint(0, 256, (args.mib * MiB // BLOCK_BYTES + 1, BLOCK_BYTES), dtype=torch.uint8)
    cache = cache.to(args.device)
    if cache.device.type == "cpu":
        cache.share_memory_()  # as the connector does for --kv-tcp-io process, before anything else maps it
    step = _Step(args.device)
    _window(step, 1.0)  # warm
    rows = []
    for r in range(args.rounds):
        alone = None
        for mode in (None, "thread", "process"):
            times, gbs = _measure(mode, args, step, cache)
            p50, p90 = statistics.median(times), statistics.quantiles(times, n=10)[-1]
            alone = alone or p50
            slow = sum(t > 2 * alone for t in times) / len(times)
            rows.append([str(r + 1), mode or "alone", f"{p50:.2f}", f"{p90:.2f}", f"{p50 / alone:.2f}",
                         f"{slow:.1%}", str(len(times)), f"{gbs:.2f}" if mode else "-"])
            print(f"round {r + 1} {mode or 'alone'}: p50 {p50:.2f} ms, p90 {p90:.2f}, {gbs:.2f} GB/s", flush=True)
    who = "senders" if args.side == "prefill" else "receivers"
    head = (f"# The step thread beside the TCP KV {who}\n\n{platform.node()}: {os.cpu_count()} CPUs, "
            f"{platform.processor() or platform.machine()}, torch {torch.__version__}, device {args.device}; "
            f"pulls of {args.mib} MiB (2 MiB blocks, {args.chunk_mib} MiB chunks) paced to {args.gbps} GB/s, "
            f"{args.seconds:.0f} s a cell, "
            f"step = 32 layers x 8 small ops, torch threads {args.threads}\n")
    table = markdown_table(["round", who, "step p50 ms", "p90 ms", "x alone", "> 2x alone", "steps",
                            "reader GB/s"], rows, right={2, 3, 4, 5, 6, 7})
    publish(head + "\n" + table, args.out)


if __name__ == "__main__":
    main()
