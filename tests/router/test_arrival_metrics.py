"""The router's arrival counters (`pdserve_router_arrived_requests`,
`pdserve_router_arrived_prompt_tokens`, per model), which the planner sizes prefill from
(operator/planner_metrics.py): they move with real requests through the real router in front of
real `pdserve worker` processes (tiny checkpoint, CPU, P/D over TCP), sent by the real `openai`
client.

With `--tokenizer` the router counts exactly the prompt tokens the workers see (the `usage` each
answer reports); without it, its text estimate. A request counts once a worker accepts it (its
first 2xx): one the router refuses before it reaches a worker (unknown model, malformed) or a
worker refuses (a prompt over its context: tests/router/test_input_bounds.py) is not counted,
and a client-chosen model name never becomes a label value.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.protocol.requests import CompletionRequest
from pdserve.router.prompt import estimate_tokens
from tests.k8s_cluster import wait_for

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3
CHAT = [{"role": "user", "content": "Tell me about foxes."}]


def arrivals(router_url: str) -> dict[tuple[str, str], float]:
    """(family, model) -> value, for the two arrival counters."""
    out: dict[tuple[str, str], float] = {}
    text = httpx.get(router_url + "/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        if family.name in ("pdserve_router_arrived_requests", "pdserve_router_arrived_prompt_tokens"):
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[(family.name, s.labels["model"])] = s.value
    return out


@pytest.fixture(scope="module")
def workers(module_launch, tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    return ckpt, module_launch.real_pd_workers(ckpt)


def wait_for_arrivals(url: str, expected: dict) -> None:
    """The router's arrival counters reach `expected` (bounded; the failure says the last read)."""
    seen: list = []
    try:
        wait_for(lambda: seen.append(arrivals(url)) or seen[-1] == expected, timeout=10, interval=0.2,
                 what=f"arrival counters {expected}")
    except AssertionError as e:
        raise AssertionError(f"{e}; last read {seen[-1:]}") from None


def test_arrival_counters_count_exact_prompt_tokens_with_a_tokenizer(module_launch, workers):
    ckpt, (prefill, decode) = workers
    router = module_launch.router("--prefill", prefill.url, "--decode", decode.url, "--tokenizer", str(ckpt))
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused")
    assert arrivals(router.url) == {}  # no series before the first request (labels are per model)

    prompt_tokens = 0
    for _ in range(2):
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
        prompt_tokens += r.usage.prompt_tokens
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, temperature=0)
    prompt_tokens += r.usage.prompt_tokens
    # Refused before any worker: not demand, and never a label value.
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-served", prompt=PROMPT, max_tokens=3)
    bad = httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": "many"},
                     timeout=30)
    assert bad.status_code == 400, bad.text  # the router's own validation, no worker called

    expected = {("pdserve_router_arrived_requests", "tiny"): 3.0,
                ("pdserve_router_arrived_prompt_tokens", "tiny"): float(prompt_tokens)}
    # Counted when a worker accepted the request, before its answer: by now it is there; the
    # bounded wait only keeps a failure message readable.
    wait_for_arrivals(router.url, expected)


def test_arrival_counters_estimate_prompt_tokens_without_a_tokenizer(module_launch, workers):
    _, (prefill, decode) = workers
    router = module_launch.router("--prefill", prefill.url, "--decode", decode.url)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused")
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices)

    expected = {
        ("pdserve_router_arrived_requests", "tiny"): 2.0,
        ("pdserve_router_arrived_prompt_tokens", "tiny"): 2.0 * estimate_tokens(CompletionRequest(prompt=PROMPT)),
    }
    wait_for_arrivals(router.url, expected)
