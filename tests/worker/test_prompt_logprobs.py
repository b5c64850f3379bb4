"""Prompt logprobs (echo + logprobs, and vLLM's prompt_logprobs): equal to Hugging Face's
log_softmax over the same tiny checkpoint in fp32, in the engine (whole and chunked prefills,
prefix cache on, batched with others) and through the HTTP server with the real `openai` client."""

from __future__ import annotations

import functools

import httpx
import openai
import pytest
import torch

from pdserve.worker.engine.llm_engine import LLMEngine
from pdserve.worker.request.sampling_params import SamplingParams
from tests.helpers.engines import make_engine
from tests.worker.test_server_harness import WorkerProcess

TOL = 1e-4
PROMPTS = [[5, 17, 300, 42, 9, 1000, 77], list(range(100, 137)), [3, 4], [900 + 7 * i for i in range(19)], [11]]
TOP = 3


@functools.lru_cache(maxsize=None)
def hf_logprobs(ckpt: str, prompt: tuple[int, ...]) -> torch.Tensor:
    """[P-1, V]: log_softmax of HF's logits at positions 0..P-2 (each scores the next token)."""

    model = _hf_model(ckpt)
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt)])).logits[0].float()
    return logits.log_softmax(-1)[:-1]


@functools.lru_cache(maxsize=None)
def _hf_model(ckpt: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def check_against_hf(ckpt, prompt: list[int], entries, top: int) -> float:
    """Assert `entries` (one per prompt token) equal HF's; return the largest difference seen."""
    ref = hf_logprobs(str(ckpt), tuple(prompt))
    assert len(entries) == len(prompt) and entries[0] is None
    worst = 0.0
    for p in range(1, len(prompt)):
        e, row = entries[p], ref[p - 1]
        assert e.token_id == prompt[p]
        worst = max(worst, abs(e.logprob - float(row[prompt[p]])))
        assert e.rank in ranks_within_tol(row, prompt[p])
        vals, ids = row.topk(top)
        assert [t for t, _ in e.top] == ids.tolist()
        worst = max(worst, max(abs(v - float(r)) for (_, v), r in zip(e.top, vals)))
    assert worst < TOL, worst
    return worst


def ranks_within_tol(row: torch.Tensor, token: int) -> range:
    """The ranks (1 = best) `token` may take in `row` when values within TOL of its own may tie."""
    v = float(row[token])
    return range(1 + int((row > v + TOL).sum()), 1 + int((row > v - TOL).sum()))  # the latter counts token too


def run_engine(engine: LLMEngine, prompts, params_list) -> dict[int, tuple[list[int], list]]:
    out = {}
    for i, (p, sp) in enumerate(zip(prompts, params_list)):
        engine.add_request(f"r{i}", p, sp)
        out[i] = ([], None)
    pending = set(range(len(prompts)))
    while pending:
        for o in engine.step():
            i = int(o.request_id[1:])
            toks, plp = out[i]
            if o.prompt_logprobs is not None:
                assert plp is None, "prompt logprobs are sent once"
                plp = o.prompt_logprobs
            out[i] = (toks + o.new_token_ids, plp)
            if o.finished:
                pending.discard(i)
    return out


@pytest.mark.parametrize("budget", [None, 5])  # 5: every prompt is prefilled in chunks
def test_engine_prompt_logprobs_equal_hf(tiny_checkpoint, budget):
    ckpt = tiny_checkpoint("llama")
    engine = make_engine(ckpt, max_num_batched_tokens=budget,
                         # Whole prefills: 3 logit rows per LM-head slice, so long prompts take many.
                         max_num_seqs=3 if budget is None else 64)
    echo = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    # Warm the prefix cache with the same prompts first: echo requests must not take cached blocks.
    run_engine(engine, PROMPTS, [plain] * len(PROMPTS))
    # Batched with plain requests (which do hit the cache and get no prompt logprobs).
    prompts = PROMPTS + PROMPTS
    out = run_engine(engine, prompts, [echo] * len(PROMPTS) + [plain] * len(PROMPTS))
    for i, p in enumerate(PROMPTS):
        check_against_hf(ckpt, p, out[i][1], TOP)
        assert out[len(PROMPTS) + i][1] is None
        assert out[i][0] == out[len(PROMPTS) + i][0]  # the same greedy tokens either way
    assert engine.runner.prompt_logprobs._by_request == {}  # nothing left behind
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def test_engine_prompt_logprobs_zero_top_and_abort(tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    engine = make_engine(ckpt, max_num_batched_tokens=5)
    p = PROMPTS[1]
    out = run_engine(engine, [p], [SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)])
    entries = out[0][1]
    assert all(e.top == [] for e in entries[1:])
    ref = hf_logprobs(str(ckpt), tuple(p))
    assert max(abs(e.logprob - float(ref[i][p[i + 1]])) for i, e in enumerate(entries[1:])) < TOL
    # Aborted halfway through a chunked prefill: the partial scores are dropped, not leaked.
    engine.add_request("gone", p, SamplingParams(max_tokens=1, prompt_logprobs=1))
    engine.step()
    engine.abort("gone")
    while engine.has_work():
        engine.step()
    assert engine.runner.prompt_logprobs._by_request == {}


# -- through the HTTP server, with the real openai client ------------------------------------------

NAME = "tiny-echo"


@pytest.fixture(scope="module")
def client(tiny_checkpoint):
    # A small token budget: the longer prompts are prefilled in chunks behind the server too.
    with WorkerProcess(tiny_checkpoint("llama"), "--served-model-name", NAME, "--max-model-len", "256",
                       "--kv-cache-memory", str(32 << 20), "--max-num-batched-tokens", "16") as w:
        yield openai.OpenAI(base_url=f"{w.url}/v1", api_key="none", max_retries=0, timeout=120)


def _entries(lp, n: int):
    """The first n positions of a legacy logprobs object as (token_logprob, top dict) pairs."""
    return list(zip(lp.token_logprobs[:n], lp.top_logprobs[:n]))


def _check_http(ckpt, tokenizer, prompt: list[int], lp, top: int) -> float:
    ref = hf_logprobs(str(ckpt), tuple(prompt))
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[:len(prompt)] == [tokenizer.decode([t]) for t in prompt]
    worst = 0.0
    for p in range(1, len(prompt)):
        worst = max(worst, abs(lp.token_logprobs[p] - float(ref[p - 1][prompt[p]])))
        vals, ids = ref[p - 1].topk(top)
        want = {tokenizer.decode([t]): float(v) for t, v in zip(ids.tolist(), vals)}
        got = lp.top_logprobs[p]
        assert set(want) <= set(got) and len(got) <= top + 1  # top-N plus the prompt token itself
        worst = max(worst, max(abs(got[k] - v) for k, v in want.items()))
    assert worst < TOL, worst
    return worst


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))


@pytest.mark.parametrize("max_tokens", [0, 1, 4])
def test_http_echo_logprobs_equal_hf(client, tokenizer, tiny_checkpoint, max_tokens):
    ckpt = tiny_checkpoint("llama")
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[3]]  # a batch of token-id prompts, as lm-eval sends
    r = client.completions.create(model=NAME, prompt=prompts, echo=True, logprobs=TOP, max_tokens=max_tokens,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert len(r.choices) == 3
    for choice, prompt in zip(r.choices, prompts):
        lp = choice.logprobs
        _check_http(ckpt, tokenizer, prompt, lp, TOP)
        assert len(lp.tokens) == len(prompt) + max_tokens
        head = tokenizer.decode(prompt)
        assert choice.text.startswith(head) and lp.text_offset[len(prompt) - 1] < len(head)
        if max_tokens:
            assert lp.text_offset[len(prompt)] == len(head)  # the completion's offsets follow the echo
            assert all(v is not None for v in lp.token_logprobs[len(prompt):])
        else:
            assert choice.text == head
    assert r.usage.completion_tokens == 3 * max_tokens
    assert r.usage.prompt_tokens == sum(len(p) for p in prompts)


def test_http_echo_text_prompt_and_stream(client, tokenizer, tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    text = "The capital of France is Paris, and the capital of Spain is"
    ids = tokenizer(text)["input_ids"]
    r = client.completions.create(model=NAME, prompt=text, echo=True, logprobs=2, max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text.startswith(text)
    _check_http(ckpt, tokenizer, ids, r.choices[0].logprobs, 2)
    chunks = list(client.completions.create(model=NAME, prompt=text, echo=True, logprobs=2, max_tokens=3,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs
                for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == r.choices[0].logprobs.token_logprobs
    assert chunks[-1].usage.completion_tokens == 3
    # echo without logprobs: the prompt in front, no logprobs at all.
    plain = client.completions.create(model=NAME, prompt=text, echo=True, max_tokens=0)
    assert plain.choices[0].text == text and plain.choices[0].logprobs is None


def test_http_max_tokens_zero_needs_echo(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_tensor_parallel_prompt_logprobs_equal_hf(tiny_checkpoint):
    """TP=2 (two CPU processes over gloo): the follower rank joins each slice's logits gather."""
    ckpt = tiny_checkpoint("llama")
    engine = make_engine(ckpt, max_num_batched_tokens=16, tensor_parallel_size=2)
    try:
        echo = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
        out = run_engine(engine, PROMPTS, [echo] * len(PROMPTS))
        for i, p in enumerate(PROMPTS):
            check_against_hf(ckpt, p, out[i][1], TOP)
    finally:
        engine.shutdown()


# -- vLLM's prompt_logprobs ----------------------------------------------------------------------

def _check_vllm(ckpt, tokenizer, prompt: list[int], entries: list, top: int) -> None:
    """vLLM's shape: per token {id: {logprob, rank, decoded_token}} with the token and the top-N."""
    ref = hf_logprobs(str(ckpt), tuple(prompt))
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        e, row = entries[p], ref[p - 1]
        own = e[str(prompt[p])]
        assert abs(own["logprob"] - float(row[prompt[p]])) < TOL
        assert own["rank"] in ranks_within_tol(row, prompt[p])
        assert own["decoded_token"] == tokenizer.decode([prompt[p]])
        vals, ids = row.topk(top)
        assert {str(t) for t in ids.tolist()} <= set(e) and len(e) <= top + 1
        for i, (t, v) in enumerate(zip(ids.tolist(), vals)):
            if t != prompt[p]:
                assert e[str(t)]["rank"] == i + 1 and abs(e[str(t)]["logprob"] - float(v)) < TOL


def test_http_prompt_logprobs_completions(client, tokenizer, tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    prompts = [PROMPTS[3], PROMPTS[0]]
    r = client.completions.create(model=NAME, prompt=prompts, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": TOP})
    for choice, prompt in zip(r.choices, prompts):
        _check_vllm(ckpt, tokenizer, prompt, choice.model_extra["prompt_logprobs"], TOP)
        assert choice.logprobs is None and not choice.text.startswith(tokenizer.decode(prompt))
    # With echo asking fewer: echo's top lists keep its own N, prompt_logprobs its own.
    r = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=1, temperature=0, echo=True, logprobs=1,
                                  extra_body={"prompt_logprobs": TOP})
    _check_vllm(ckpt, tokenizer, PROMPTS[1], r.choices[0].model_extra["prompt_logprobs"], TOP)
    _check_http(ckpt, tokenizer, PROMPTS[1], r.choices[0].logprobs, 1)
    assert all(len(t) <= 2 for t in r.choices[0].logprobs.top_logprobs[1:len(PROMPTS[1])])
    # Not asked: not in a completions choice (whose shape every stream chunk shares); null on chat, as vLLM.
    plain = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=1)
    assert "prompt_logprobs" not in plain.choices[0].model_extra


def test_http_prompt_logprobs_chat(client, tokenizer, tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "one two three"}],
                                       max_tokens=2, temperature=0, n=2, extra_body={"prompt_logprobs": 0})
    entries = r.model_extra["prompt_logprobs"]
    assert len(entries) == r.usage.prompt_tokens
    prompt = [int(next(iter(e))) for e in entries[1:]]  # N = 0: each entry is the prompt token alone
    assert all(len(e) == 1 for e in entries[1:])
    root = str(client.base_url).removesuffix("/").removesuffix("/v1")
    ids = httpx.post(f"{root}/tokenize", json={"model": NAME, "messages": [
        {"role": "user", "content": "one two three"}]}).json()["tokens"]
    assert prompt == ids[1:]
    _check_vllm(ckpt, tokenizer, ids, entries, 0)
    plain = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert plain.model_extra["prompt_logprobs"] is None


@pytest.mark.parametrize("extra, param", [
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
])
def test_http_prompt_logprobs_refused(client, extra, param):
    for call in (lambda: client.completions.create(model=NAME, prompt="hi", max_tokens=1, extra_body=extra),
                 lambda: client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=1, extra_body=extra)):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == param, e.value.body
