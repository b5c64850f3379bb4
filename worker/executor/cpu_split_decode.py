"""A CPU decode step of many sequences computed as row shares side by side, one per core.

A decode step leaves a core to the server's threads (cpu_threads.py) because torch splits every
op of a step over its threads, and one preempted thread stalls each op at its barrier. Yet from
about 16 sequences up the step is long and the server's threads use little of that core (at 32
concurrent streams the event loop is ~3% of a core and the bench client ~25%). Split the batch
instead of the ops: each share of the rows runs the whole model (its linears, attention and logits)
on one intra-op thread of its own, and the shares only meet at the end. A preempted share delays
the step by what it had left, not every op; the other share's ops never wait for it.

The shares read the same weights at about the same time (each layer's few MB stay in the L3 for
the other share), and every row's values are the unsplit step's: the linears' sums do not depend
on how many rows a call has from two rows up (oneDNN's bf16 GEMM on this machine; checked by
tests/worker/test_cpu_split_decode.py), the norms, rotary and attention are per row or per sequence.

Only plain decode steps split: every row one token, no LoRA, no sliding-window group, no tokens
taken from a step in flight, no prompt logprobs. `PDSERVE_CPU_SPLIT_DECODE=0` turns it off.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

ENV = "PDSERVE_CPU_SPLIT_DECODE"
# Rows a share needs: below this a share's linears read the weights for too few rows (memory-bound,
# and two shares read them twice), where one thread over the whole batch is as fast.
MIN_ROWS_PER_SHARE = 8


def _one_thread() -> None:
    torch.set_num_threads(1)


class SplitDecode:
    def __init__(self, shares: int):
        """`shares`: row shares of a split step (one per core); the step thread computes the first,
        a pool of shares - 1 threads the others."""
        self.shares = shares
        self._pool = ThreadPoolExecutor(shares - 1, thread_name_prefix="cpu-decode-share", initializer=_one_thread)

    @classmethod
    def for_cpu(cls, cores: int) -> "SplitDecode | None":
        if cores < 2 or os.environ.get(ENV, "1") == "0":
            return None
        return cls(cores)

    def takes(self, plan) -> bool:
        """A plain decode step (see the module docstring) with enough rows for every share."""
        _, _, _, _, dec_lens, _, pre_lens, _, sliding = plan.inputs
        return (not pre_lens and sliding is None and not plan.from_previous and plan.lora_slots is None
                and not plan.prompt_rows and len(dec_lens) >= MIN_ROWS_PER_SHARE * self.shares)

    def run(self, plan, forward) -> torch.Tensor:
        """The step's logits for plan.logits_idx: `forward(inputs, logits_idx)` (the runner's model
        and projection over a share's inputs) once per share, in order, concatenated."""
        input_ids, positions, slots, dec_tables, dec_lens, pre_tables, pre_lens, cu, _ = plan.inputs
        n = len(dec_lens)
        step = -(-n // self.shares)
        jobs = []
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            share = (input_ids[lo:hi], positions[lo:hi], slots[lo:hi], dec_tables[lo:hi], dec_lens[lo:hi],
                     pre_tables, pre_lens, cu, None)
            jobs.append((share, [i - lo for i in plan.logits_idx if lo <= i < hi]))
        futures = [self._pool.submit(_in_inference_mode, forward, *job) for job in jobs[1:]]
        parts = [forward(*jobs[0])]
        parts += [f.result() for f in futures]
        return torch.cat([p for p in parts if p is not None])

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)


def _in_inference_mode(forward, inputs, logits_idx):
    with torch.inference_mode():  # per thread: the pool's threads need it too
        return forward(inputs, logits_idx)
