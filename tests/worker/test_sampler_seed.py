"""Seeded sampling draws output token k from a stream of (seed, k) alone: the same tokens whatever
the batch, and whichever worker samples which position (P/D: prefill samples token 0, decode the
rest)."""

from __future__ import annotations

import torch

from pdserve.worker.request.request import Request
from pdserve.worker.request.sampling_params import SamplingParams
from pdserve.worker.sample.sampler import Sampler

V = 64


def _req(seed: int, num_outputs: int, rid: str = "r") -> Request:
    r = Request(rid, [1, 2, 3], SamplingParams(temperature=1.0, seed=seed, max_tokens=32))
    r.token_ids += [5] * num_outputs
    return r


def test_token_k_depends_on_seed_and_k_only():
    torch.manual_seed(0)
    logits = torch.randn(1, V)
    sampler = Sampler()
    one_worker = [sampler(logits.clone(), [_req(42, k)])[0][0] for k in range(16)]
    # A fresh process (new Request, no history) asked for position k gives the same token.
    resumed = [sampler(logits.clone(), [_req(42, k, rid=f"d{k}")])[0][0] for k in range(16)]
    assert one_worker == resumed
    assert len(set(one_worker)) > 1  # positions draw from different streams, not one repeated draw
    # Batched with other requests (seeded or not): unchanged.
    batch = [_req(7, 3, "x"), _req(42, 3), Request("u", [1], SamplingParams(temperature=1.0))]
    assert sampler(logits.repeat(3, 1), batch)[0][1] == one_worker[3]
    assert [sampler(logits.clone(), [_req(43, k)])[0][0] for k in range(16)] != one_worker
