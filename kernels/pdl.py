"""Programmatic dependent launch (PDL, sm_90+): a decode step's kernels overlap their launches.

A bs=1 decode step is a chain of a few hundred small kernels, each of which normally starts only
after the one before it has drained; the gap is ~0.5-1 us a kernel. Launched with PDL, a kernel's
programs may become resident while the previous kernel still runs, and wait inside (`gdc_wait`)
until that kernel has finished and its writes are visible. Every kernel launched so calls
`pdl_enter(PDL)` before any load or store, which keeps the stream's order intact:

- nothing is read or written before the previous kernel has completed, so no stale read and no
  write under a reader (the wait covers the kernel before, which itself waited for its own
  predecessor: completion is transitive along the chain). One exception: a weight, which no
  kernel of a step writes, may be read before the wait (the GEMVs' `EARLY_W` first tile, to
  overlap the previous kernel's tail); tests/kernels/test_pdl.py checks that nothing else is;
- `gdc_launch_dependents` right away lets the next kernel be scheduled as soon as every program of
  this one is resident (programs never wait for a later kernel, so nothing can deadlock);
- a kernel launched plainly (cuBLAS, torch) waits for full completion as always, and one launched
  with PDL after it waits at `gdc_wait` for that kernel's end.

CUDA graphs capture the launches as programmatic edges. `set_programmatic_launch` is a
process-wide switch (initially PDSERVE_PDL, default on); `pdl_args(device)` gives a launch on
`device` its arguments: PDL on NVIDIA cards of compute capability 9.0 and up, never in the interpreter.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from pdserve.kernels.launch import interpreting

# On by default where the card has it; PDSERVE_PDL=0 turns it off for a whole process (A/B runs
# of any bench or server on one card).
_ENABLED = os.environ.get("PDSERVE_PDL", "1").strip() not in ("0", "false", "off", "")


def set_programmatic_launch(on: bool) -> None:
    """Turns PDL on or off for every later launch in this process (graphs captured before keep theirs)."""
    global _ENABLED
    _ENABLED = bool(on)


def programmatic_launch_enabled() -> bool:
    return _ENABLED


@functools.cache
def _capable(device: torch.device) -> bool:
    # NVIDIA only (ROCm's devices are "cuda" too, without PDL), compute capability 9.0+, and a
    # Triton that has griddepcontrol (3.3+; pyproject allows older).
    return (device.type == "cuda" and not interpreting() and torch.version.hip is None
            and hasattr(tl.extra.cuda, "gdc_wait")
            and torch.cuda.get_device_capability(device)[0] >= 9)


_ON = {"PDL": True, "launch_pdl": True}
_OFF: dict = {}


def pdl_args(device: torch.device) -> dict:
    """A launch's PDL arguments, `kernel[grid](..., **pdl_args(x.device))`: the kernel's PDL
    constexpr and the launch option that makes it a programmatic dependent, or nothing when off
    (Triton's interpreter and older launchers do not know the option)."""
    return _ON if _ENABLED and _capable(device) else _OFF


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    # First statement of every kernel launched with PDL (the module doc): let the next kernel be
    # scheduled, then wait for the previous one's completion and memory.
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
