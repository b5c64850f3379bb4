"""The all-reduce of the tensor-parallel layers, chosen per message: symmetric memory for the
small ones, NCCL for the large ones, gloo on CPU.

Why: a decode step of Llama-3.1-8B at bs=1 runs 65 all-reduces of 8 KB each. NCCL's ring costs
about 20 us for that (issue 25, measured on H200), which at TP=4 is as long as the step's matrix
products. PyTorch's symmetric-memory ops (torch.distributed._symmetric_memory, CUDA P2P buffers
mapped into every rank of the node) read the peers' buffers straight over NVLink:
- one-shot: every rank reads every peer's whole buffer and sums (one round, N x the bytes read);
  lowest latency, best up to a few hundred KB;
- two-shot: reduce-scatter then all-gather through the same buffers (two rounds, 2x the bytes);
  better for mid-size messages.
Both are captured in CUDA graphs (the buffer is allocated and exchanged once, before capture;
every call copies the input into it, so the graph's addresses never change). NCCL stays for
messages larger than the buffer (prefill) and for what the ops do not support (dtypes other
than bf16 / fp32, misaligned sizes); gloo runs every message on CPU (tests, `--device cpu`).

We use PyTorch's maintained ops rather than a kernel of our own (vLLM's custom all-reduce,
SGLang's): the same algorithms, kept working across CUDA and driver versions by PyTorch, and no
IPC-handle plumbing here. Limitation: ranks must share one host with P2P access between cards
(a TP worker is one pod); without it the buffer's rendezvous fails and NCCL is used for all.

`PDSERVE_TP_ALL_REDUCE` = nccl (default) | auto | one_shot | two_shot: NCCL for every message,
or the per-message choice above, or one method forced (benchmarks compare them in one run); the
chosen method per message size is logged once. NCCL stays the default until `auto` wins where
it counts. Measured (docs/tp-gpu-results.md): 65 all-reduces back to back in one graph take
6.5 us each one-shot against NCCL's 21 us on H200, but inside a real decode step, with the
matrix products between them, NCCL's kernel takes 7.7 us and the one-shot 7.1 us (torch.profiler
of the step's graph), so the step barely changes (3.92 against 3.97 ms at TP=2 on H200).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Thresholds of PyTorch's own intra-node all-reduce (intra_node_comm.cpp): one-shot up to
# 256 KB, two-shot up to 10 MB. The buffer is sized for the largest two-shot message.
ONE_SHOT_MAX_BYTES = 256 << 10
TWO_SHOT_MAX_BYTES = 8 << 20
SYMM_DTYPES = (torch.bfloat16, torch.float32)
ALIGN_BYTES = 16  # the ops' vectorised loads; a misaligned size goes to NCCL
METHODS = ("auto", "nccl", "one_shot", "two_shot")


@dataclasses.dataclass(frozen=True)
class AllReduceConfig:
    method: str = "nccl"
    one_shot_max_bytes: int = ONE_SHOT_MAX_BYTES
    buffer_bytes: int = TWO_SHOT_MAX_BYTES

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"PDSERVE_TP_ALL_REDUCE must be one of {', '.join(METHODS)}, got {self.method!r}")

    @classmethod
    def from_env(cls) -> AllReduceConfig:
        return cls(method=os.environ.get("PDSERVE_TP_ALL_REDUCE", "nccl"))


def choose(nbytes: int, dtype: torch.dtype, device_type: str, world_size: int, symm_ready: bool,
           config: AllReduceConfig) -> str:
    """Which method reduces a message: "gloo" | "nccl" | "one_shot" | "two_shot". Pure, so the
    dispatch is tested on CPU (tests/worker/test_parallel_layers.py)."""
    if device_type != "cuda":
        return "gloo"
    if config.method == "nccl" or not symm_ready:
        return "nccl"
    fits = (dtype in SYMM_DTYPES and 0 < nbytes <= config.buffer_bytes and nbytes % ALIGN_BYTES == 0)
    if not fits:
        return "nccl"
    if config.method in ("one_shot", "two_shot"):
        method = config.method
    else:
        method = "one_shot" if nbytes <= config.one_shot_max_bytes else "two_shot"
    if method == "two_shot" and (world_size not in (2, 4, 8) or nbytes % (ALIGN_BYTES * world_size)):
        return "one_shot"  # two-shot: equal aligned slices per rank, built for 2, 4 or 8 ranks
    return method


class Communicator:
    """The tensor-parallel group's all-reduce on one rank. Create after the process group, on
    every rank, before any graph capture (the symmetric buffer's rendezvous is collective)."""

    def __init__(self, device: torch.device, config: AllReduceConfig | None = None):
        self.config = config or AllReduceConfig.from_env()
        self.device = device
        self.world_size = dist.get_world_size()
        self.buffer = None
        self.group_name = None
        self._copy_in_kernel = False
        self._logged: set[tuple[str, int]] = set()
        if device.type == "cuda" and self.config.method != "nccl" and self.world_size > 1:
            self._init_symmetric()

    @property
    def symm_ready(self) -> bool:
        return self.buffer is not None

    def _init_symmetric(self) -> None:
        error = None
        try:
            import torch.distributed._symmetric_memory as symm_mem

            group = dist.group.WORLD
            self.group_name = group.group_name
            if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.8, a no-op since
                symm_mem.enable_symm_mem_for_group(self.group_name)
            ops = torch.ops.symm_mem
            if not (hasattr(ops, "one_shot_all_reduce_out") and hasattr(ops, "two_shot_all_reduce_out")):
                raise RuntimeError("this torch has no symm_mem one-shot/two-shot all-reduce")
            buf = symm_mem.empty(self.config.buffer_bytes, dtype=torch.uint8, device=self.device)
            symm_mem.rendezvous(buf, self.group_name)
            self.buffer = buf
            self._copy_in_kernel = hasattr(ops, "one_shot_all_reduce_copy_out")
            self._self_test()
        except Exception as e:  # no P2P between the cards, an old torch, a wrong sum
            error = e
        # Every rank uses the buffer or none does: a rank whose set-up or first sum failed would
        # otherwise wait in NCCL while the others wait on its signal pad.
        ok = torch.tensor([0 if error else 1], dtype=torch.int32, device=self.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() == 1:
            log.info("tensor-parallel rank %d: symmetric-memory all-reduce ready (%d MiB buffer; one-shot up to "
                     "%d KB, two-shot up to %d MB, NCCL above)", dist.get_rank(), self.config.buffer_bytes >> 20,
                     self.config.one_shot_max_bytes >> 10, self.config.buffer_bytes >> 20)
            return
        self.buffer = None
        log.warning("tensor-parallel rank %d: symmetric-memory all-reduce unavailable (%s); NCCL for all messages",
                    dist.get_rank(), error or "another rank could not set it up")

    def _self_test(self) -> None:
        """One sum per method before any graph captures it: small integers add exactly in bf16."""
        n, rank = self.world_size, dist.get_rank()
        for method, rows in (("one_shot", 1), ("two_shot", 64)):
            if method == "two_shot" and n not in (2, 4, 8):
                continue  # choose() never picks it there
            base = (torch.arange(rows * 4096, device=self.device) % 7).to(torch.bfloat16)
            got = self._symmetric(method, base + rank)
            if not torch.equal(got, base * n + n * (n - 1) // 2):
                raise RuntimeError(f"{method} all-reduce self-test gave a wrong sum")

    def _symmetric(self, method: str, x: torch.Tensor) -> torch.Tensor:
        staged = self.buffer[:x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        ops = torch.ops.symm_mem
        if method == "one_shot":
            if self._copy_in_kernel:  # the copy into the buffer runs inside the all-reduce kernel
                ops.one_shot_all_reduce_copy_out(staged, x, "sum", self.group_name, x)
            else:
                staged.copy_(x)
                ops.one_shot_all_reduce_out(staged, "sum", self.group_name, x)
        else:
            staged.copy_(x)
            ops.two_shot_all_reduce_out(staged, "sum", self.group_name, x)
        return x

    def method(self, x: torch.Tensor) -> str:
        return choose(x.numel() * x.element_size(), x.dtype, x.device.type, self.world_size, self.symm_ready,
                      self.config)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x (in place for gloo/NCCL; returns the result either way)."""
        method = self.method(x)
        key = (method, x.numel() * x.element_size())
        if key not in self._logged and len(self._logged) < 16:
            self._logged.add(key)
            log.info("tensor-parallel all-reduce of %d bytes (%s): %s", key[1], x.dtype, method)
        if method in ("gloo", "nccl"):
            dist.all_reduce(x)
            return x
        return self._symmetric(method, x)


_current: Communicator | None = None


def set_communicator(comm: Communicator | None) -> None:
    """The rank's communicator, used by every parallel layer (one tensor-parallel group per process)."""
    global _current
    _current = comm


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _current is None:  # a layer used outside a TP worker (e.g. a test of one layer): plain NCCL/gloo
        dist.all_reduce(x)
        return x
    return _current.all_reduce(x)


def share_from_rank0(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's `t` on every rank of the tensor-parallel group, in place (the others pass a buffer
    of the same shape and dtype): async scheduling's sampled token ids, which only rank 0 samples.
    Queued on the current stream like the layers' collectives, so no host waits for it."""
    dist.broadcast(t, src=0)
    return t
