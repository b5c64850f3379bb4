"""One request's failure inside a step stays that request's.

A step is batched, but the work that reads a request's own data (its grammar, the token ids it
named, its sampling numbers) is per row. Each such piece runs under `isolated(req, stage)`: an
exception there marks the request failed (`Request.failure`) and the step goes on; the scheduler
then ends that request as FINISHED_ERROR, the client gets an error for it alone, and the engine
keeps serving everyone else. Only a device fault (a CUDA error, the device out of memory) passes
through: the device is then unusable for every request and the engine must die (the worker's
/health turns 503 and the pod restarts). A dead engine is for dead hardware, never for input.

Work under a guard must fail on the host, before it touches a tensor with the request's data:
an index outside a tensor is a Python error on the CPU but a device-side assert on a GPU, which
poisons the CUDA context for every request. So token ids are checked (`columns`) before they
index, and probabilities are made valid before they are sampled (sampler.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

log = logging.getLogger(__name__)

# The client sees the failure's first line, not a wall of internals.
MAX_REASON_CHARS = 300
_DEVICE_ERROR_MARKERS = ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "cuDNN error", "NCCL error",
                         "device-side assert", "HIP error")


def is_device_fault(e: BaseException) -> bool:
    """The device itself failed: nothing on it can be trusted any more, whichever request ran."""
    if isinstance(e, (torch.OutOfMemoryError, torch.AcceleratorError)):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _DEVICE_ERROR_MARKERS)


@contextmanager
def isolated(req, stage: str) -> Iterator[None]:
    """Run one request's own part of a step; an exception marks `req` failed (the first one is
    kept and logged) instead of failing the step. Device faults are re-raised."""
    try:
        yield
    except Exception as e:
        if is_device_fault(e):
            raise
        if req.failure is None:
            log.warning("request %s failed in %s; it ends with an error, the engine carries on",
                        req.request_id, stage, exc_info=True)
            reason = f"{stage} failed: {type(e).__name__}: {e}".splitlines()[0]
            req.failure = reason[:MAX_REASON_CHARS]


def columns(ids: Iterable[int], width: int, what: str) -> list[int]:
    """`ids` as a list of logits columns, checked on the host (an index outside the tensor must
    be a Python error, never a device-side assert)."""
    out = list(ids)
    bad = next((t for t in out if not 0 <= t < width), None)
    if bad is not None:
        raise IndexError(f"{what} token id {bad} is outside the logits (width {width})")
    return out
