"""A worker's per-request series (vLLM's request_success, prompt and generation tokens, e2e
latency) are recorded before the request's final output reaches the server code that writes the
last chunk or the answer: a scrape made by a client that has seen the end includes the request
(issue 23, CI determinism; the router's counterpart is tests/router/test_request_accounting.py).
"""

from __future__ import annotations

import asyncio

import pytest

from pdserve.worker.request.outputs import RequestOutput
from pdserve.worker.request.sampling_params import SamplingParams
from pdserve.worker.server.generation import Generation
from pdserve.worker.server.metrics import ServerMetrics


class ScriptedEngine:
    """Each engine request yields two outputs: a token, then the final one."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def generate(self, rid, prompt, params, kv_transfer_params=None):
        yield RequestOutput(rid, [7])
        yield RequestOutput(rid, [8], finished=True, finish_reason="length", num_prompt_tokens=len(prompt),
                            num_output_tokens=2)

    def abort(self, rid: str) -> None:
        self.aborted.append(rid)


def sample(metrics: ServerMetrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "tiny", **labels}) or 0.0


@pytest.mark.parametrize("n", [1, 3])
def test_a_request_is_recorded_before_its_final_output_is_handed_on(n):
    metrics = ServerMetrics("tiny", lambda: None)
    gen = Generation(ScriptedEngine(), metrics, {}, "cmpl-1", [[1, 2, 3]], SamplingParams(max_tokens=2), n)
    seen = []

    async def consume():
        finals = 0
        async for _, out in gen.stream():
            finals += out.finished
            if out.finished:  # what the server turns into the last chunk: already counted
                seen.append((sample(metrics, "vllm:request_success_total", finished_reason="length"),
                             sample(metrics, "vllm:generation_tokens_total"),
                             sample(metrics, "vllm:e2e_request_latency_seconds_count")))
        return finals

    assert asyncio.run(consume()) == n
    assert seen[-1] == (n, 2 * n, n)
    assert all(s[0] >= i + 1 for i, s in enumerate(seen))
