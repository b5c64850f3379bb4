"""A CPU decode step split into row shares (worker/executor/cpu_split_decode.py) gives the unsplit
step's tokens and logits: packed bf16 linears sum a row the same whatever the call's other rows."""

from __future__ import annotations

import pytest
import torch

from pdserve.worker.executor import cpu_split_decode
from pdserve.worker.executor.cpu_split_decode import SplitDecode
from pdserve.worker.models import cpu_packed
from pdserve.worker.request.sampling_params import SamplingParams
from tests.helpers.engines import make_engine

pytestmark = pytest.mark.skipif(
    not cpu_packed.wanted(torch.device("cpu"), torch.bfloat16), reason="this CPU's oneDNN has no bf16 kernels"
)


@pytest.mark.parametrize("rows", [2, 5, 16, 33])
def test_packed_linear_rows_do_not_depend_on_the_call(rows):
    """What the split relies on: a share's rows get the bits they get in the whole batch."""
    g = torch.Generator().manual_seed(rows)
    packed = cpu_packed.pack(torch.randn(1536, 576, generator=g).bfloat16() * 0.05)
    x = torch.randn(2 * rows, 576, generator=g).bfloat16()
    whole = cpu_packed.packed_linear(x, packed, None)
    halves = torch.cat([cpu_packed.packed_linear(x[:rows], packed, None),
                        cpu_packed.packed_linear(x[rows:], packed, None)])
    assert torch.equal(whole, halves)


def test_split_steps_give_the_unsplit_answers(tiny_checkpoint, monkeypatch):
    """18 greedy sequences (two shares of 9) decoded split and unsplit: the same tokens; the split
    engine did split its decode steps and not its prompt steps."""
    monkeypatch.setattr(cpu_split_decode, "MIN_ROWS_PER_SHARE", 8)
    prompts = [list(range(10 + i, 20 + 2 * i)) for i in range(18)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ckpt = tiny_checkpoint("llama")
    monkeypatch.setenv(cpu_split_decode.ENV, "0")
    plain = make_engine(ckpt, dtype="bfloat16", kv_cache_memory=1 << 23)
    assert plain.runner.cpu_split is None
    expected = plain.generate(prompts, greedy)
    monkeypatch.delenv(cpu_split_decode.ENV)
    engine = make_engine(ckpt, dtype="bfloat16", kv_cache_memory=1 << 23)
    engine.runner.cpu_split = split = SplitDecode(2)  # two shares also where this machine has one core
    taken = []
    takes = split.takes
    monkeypatch.setattr(split, "takes", lambda plan: taken.append(takes(plan)) or taken[-1])
    assert engine.generate(prompts, greedy) == expected
    assert True in taken and False in taken
