"""Pair remote and local block ids into contiguous runs: one descriptor per run, not per block."""

from __future__ import annotations

import numpy as np


def merge_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """[(src_start, dst_start, count)] covering src[i] -> dst[i], merged where both are consecutive."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks for {len(dst)} destination blocks")
    runs: list[list[int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def as_indices(ids) -> np.ndarray:
    """Block ids as the int32 array NIXL's make_prepped_xfer takes (a Python list costs it ~25 ns
    per id to convert, an int32 array nothing: see nixl_transport.py)."""
    if isinstance(ids, np.ndarray) and ids.dtype == np.int32:
        return ids
    return np.fromiter(ids, dtype=np.int32, count=len(ids))


def run_starts(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Positions i where a run of merge_runs(src, dst) starts (src[i] or dst[i] does not follow
    the previous id), as an int64 array; its length is the number of runs."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks for {len(dst)} destination blocks")
    if not len(src):
        return np.zeros(0, dtype=np.int64)
    breaks = (np.diff(src) != 1) | (np.diff(dst) != 1)
    return np.concatenate(([0], np.flatnonzero(breaks) + 1))


def check_indices(indices, num_pinned: int) -> list[int]:
    """A peer's block positions in a pin of `num_pinned` blocks, checked (ValueError otherwise)."""
    if not isinstance(indices, list) or not all(type(i) is int and 0 <= i < num_pinned for i in indices):
        raise ValueError(f"indices must be a list of block positions in [0, {num_pinned})")
    return indices
