"""A CPU step's intra-op threads (worker/executor/cpu_threads.py): every thread for a step with
prompt tokens, one fewer for a decode-only step, at least one."""

from __future__ import annotations

import torch

from pdserve.worker.executor.cpu_threads import CpuThreads


def test_decode_steps_leave_one_thread_to_the_server():
    before = torch.get_num_threads()
    try:
        threads = CpuThreads(total=2)
        assert threads.for_step(decode_only=True) == 1 and torch.get_num_threads() == 1
        assert threads.for_step(decode_only=False) == 2 and torch.get_num_threads() == 2
        assert CpuThreads(total=1).for_step(decode_only=True) == 1
    finally:
        torch.set_num_threads(before)
