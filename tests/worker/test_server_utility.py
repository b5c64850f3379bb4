"""vLLM's utility routes and CORS on a real, keyed `pdserve worker` (tiny checkpoint):
`/tokenize` (completion and chat forms), `/detokenize`, `/version`, `/ping`, the docs, and
`/v1/embeddings` refused as a 400 naming the reason, called with the real `openai` client
where it has a method."""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.worker.test_server_harness import WorkerProcess

NAME = "tiny-llama"
KEY = "sk-worker"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about Paris."}]


@pytest.fixture(scope="module")
def worker(tiny_checkpoint):
    with WorkerProcess(tiny_checkpoint("llama"), "--served-model-name", NAME, "--max-model-len", "256",
                       "--kv-cache-memory", str(32 << 20), "--api-key", KEY, "--log-level", "warning") as w:
        yield w


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))


def post(worker, path, body, headers=AUTH):
    return httpx.post(worker.url + path, json=body, headers=headers, timeout=30)


def test_tokenize_a_prompt(worker, tokenizer):
    r = post(worker, "/tokenize", {"model": NAME, "prompt": "Hello world", "return_token_strs": True})
    assert r.status_code == 200, r.text
    want = tokenizer("Hello world")["input_ids"]
    assert r.json() == {"count": len(want), "max_model_len": 256, "tokens": want,
                        "token_strs": tokenizer.convert_ids_to_tokens(want)}
    r = post(worker, "/tokenize", {"prompt": "Hello world", "add_special_tokens": False})  # model is optional
    assert r.json()["tokens"] == tokenizer("Hello world", add_special_tokens=False)["input_ids"]
    assert r.json()["token_strs"] is None


def test_tokenize_messages_counts_the_chat_prompt(worker):
    """The chat form's count is the prompt a chat completion of those messages runs."""
    client = openai.OpenAI(base_url=worker.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    usage = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=1).usage
    r = post(worker, "/tokenize", {"model": NAME, "messages": CHAT})
    assert r.status_code == 200, r.text
    assert r.json()["count"] == usage.prompt_tokens == len(r.json()["tokens"])
    without = post(worker, "/tokenize", {"model": NAME, "messages": CHAT, "add_generation_prompt": False}).json()
    assert without["count"] < r.json()["count"] and r.json()["tokens"][:without["count"]] == without["tokens"]


def test_detokenize_round_trips(worker, tokenizer):
    ids = post(worker, "/tokenize", {"model": NAME, "prompt": "The quick brown fox", "add_special_tokens": False})
    r = post(worker, "/detokenize", {"model": NAME, "tokens": ids.json()["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": "The quick brown fox"}


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"model": NAME}, 400, "prompt"),
    ("/tokenize", {"model": NAME, "prompt": 5}, 400, "prompt"),
    ("/tokenize", {"model": NAME, "messages": []}, 400, "messages"),
    ("/detokenize", {"model": NAME, "tokens": [1, -1]}, 400, "tokens"),
    ("/detokenize", {"model": NAME, "tokens": "12"}, 400, "tokens"),
    ("/detokenize", {"model": NAME, "tokens": [10 ** 9]}, 400, "tokens"),
])
def test_bad_bodies_are_openai_errors(worker, path, body, status, param):
    r = post(worker, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_embeddings_say_the_model_is_generative(worker):
    client = openai.OpenAI(base_url=worker.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=NAME, input="hello")
    assert "generative" in e.value.body["message"] and "embeddings are not supported" in e.value.body["message"]


def test_what_stays_open_and_what_needs_the_key(worker):
    for path in ("/version", "/ping", "/health", "/docs", "/openapi.json"):
        assert httpx.get(worker.url + path, timeout=10).status_code == 200, path
    assert httpx.post(worker.url + "/ping", timeout=10).status_code == 200
    assert httpx.get(worker.url + "/version", timeout=10).json()["version"]
    spec = httpx.get(worker.url + "/openapi.json", timeout=10).json()
    assert {"/v1/chat/completions", "/tokenize", "/detokenize"} <= set(spec["paths"])
    assert "/kv/release" not in spec["paths"] and "/debug/kv" not in spec["paths"]
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]}),
                       ("/v1/embeddings", {"model": NAME, "input": "x"})):
        assert post(worker, path, body, headers={}).status_code == 401, path
    for path in ("/metrics", "/debug/kv", "/v1/models"):
        assert httpx.get(worker.url + path, timeout=10).status_code == 401, path


def test_cors_preflight_without_a_key(worker):
    r = httpx.options(worker.url + "/v1/completions", timeout=10, headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    r = post(worker, "/tokenize", {"prompt": "x"}, headers={**AUTH, "Origin": "https://app.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
