"""Penalties and logit bias: the batched device code equals Hugging Face's logits processors
(repetition penalty, sequence bias) and a plain per-token reference of OpenAI's presence and
frequency formula, on random logits; the engine's greedy tokens equal a Hugging Face greedy
loop with the same processors; through the HTTP server (real openai client, extra_body for
repetition_penalty) and across a P/D hand-off, whose first token the decode side counts."""

from __future__ import annotations

import functools

import openai
import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from pdserve.worker.request.request import Request
from pdserve.worker.request.sampling_params import SamplingParams
from pdserve.worker.sample.logits_processors import apply_logits_processors
from tests.helpers.engines import make_engine
from tests.net import free_port
from tests.worker.test_server_harness import WorkerProcess

V = 97
TOL = 1e-5


def _request(prompt, outputs, **params) -> Request:
    r = Request("r", list(prompt), SamplingParams(max_tokens=64, **params))
    r.token_ids += list(outputs)
    return r


def reference(logits: torch.Tensor, r: Request) -> torch.Tensor:
    """One row, the slow way: bias, then HF's repetition processor over prompt + outputs, then
    OpenAI's mu[j] - c[j] * frequency - (c[j] > 0) * presence over the outputs."""
    p = r.params
    x = logits.clone().unsqueeze(0)
    if p.logit_bias:
        x = SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias})(torch.tensor([r.token_ids]), x)
    if p.repetition_penalty != 1.0:
        x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([r.token_ids]), x)
    x = x[0]
    for t in set(r.output_token_ids):
        c = r.output_token_ids.count(t)
        x[t] -= c * p.frequency_penalty + p.presence_penalty
    return x


def test_batch_equals_hf_processors_and_reference():
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(40):
        prompt = torch.randint(0, V, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        outputs = torch.randint(0, V, (int(torch.randint(0, 20, (1,), generator=g)),), generator=g).tolist()
        kind = i % 5
        params = {}
        if kind in (0, 4):
            params["repetition_penalty"] = float(torch.empty(1).uniform_(0.5, 2.0, generator=g))
        if kind in (1, 4):
            params["frequency_penalty"] = float(torch.empty(1).uniform_(-2, 2, generator=g))
            params["presence_penalty"] = float(torch.empty(1).uniform_(-2, 2, generator=g))
        if kind in (2, 4):
            ids = torch.randperm(V, generator=g)[:5].tolist()
            params["logit_bias"] = tuple((t, float(torch.empty(1).uniform_(-100, 100, generator=g))) for t in ids)
        # kind 3: nothing; its row must come back bit for bit.
        rows.append(_request(prompt, outputs, **params))
    logits = torch.randn(len(rows), V, generator=g) * 5
    got = logits.clone()
    apply_logits_processors(got, rows)
    worst = 0.0
    for i, r in enumerate(rows):
        want = reference(logits[i], r)
        worst = max(worst, float((got[i] - want).abs().max()))
        if not r.params.modifies_logits:
            assert torch.equal(got[i], logits[i])
    assert worst < TOL, worst


def test_repetition_penalty_counts_prompt_presence_only_outputs():
    logits = torch.full((1, V), 2.0)
    logits[0, 7] = -2.0
    r = _request([3, 7], [5, 5, 5], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    apply_logits_processors(logits, [r])
    assert logits[0, 3] == 1.0 and logits[0, 7] == -4.0  # prompt tokens: repetition only
    assert logits[0, 5] == pytest.approx(1.0 - 1.5 - 0.25)  # outputs: all three
    assert logits[0, 9] == 2.0


def test_no_penalty_batch_is_untouched():
    logits = torch.randn(3, V)
    before = logits.clone()
    apply_logits_processors(logits, [_request([1], [2, 3]) for _ in range(3)])
    assert torch.equal(logits, before)


def test_allowed_token_ids_restrict_sampling_and_greedy():
    """vLLM's allowed_token_ids: only those tokens, whether sampled (many seeds) or greedy (the
    best of them), and rows without a list untouched."""
    from pdserve.worker.sample.sampler import Sampler

    torch.manual_seed(0)
    logits = torch.randn(2, V)
    allowed = (4, 40, 90)
    sampled = {Sampler()(logits.clone(), [_request([1], [], temperature=1.0, seed=s, allowed_token_ids=allowed),
                                          _request([1], [])])[0][0] for s in range(200)}
    assert sampled == set(allowed)  # each of them, nothing else
    greedy, free = Sampler()(logits.clone(), [_request([1], [], temperature=0.0, allowed_token_ids=allowed),
                                              _request([1], [], temperature=0.0)])[0]
    assert greedy == max(allowed, key=lambda t: logits[0, t]) and free == int(logits[1].argmax())


# -- the engine against a Hugging Face greedy loop over the same checkpoint ---------------------------

# A 32-token vocabulary: 24 greedy tokens must repeat some, so every penalty has work to do.
PROMPTS = [[5, 17, 30, 12, 9, 10, 7], [3, 4], list(range(3, 23))]
MAX_NEW = 24
CASES = {
    "repetition": dict(repetition_penalty=1.8),
    "frequency_presence": dict(frequency_penalty=1.5, presence_penalty=0.7),
    "bias": dict(logit_bias=((12, 30.0), (7, -100.0))),
    "all": dict(repetition_penalty=0.7, frequency_penalty=-0.5, presence_penalty=1.0, logit_bias=((11, 8.0),)),
}


@pytest.fixture(scope="module")
def small_vocab_checkpoint(tmp_path_factory):
    from tests.checkpoints import write_checkpoint, write_word_tokenizer

    d = tmp_path_factory.mktemp("penalties")
    return write_checkpoint(d / "m", "llama", write_word_tokenizer(d / "tok", vocab_size=32))


@functools.lru_cache(maxsize=None)
def _hf(ckpt: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def hf_greedy(ckpt: str, prompt: list[int], params: SamplingParams) -> list[int]:
    model = _hf(ckpt)
    r = Request("hf", prompt, params)
    with torch.no_grad():
        for _ in range(MAX_NEW):
            logits = model(torch.tensor([r.token_ids])).logits[0, -1].float()
            r.token_ids.append(int(reference(logits, r).argmax()))
    return r.output_token_ids


@pytest.mark.parametrize("case", list(CASES))
def test_engine_greedy_equals_hf_loop(small_vocab_checkpoint, case):
    ckpt = small_vocab_checkpoint
    engine = make_engine(ckpt)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, **CASES[case])
    plain = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    # Penalized and plain requests in one batch: each row gets only its own processing.
    out = engine.generate(PROMPTS + PROMPTS, [params] * len(PROMPTS) + [plain] * len(PROMPTS))
    want = [hf_greedy(str(ckpt), p, params) for p in PROMPTS]
    assert out[:len(PROMPTS)] == want
    assert out[len(PROMPTS):] != want  # the processing changed something (else this test proves nothing)
    if case == "bias":
        assert all(t == 12 for o in out[:len(PROMPTS)] for t in o)


def test_engine_refuses_bias_outside_vocabulary(small_vocab_checkpoint):
    from pdserve.worker.request.request import RequestError

    engine = make_engine(small_vocab_checkpoint)
    with pytest.raises(RequestError) as e:
        engine.add_request("x", [1, 2], SamplingParams(logit_bias=((10**7, 1.0),)))
    assert e.value.param == "logit_bias"


# -- through the HTTP server with the real openai client, and across a P/D hand-off --------------------

NAME = "tiny-penalties"


@pytest.fixture(scope="module")
def client(small_vocab_checkpoint):
    # A KV side channel, so this one worker can play both P/D halves.
    with WorkerProcess(small_vocab_checkpoint, "--served-model-name", NAME, "--max-model-len", "256",
                       "--kv-cache-memory", str(32 << 20), "--kv-transfer", "tcp", "--kv-host", "127.0.0.1",
                       "--kv-port", str(free_port()), "--kv-peer-allow", "127.0.0.1") as w:
        yield openai.OpenAI(base_url=f"{w.url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("case", list(CASES))
def test_http_greedy_equals_hf_loop(client, small_vocab_checkpoint, case):
    ckpt = str(small_vocab_checkpoint)
    # The word tokenizer's special tokens (0-2) decode to nothing: ban them, here and in the reference.
    banned = tuple((t, -100.0) for t in (0, 1, 2))
    case_params = dict(CASES[case], logit_bias=CASES[case].get("logit_bias", ()) + banned)
    c = dict(case_params)
    extra = {"ignore_eos": True}
    if "repetition_penalty" in c:
        extra["repetition_penalty"] = c.pop("repetition_penalty")  # a vLLM extra: not in the SDK's signature
    if "logit_bias" in c:
        c["logit_bias"] = {str(t): b for t, b in c.pop("logit_bias")}
    prompt = PROMPTS[0]
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_NEW, temperature=0, extra_body=extra,
                                  **c)
    want = hf_greedy(ckpt, prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True,
                                                  **case_params))
    assert r.choices[0].text.split() == [f"t{t}" for t in want]


def test_penalties_hold_across_pd_handoff(client):
    """Prefill leg (max_tokens=1) then decode leg with its kv_transfer_params: the decode worker's
    frequency/presence state must count the first token, so the spliced text equals one worker's."""
    kw = dict(model=NAME, temperature=0, frequency_penalty=2.0, presence_penalty=1.0)
    prompt = "t5 t9 t30 t12 t7 t8 t9"
    plain = client.completions.create(prompt=prompt, max_tokens=MAX_NEW, extra_body={"ignore_eos": True}, **kw)
    pre = client.completions.create(prompt=prompt, max_tokens=1,
                                    extra_body={"ignore_eos": True, "kv_transfer_params": {"do_remote_decode": True}},
                                    **kw)
    dec = client.completions.create(prompt=prompt, max_tokens=MAX_NEW, extra_body={
        "ignore_eos": True, "kv_transfer_params": pre.model_extra["kv_transfer_params"]}, **kw)
    assert pre.choices[0].text + dec.choices[0].text == plain.choices[0].text
    unpenalized = client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert unpenalized.choices[0].text != plain.choices[0].text


def test_http_refusals(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="x", logit_bias={"5": 150})
    assert e.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt="t5", extra_body={"repetition_penalty": -1})
    assert e.value.body["param"] == "repetition_penalty"
