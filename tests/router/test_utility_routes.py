"""vLLM's utility routes on a real, keyed router in front of real, keyed `pdserve worker`s
(tiny checkpoint, TCP KV transfer): `/tokenize` and `/detokenize` forwarded to a worker of the
model (with the worker key) and answering what the worker answers, validated like the OpenAI
routes; `/version`, `/ping` and the docs open; `/v1/embeddings` a 400 saying why."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

KEY = "sk-router"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "Tell me about Paris."}]


@pytest.fixture(scope="module")
def stack(module_launch, tiny_checkpoint):
    # Workers and router share one key: the router presents it to the workers (its default).
    prefill, decode = module_launch.real_pd_workers(tiny_checkpoint("llama"), "--api-key", KEY)
    router = module_launch.router("--prefill", prefill.url, "--decode", decode.url, "--api-key", KEY)
    return prefill, decode, router


def post(proc, path, body, headers=AUTH):
    return httpx.post(proc.url + path, json=body, headers=headers, timeout=30)


def test_tokenize_and_detokenize_are_the_workers_answers(stack):
    _, decode, router = stack
    for body in ({"model": "tiny", "prompt": "Hello world", "return_token_strs": True},
                 {"prompt": "Hello world"},  # the one model served
                 {"model": "tiny", "messages": CHAT}):
        got, want = post(router, "/tokenize", body), post(decode, "/tokenize", body)
        assert got.status_code == 200, got.text
        assert got.json() == want.json() and got.json()["count"] > 0
    tokens = post(router, "/tokenize", {"model": "tiny", "prompt": "Hello world", "add_special_tokens": False})
    r = post(router, "/detokenize", {"model": "tiny", "tokens": tokens.json()["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": "Hello world"}
    # The chat form counts the prompt a chat completion through the router runs.
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    usage = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2).usage
    assert post(router, "/tokenize", {"model": "tiny", "messages": CHAT}).json()["count"] == usage.prompt_tokens


def test_refused_like_the_openai_routes(stack):
    _, _, router = stack
    r = post(router, "/tokenize", {"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = post(router, "/tokenize", {"model": "tiny", "prompt": ["x"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = post(router, "/detokenize", {"model": "tiny", "tokens": [-3]})  # the worker's own 400, passed through
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert post(router, "/tokenize", {"model": "tiny", "prompt": "x"}, headers={}).status_code == 401
    assert post(router, "/detokenize", {"model": "tiny", "tokens": [1]}, headers={}).status_code == 401


def test_embeddings_say_the_model_is_generative(stack):
    _, _, router = stack
    client = openai.OpenAI(base_url=router.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny", input="hello")
    assert "generative" in e.value.body["message"]


def test_version_ping_and_docs_are_open_the_rest_keyed(stack):
    _, _, router = stack
    for path in ("/version", "/ping", "/docs", "/openapi.json"):
        assert httpx.get(router.url + path, timeout=10).status_code == 200, path
    assert httpx.post(router.url + "/ping", timeout=10).status_code == 200
    spec = httpx.get(router.url + "/openapi.json", timeout=10).json()
    assert {"/v1/chat/completions", "/tokenize", "/detokenize"} <= set(spec["paths"])
    for path in ("/metrics", "/debug/workers", "/v1/models"):
        assert httpx.get(router.url + path, timeout=10).status_code == 401, path
