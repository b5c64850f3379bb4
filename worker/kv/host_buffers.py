"""Host bounce buffers for the TCP data path: page-locked, reused, bounded.

A GPU's KV bytes reach a socket through host memory. Page-locked (pinned) buffers make the
device<->host copies asynchronous DMA (a pageable copy is staged by the driver and blocks), and
allocating them is slow (cudaHostAlloc maps every page), so they are allocated once and reused.

The pool's whole footprint is capped (`max_bytes`): a transfer takes all the buffers it needs
at once (so two transfers never deadlock holding half each) and waits, bounded, while they are
taken; a free buffer of another size is given back to the allocator to make room. A transfer
that ends (done, failed or hung up) gives its buffers back; `in_use` says how many bytes are
taken now (tests wait for it to return to 0).

On a CPU cache the buffers are plain memory (pinning needs a CUDA driver).
"""

from __future__ import annotations

import threading
import time

import torch


class BuffersBusy(RuntimeError):
    """Every buffer stayed taken for the caller's whole timeout."""


class HostBufferPool:
    def __init__(self, max_bytes: int, pinned: bool):
        self.max_bytes, self.pinned = max_bytes, pinned
        self._cond = threading.Condition()
        self._free: dict[int, list[torch.Tensor]] = {}  # size -> free buffers of that size
        self._allocated = 0  # bytes of every buffer alive (free or taken)
        self.in_use = 0  # bytes taken now

    def take(self, size: int, count: int, timeout_s: float) -> list[torch.Tensor]:
        """`count` uint8 buffers of `size` bytes, the caller's until give_back()."""
        need = size * count
        if need > self.max_bytes:
            raise ValueError(f"{count} host buffers of {size} bytes exceed the pool's {self.max_bytes} bytes")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                free = self._free.setdefault(size, [])
                reusable = min(count, len(free))
                fresh = (count - reusable) * size
                if self._allocated + fresh > self.max_bytes:
                    self._evict(self._allocated + fresh - self.max_bytes, keep=size)
                if self._allocated + fresh <= self.max_bytes:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BuffersBusy(f"the {self.max_bytes >> 20} MiB of KV host buffers stayed in use for "
                                      f"{timeout_s:.1f}s")
                self._cond.wait(left)
            out = [free.pop() for _ in range(reusable)]
            self._allocated += fresh
            self.in_use += need
        try:
            out += [torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned) for _ in range(count - reusable)]
        except BaseException:
            self.give_back(out)
            with self._cond:
                self._allocated -= fresh
                self.in_use -= fresh
                self._cond.notify_all()
            raise
        return out

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        with self._cond:
            for buf in buffers:
                self._free.setdefault(buf.numel(), []).append(buf)
                self.in_use -= buf.numel()
            self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """True once no buffer is taken (tests: a transfer that ended gave everything back)."""
        with self._cond:
            return self._cond.wait_for(lambda: self.in_use == 0, timeout_s)

    def _evict(self, nbytes: int, keep: int) -> None:
        """Under the lock: free buffers of other sizes than `keep` until `nbytes` are gone."""
        for size, free in self._free.items():
            while free and size != keep and nbytes > 0:
                free.pop()
                self._allocated -= size
                nbytes -= size
