"""Kernel tests run the real Triton kernels on CPU tensors under Triton's interpreter.

Triton picks interpreter-or-GPU when it is imported and when a kernel is decorated (its own
tl.* helpers are kernels too), so TRITON_INTERPRET=1 must be set before anything imports
triton. It is set here, which is early enough when the kernel tests are collected first; if
something imported triton earlier in the session, every kernel test fails with that reason
(set TRITON_INTERPRET=1 in the environment then) rather than skipping quietly.
On a CUDA machine (tier 4) the same tests run compiled on the GPU, plus the real-size ones.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.kernels.kernel_inputs import ON_GPU

TRITON_IMPORTED_TOO_EARLY = False
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    TRITON_IMPORTED_TOO_EARLY = "triton" in sys.modules
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def _interpreter_active():
    if TRITON_IMPORTED_TOO_EARLY:
        pytest.fail("triton was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1; "
                    "run with TRITON_INTERPRET=1 in the environment")


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
