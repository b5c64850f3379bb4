"""What a decode graph reads: the static buffers DecodeGraphs.run fills, step after step.

The host side copies whole buffers and packs the block tables (cuda_graphs.py): whatever an
earlier step left beyond this step's rows and columns must not reach what the graph reads. The
forward here records its inputs (capture=False runs the same buffers and padding on CPU).
"""

from __future__ import annotations

import torch

from pdserve.worker.executor.cuda_graphs import DecodeGraphConfig, DecodeGraphs

HIDDEN = 4


class Recorder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, ids, positions, meta):
        sliding = meta.sliding
        self.calls.append(dict(
            ids=ids.tolist(), positions=positions.tolist(), slots=meta.slot_mapping.tolist(),
            lens=meta.decode_context_lens.tolist(), tables=meta.decode_block_tables.tolist(),
            sliding_slots=None if sliding is None else sliding.slot_mapping.tolist(),
            sliding_tables=None if sliding is None else sliding.decode_block_tables.tolist()))
        return torch.zeros(ids.shape[0], HIDDEN)


def step(graphs: DecodeGraphs, n: int, seed: int, sliding: bool):
    """One decode step of n sequences with block tables of different lengths; returns its inputs."""
    g = torch.Generator().manual_seed(seed)

    def ints(k, hi):
        return torch.randint(0, hi, (k,), generator=g).tolist()

    lengths = torch.randint(1, graphs.config.max_blocks_per_seq + 1, (n,), generator=g).tolist()
    tables = [ints(k, 50) for k in lengths]
    inputs = dict(input_ids=ints(n, 1000), positions=ints(n, 500), slots=ints(n, 800), context_lens=ints(n, 500),
                  block_tables=tables)
    if sliding:
        inputs["sliding"] = (ints(n, 800), [ints(k, 50) for k in lengths])
    hidden = graphs.run(**inputs)
    assert hidden.shape == (n, HIDDEN)
    return inputs


def check(call: dict, inputs: dict, b: int) -> None:
    n = len(inputs["input_ids"])
    pad = b - n
    assert call["ids"] == inputs["input_ids"] + [0] * pad
    assert call["positions"] == inputs["positions"] + [0] * pad
    assert call["slots"] == inputs["slots"] + [-1] * pad
    assert call["lens"] == inputs["context_lens"] + [1] * pad
    assert len(call["tables"]) == b
    for row, t in zip(call["tables"], inputs["block_tables"]):
        assert row[:len(t)] == t  # the columns past a row's length are never read
    if "sliding" in inputs:
        s_slots, s_tables = inputs["sliding"]
        assert call["sliding_slots"] == s_slots + [-1] * pad
        for row, t in zip(call["sliding_tables"], s_tables):
            assert row[:len(t)] == t


def run_steps(sliding: bool) -> None:
    model = Recorder()
    graphs = DecodeGraphs(model, DecodeGraphConfig(max_batch=12, max_blocks_per_seq=7, capture=False,
                                                   sliding=sliding), torch.device("cpu"))
    # Growing, shrinking and repeated batch sizes: each step's buffers (two host slots in
    # rotation) still hold an earlier step's longer rows and tables.
    for i, n in enumerate([12, 3, 9, 1, 12, 5, 5, 2, 11, 1]):
        inputs = step(graphs, n, seed=i, sliding=sliding)
        check(model.calls[-1], inputs, graphs.bucket(n))
    assert graphs.num_replays == 10


def test_each_step_reads_its_own_inputs():
    run_steps(sliding=False)


def test_each_step_reads_its_own_inputs_with_a_sliding_group():
    run_steps(sliding=True)
