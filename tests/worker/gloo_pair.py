"""Two CPU ranks of a gloo group in spawned processes, for tests of tensor-parallel pieces.

`target(rank, port_box, results)` runs in each child: rank 0 first puts ("port", port) on
`results` (the group's rendezvous port), rank 1 reads it from `port_box`; each then puts
(rank, outcome) when done (a dict, or a traceback string on failure)."""

from __future__ import annotations

import multiprocessing as mp

import torch


def run_gloo_pair(target, timeout: float = 120) -> dict:
    ctx = mp.get_context("spawn")  # children inherit TRITON_INTERPRET=1 (tests/conftest.py)
    results, port_box = ctx.Queue(), ctx.Queue()
    p0 = ctx.Process(target=target, args=(0, None, results), daemon=True)
    p0.start()
    kind, port = results.get(timeout=timeout)
    assert kind == "port", port
    port_box.put(port)
    p1 = ctx.Process(target=target, args=(1, port_box, results), daemon=True)
    p1.start()
    got = dict(results.get(timeout=timeout) for _ in range(2))
    for p in (p0, p1):
        p.join(30)
    return got


def join_gloo_group(rank: int, port_box, results) -> None:
    """In a child: join the 2-rank gloo group (rank 0 makes the store and reports its port)."""
    from pdserve.worker.parallel.group import create_store, init_tensor_parallel

    torch.set_num_threads(1)
    store = create_store(2) if rank == 0 else None
    if store is not None:
        results.put(("port", store.port))
        port = store.port
    else:
        port = port_box.get(timeout=60)  # rank 0's store port, through the test process
    init_tensor_parallel(rank, 2, torch.device("cpu"), port, store)
