"""Kernel tests run the real Triton kernels on CPU tensors under Triton's interpreter.

Triton decides interpreter-or-GPU when a kernel is decorated (at import), so the variable is set
here, before any test module imports pdserve.kernels; kernel modules that something else in the
session imported earlier are re-imported so their kernels are decorated again, interpreted.
On a CUDA machine (tier 4) the same tests run on the GPU instead, plus the real-size ones.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from tests.kernels.kernel_inputs import ON_GPU

if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in sorted(n for n in sys.modules if n.startswith("pdserve.kernels.")):
        importlib.reload(sys.modules[_name])


@pytest.fixture
def poison_empty(monkeypatch):
    """torch.empty / empty_like return NaN-filled (float) or -7-filled (int) memory during a test.

    Uninitialised memory may hold anything, so this is a legal torch.empty; a launcher that
    leaves part of its output unwritten then shows NaN instead of plausible stale numbers.
    """
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def fill(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan") if t.is_floating_point() else -7)

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: fill(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: fill(real_empty_like(*a, **kw)))
