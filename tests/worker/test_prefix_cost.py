"""The pull-or-recompute estimate (worker/kv/prefix_cost.py): priors, online updates, the fixed link."""

from __future__ import annotations

import pytest

from pdserve.worker.kv.prefix_cost import LINK_PRIOR_BYTES_PER_S, PREFILL_PRIOR_TOKENS_PER_S, PrefixPullCost


def _count(cost: PrefixPullCost, choice: str) -> float:
    return cost.decisions.labels(choice)._value.get()


@pytest.mark.parametrize(
    "tokens, nbytes, pull",
    [
        (1000, 10**8, True),  # 0.1 s on the 1 GB/s prior vs 0.2 s at the 5000 tokens/s prior
        (1000, 4 * 10**8, False),  # 0.4 s vs 0.2 s
    ],
)
def test_priors_decide_before_anything_is_measured(tokens, nbytes, pull):
    cost = PrefixPullCost()
    assert (cost.link_bytes_per_s, cost.prefill_tokens_per_s) == (LINK_PRIOR_BYTES_PER_S, PREFILL_PRIOR_TOKENS_PER_S)
    assert cost.choose_pull(tokens, nbytes) is pull
    assert _count(cost, "pull" if pull else "recompute") == 1


def test_measurements_move_the_crossover():
    cost = PrefixPullCost()
    assert cost.choose_pull(1000, 10**8)
    for _ in range(40):  # the link turns out slow: 10 MB/s
        cost.observe_pull(10**7, 1.0)
    assert cost.link_bytes_per_s == pytest.approx(10**7, rel=0.01)
    assert not cost.choose_pull(1000, 10**8)
    for _ in range(40):  # and the prefill slower still: 50 tokens/s
        cost.observe_prefill(500, 10.0)
    assert cost.choose_pull(1000, 10**8)
    cost.observe_prefill(4, 0.001)  # too few tokens to say anything about the prefill's speed
    assert cost.prefill_tokens_per_s == pytest.approx(50, rel=0.01)


def test_a_fixed_link_is_not_measured():
    cost = PrefixPullCost(fixed_link_bytes_per_s=1e3)
    cost.observe_pull(10**9, 0.1)
    assert cost.link_bytes_per_s == 1e3
    assert not cost.choose_pull(10**6, 10**6)
