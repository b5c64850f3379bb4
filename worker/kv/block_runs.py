"""Pair remote and local block ids into contiguous runs: one descriptor per run, not per block."""

from __future__ import annotations


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
