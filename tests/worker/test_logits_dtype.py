"""Logits stay in the projection's dtype at TP = 1 (no full-vocabulary fp32 copy for a plain greedy
step): every consumer must get what it got from the fp32 copy before. Greedy argmax reads the same
values (an upcast is exact); the sampler upcasts first, so masks, bias, penalties, seeded draws
and logprobs see the fp32 logits they always did."""

from __future__ import annotations

import types

import torch

from pdserve.worker.parallel.layers import logits
from pdserve.worker.request.request import Request
from pdserve.worker.request.sampling_params import SamplingParams
from pdserve.worker.sample.sampler import Sampler

V = 512
ONE_RANK = types.SimpleNamespace(size=1)  # logits() reads only the rank count at TP = 1


def _bf16_logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, 64, generator=g).bfloat16()
    w = torch.randn(V, 64, generator=g).bfloat16()
    return logits(h, w, ONE_RANK)


def test_projection_keeps_its_dtype_and_its_values():
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(3, 64, generator=g).bfloat16(), torch.randn(V, 64, generator=g).bfloat16()
    out = logits(h, w, ONE_RANK)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out.float(), (h @ w.t()).float())  # what the fp32 path returned


def test_greedy_argmax_is_the_fp32_copys():
    lg = _bf16_logits(64)
    lg[5, 7] = lg[5, 9] = lg[5].max() + 1  # a tie: the first index, in both dtypes
    assert torch.equal(lg.argmax(-1), lg.float().argmax(-1))
    assert lg.argmax(-1)[5] == 7


def test_sampler_on_model_dtype_logits_equals_it_on_fp32():
    lg = _bf16_logits(4, seed=2)

    def batch():
        reqs = [Request("g", [1, 2], SamplingParams(temperature=0.0, logprobs=3, max_tokens=8)),
                Request("s", [1, 2], SamplingParams(temperature=0.8, seed=11, top_p=0.9, max_tokens=8)),
                Request("b", [1, 2], SamplingParams(temperature=0.0, logit_bias=((3, 50.0),), max_tokens=8)),
                Request("p", [1, 2, 3, 3], SamplingParams(temperature=0.0, repetition_penalty=1.5, max_tokens=8))]
        return reqs

    sampler = Sampler()
    tokens_bf16, lp_bf16 = sampler(lg.clone(), batch())
    tokens_f32, lp_f32 = sampler(lg.float(), batch())
    assert tokens_bf16 == tokens_f32 and tokens_bf16[2] == 3  # the bias applied
    assert lp_bf16 == lp_f32
