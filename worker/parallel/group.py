"""The tensor-parallel process group: one process per rank, NCCL on CUDA, gloo on CPU, and the
rank's all-reduce communicator (communicator.py) on top of it.

Rank 0 (the serving process) creates the rendezvous store on a free loopback port before it
starts the other ranks, so the port is known without a race; every rank then joins the
default process group over that store. Collectives time out (COLLECTIVE_TIMEOUT) instead of
waiting forever, and the watchdogs in ranks.py end the worker much sooner than that when a
rank process dies.
"""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

from pdserve.worker.parallel.communicator import Communicator, set_communicator

# Long enough for a rank that compiles Triton kernels on its first step while the others wait
# in the first all-reduce; a dead rank is caught by the process watchdogs, not by this.
# PDSERVE_TP_COLLECTIVE_TIMEOUT_S shortens it for debugging a hang: NCCL's watchdog then logs
# which collective (sequence number, op, element count) each rank was stuck in, and the rank exits.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("PDSERVE_TP_COLLECTIVE_TIMEOUT_S", 600)))
STORE_HOST = "127.0.0.1"  # all ranks of a worker share one host (one pod)

log = logging.getLogger(__name__)


def create_store(world_size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port (store.port); the others connect to it."""
    return dist.TCPStore(STORE_HOST, 0, world_size, is_master=True, timeout=COLLECTIVE_TIMEOUT,
                         wait_for_workers=False)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r uses the r-th card after the configured one (cuda -> cuda:r, cuda:2 -> cuda:2+r)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def init_tensor_parallel(rank: int, world_size: int, device: torch.device, store_port: int,
                         store: dist.TCPStore | None = None) -> None:
    if device.type == "cuda":
        if device.index >= torch.cuda.device_count():
            raise RuntimeError(f"tensor-parallel rank {rank} needs {device} but only {torch.cuda.device_count()} "
                               f"CUDA devices are visible")
        torch.cuda.set_device(device)
    if store is None:
        store = dist.TCPStore(STORE_HOST, store_port, world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    backend = "nccl" if device.type == "cuda" else "gloo"
    # No `device_id=`: it opts into NCCL's eager communicator init, which on torch >= 2.7 is
    # known to hang collectives at random on multi-H100 hosts (pytorch#153960) and is ignored
    # under TORCH_DISTRIBUTED_DEBUG=DETAIL (pytorch#178977). set_device above binds the rank to
    # its card; the communicator is created by the first collective, the barrier below, on the
    # card named explicitly (as vLLM does: set_device, then a lazily initialised group).
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    log.info("tensor-parallel rank %d/%d joined the %s group on %s", rank, world_size, backend, device)
    # A first collective: every rank is connected before any of them loads weights.
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()
    log.info("tensor-parallel rank %d: first barrier passed", rank)
    # Every rank, before any weights or graphs: the symmetric buffer's rendezvous is collective.
    set_communicator(Communicator(device))


def agree_min(value: int, device: torch.device) -> int:
    """The smallest of every rank's value (KV blocks: the scheduler's block ids must exist on all)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    agreed = int(t.item())
    log.info("tensor-parallel rank %d: KV blocks own %d, smallest of all ranks %d", dist.get_rank(), value, agreed)
    return agreed


DESTROY_WAIT_S = 10.0


def shutdown_tensor_parallel() -> None:
    """Destroy the process group, but never hang a shutdown on it: with NCCL, a collective that
    another rank never joined (it died, or this rank left a step early on an error) makes
    destroy_process_group wait forever (seen on 2x H100). Past DESTROY_WAIT_S we log and go on;
    the process is exiting and the driver reclaims the communicator."""
    set_communicator(None)
    if not dist.is_initialized():
        return
    import threading

    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        finally:
            done.set()

    threading.Thread(target=destroy, name="tp-destroy", daemon=True).start()
    if not done.wait(DESTROY_WAIT_S):
        log.error("tensor-parallel: destroying the process group did not finish in %.0fs (a collective "
                  "another rank never joined); exiting without it", DESTROY_WAIT_S)
