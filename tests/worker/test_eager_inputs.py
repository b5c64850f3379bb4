"""What an eager step's forward reads (ModelRunner._plan_eager + _eager_inputs): every token's id,
position and KV slot, and the attention metadata, for chunks long enough to take the planner's
numpy path and for the short rows beside them. The oracle is the definition, token by token."""

from __future__ import annotations

import random
import types

import pytest
import torch

from pdserve.worker.executor.model_runner import _VECTOR_ROWS, ModelRunner

BS = 16


def _request(i: int, start: int, n: int, rng: random.Random):
    total = start + n
    r = types.SimpleNamespace(request_id=f"r{i}", num_computed_tokens=start, num_scheduled_tokens=total,
                              token_ids=[rng.randrange(3, 50_000) for _ in range(total)], lora_name=None,
                              params=types.SimpleNamespace(prompt_logprobs=None))
    r.block_ids = rng.sample(range(100_000), -(-total // BS))  # scattered blocks, as a busy cache hands out
    return r


def _runner():
    runner = types.SimpleNamespace(block_size=BS, kv_groups=None, lora=None, _step_lora={}, device=torch.device("cpu"))
    runner._tensor = lambda data, dtype: ModelRunner._tensor(runner, data, dtype)
    return runner


@pytest.mark.parametrize("rows", [
    [(0, 1)] * 3 + [(37, _VECTOR_ROWS + 29)],  # decodes, then a chunk that starts mid-block
    [(0, 1024), (1024, 700)],  # a whole prompt and a later chunk of another
    [(5, _VECTOR_ROWS - 1), (0, _VECTOR_ROWS)],  # either side of the threshold
])
def test_every_token_gets_its_id_position_and_slot(rows):
    rng = random.Random(len(rows))
    reqs = [_request(i, start, n, rng) for i, (start, n) in enumerate(rows)]
    runner = _runner()
    plan, samplers = ModelRunner._plan_eager(runner, types.SimpleNamespace(items=[(r, n) for r, (_, n) in
                                                                                   zip(reqs, rows)]))
    ids, positions, meta = ModelRunner._eager_inputs(runner, plan.inputs)
    want_ids, want_pos, want_slots = [], [], []
    for r, (start, n) in zip(reqs, rows):
        for p in range(start, start + n):
            want_ids.append(r.token_ids[p])
            want_pos.append(p)
            want_slots.append(r.block_ids[p // BS] * BS + p % BS)
    assert ids.dtype == positions.dtype == meta.slot_mapping.dtype == torch.int64
    assert ids.tolist() == want_ids and positions.tolist() == want_pos and meta.slot_mapping.tolist() == want_slots
    decodes = [r for r, (_, n) in zip(reqs, rows) if n == 1]
    prefills = [(r, start + n) for r, (start, n) in zip(reqs, rows) if n > 1]
    assert meta.num_decode_tokens == len(decodes)
    assert meta.decode_context_lens.tolist() == [r.num_scheduled_tokens for r in decodes]
    assert meta.prefill_context_lens.tolist() == [end for _, end in prefills]
    cu = [0]
    for _, n in rows:
        if n > 1:
            cu.append(cu[-1] + n)
    assert meta.prefill_cu_seqlens_q.tolist() == cu
    width = meta.prefill_block_tables.shape[1]
    assert width % 16 == 0  # rounded up: the attention kernels compile one variant per width class
    for row, (r, _) in zip(meta.prefill_block_tables.tolist(), prefills):
        assert row[:len(r.block_ids)] == r.block_ids and not any(row[len(r.block_ids):])
    assert samplers == reqs  # every row reached the end of its scheduled tokens: each samples
