"""The router's P/D path gives exactly what one worker gives, for every request shape.

Real processes on a tiny random-weight checkpoint, each model's stack on one KV transport or
both (see `stack` and the fixtures below): a prefill worker, a decode worker and the router in
front. The single-worker reference is the decode worker called directly (no kv_transfer_params:
it prefills locally). Each request goes to both and the answers must be equal: text, finish and
stop reasons, token logprobs, usage, streamed or not. Greedy and seeded sampling only (an
unseeded sample has nothing to equal).

The regression tests pin the issue-14 bugs; the hypothesis test draws random requests
(derandomized: the same examples every run, so a failure reproduces).
"""

from __future__ import annotations

import contextlib
import json
import math
import re

import httpx
import jsonschema
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from tests.checkpoints import GPT_OSS_WINDOW
from tests.helpers.engines import native_gemm_here
from tests.helpers.metrics import metric
from tests.helpers.processes import stop_together
from tests.helpers.properties import live_settings
from tests.router.conftest import Launcher
from tests.net import free_port
from tests.worker.test_server_harness import WorkerProcess

pytestmark = pytest.mark.slow

# The pin TTL is the default's: on a loaded 2-core CI machine the decode worker can take seconds to
# reach a pull, and a pin expired first turns the hand-off into a local prefill (still equal, but
# the tests that count pulls would fail on the machine's speed).
ARGS = ("--served-model-name", "tiny", "--max-model-len", "256", "--block-size", "4",
        "--kv-cache-memory", str(1 << 23), "--kv-peer-allow", "127.0.0.1", "--kv-pin-ttl", "30")
ENV = {"PDSERVE_KV_SECRET": "pd-equality-test-shared-secret"}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
PREFIX = {"chat": "chatcmpl-", "completions": "cmpl-"}
TEXTS = ["The capital of France is Paris.", "Hello", "One two three four five six seven eight nine ten",
         "Tell me a story about a fox and a dog who became friends in the forest."]


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    """The request-shape tests' stack: TCP only. What they vary (prompt lists, echo, n, stop
    strings, min_tokens, seeds, structured outputs, ids and headers) is the router's and the
    engines' handling, the same whichever transport moves the KV; Llama's KV moves through
    NIXL in test_kv_transfer.py, and the stacks below (MoE/MLA and gpt-oss over NIXL; gpt-oss and
    fp8 over TCP) draw random requests of every one of these shapes (`requests`). A NIXL copy of
    this stack cost CI about two minutes."""
    with pd_stack(tiny_checkpoint("llama"), "tcp") as urls:
        yield urls


@pytest.fixture(scope="module")
def moe_stack(tiny_checkpoint):
    """The same stack serving a mixture-of-experts model with multi-head latent attention
    (DeepSeek-V3, tests/checkpoints.py): P/D moves only attention KV, here one latent per token
    and layer (layout "...:mla"). One model for both, so the MoE and MLA cases cost one stack;
    GQA MoE models hand off exactly the Llama stack's KV. Over NIXL: the fp8 latent stack below
    moves MLA rows over TCP (and test_tp_pd.py does, between tensor-parallel workers)."""
    with pd_stack(tiny_checkpoint("deepseek-v3"), "nixl") as urls:
        yield urls


@pytest.fixture(scope="module", params=["tcp-io-process", "nixl"])
def gpt_oss_stack(request, tiny_checkpoint):
    """gpt-oss (tests/checkpoints.py): attention sinks, layers alternating sliding (window
    GPT_OSS_WINDOW = 8 tokens) and full attention, YaRN rope, biased experts. Both workers keep
    the hybrid KV cache (docs/kv-cache.md): the hand-off moves the full layers' blocks and the
    sliding layers' window only; the chat prompts and TEXTS[3] are longer than the window, so
    the decode worker's first steps already slide over pulled KV. The router streams the
    hand-off (its default): full blocks chunk by chunk, the sliding tail with the last one.
    Over TCP both workers' data connections run in processes of their own (--kv-tcp-io
    process: the other stacks' TCP workers keep the default, threads)."""
    transport, _, where = request.param.partition("-io-")
    io = ("--kv-tcp-io", where) if where else ()
    with pd_stack(tiny_checkpoint("gpt-oss"), transport, prefill_args=io, decode_args=io) as urls:
        yield urls


# The KV cache dtype is one more dimension: an fp8 cache (--kv-cache-dtype fp8) on both workers.
# The single-worker reference is again the decode worker, fp8 too. Over TCP: a transport moves the
# blocks as bytes whatever their dtype, and fp8 blocks cross NIXL in test_tp_pd.py's staged pulls.
FP8 = ("--kv-cache-dtype", "fp8")


@pytest.fixture(scope="module")
def fp8_stack(tiny_checkpoint):
    with pd_stack(tiny_checkpoint("llama"), "tcp", FP8, FP8) as urls:
        yield urls


@pytest.fixture(scope="module")
def fp8_mla_stack(tiny_checkpoint):
    """DeepSeek-V3's latent cache as fp8 on both workers: the hand-off moves e4m3 latent rows
    (layout "...:float8_e4m3fn@1:4:mla"), bytes as they are."""
    with pd_stack(tiny_checkpoint("deepseek-v3"), "tcp", FP8, FP8) as urls:
        yield urls


# bf16 on both workers, the dtype the quick start serves on a CPU with AVX512-BF16. There a prompt's
# numbers would depend on how its tokens are split into steps (the prefix cache, chunks, batch
# neighbours) unless the engine is batch-invariant (kernels/cpu_native.py): the reference (the
# decode worker called directly) and the P/D legs meet the prompt with other caches.
BF16 = ("--dtype", "bfloat16")


@pytest.fixture(scope="module")
def bf16_stack(wide_checkpoint):
    if not native_gemm_here():
        pytest.skip("no native bf16 GEMM on this CPU: its bf16 engine is not batch-invariant")
    # The decode worker prefills in chunks of 16 tokens, the prefill worker a prompt at once (P/D
    # deployments give prefill pods the larger token budget): one more way the paths split a prompt.
    with pd_stack(wide_checkpoint("llama"), "tcp", BF16, (*BF16, "--max-num-batched-tokens", "16")) as urls:
        yield urls


@contextlib.contextmanager
def pd_stack(ckpt, t: str, prefill_args=(), decode_args=()):
    p = WorkerProcess(
        ckpt, *ARGS, *prefill_args, "--role", "prefill", "--kv-transfer", t, "--kv-port", str(free_port()), env=ENV
    )
    d = WorkerProcess(ckpt, *ARGS, *decode_args, "--role", "decode", "--kv-transfer", t, "--kv-port", str(free_port()),
                      env=ENV)
    launcher = Launcher()
    try:
        p.start(), d.start()
        p.wait_ready(), d.wait_ready()
        router = launcher.router("--prefill", p.url, "--decode", d.url)
        yield router.url, d.url
    finally:
        stop_together([*(proc.popen for proc in launcher.procs), p.proc, d.proc])


# ---- one answer, normalised --------------------------------------------------------------------

def _merge_logprobs(route: str, acc: dict | None, lp: dict | None) -> dict | None:
    if lp is None:
        return acc
    acc = acc or {}
    for k, v in lp.items():
        acc[k] = (acc.get(k) or []) + (v or [])
    return acc


def ask(url: str, route: str, body: dict) -> dict:
    """The answer as comparable data: per choice text, finish/stop reason, logprobs; usage."""
    r = httpx.post(url + PATHS[route], json=body, timeout=120)
    assert r.status_code == 200, (url, r.status_code, r.text)
    text_key = "text" if route == "completions" else "content"
    if not body.get("stream"):
        out = r.json()
        assert out["id"].startswith(PREFIX[route]) and "kv_transfer_params" not in out
        choices = {c["index"]: {"text": c["text"] if route == "completions" else c["message"]["content"],
                                "finish_reason": c["finish_reason"], "stop_reason": c.get("stop_reason"),
                                "logprobs": c["logprobs"], "prompt_logprobs": c.get("prompt_logprobs")}
                   for c in out["choices"]}
        usage = {k: out["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        return {"choices": choices, "usage": usage, "prompt_logprobs": out.get("prompt_logprobs")}
    choices: dict[int, dict] = {}
    usage, ids, done = None, set(), False
    for line in r.text.split("\n\n"):
        if not line:
            continue
        assert line.startswith("data: "), line
        if line == "data: [DONE]":
            done = True
            continue
        chunk = json.loads(line[6:])
        assert "error" not in chunk, chunk
        ids.add(chunk["id"])
        if chunk.get("usage"):
            usage = {k: chunk["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        for c in chunk["choices"]:
            slot = choices.setdefault(c["index"], {"text": "", "finish_reason": None, "stop_reason": None,
                                                   "logprobs": None})
            piece = c[text_key] if route == "completions" else c["delta"].get("content")
            slot["text"] += piece or ""
            slot["logprobs"] = _merge_logprobs(route, slot["logprobs"], c.get("logprobs"))
            if c.get("finish_reason"):
                slot["finish_reason"], slot["stop_reason"] = c["finish_reason"], c.get("stop_reason")
    assert done and len(ids) == 1 and ids.pop().startswith(PREFIX[route])
    return {"choices": choices, "usage": usage}


def _close(a, b) -> bool:
    """Equal data; floats (logprobs) to 1e-4: the two paths run the same arithmetic, but a
    prompt prefilled in another batch shape may round differently in the last bits."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, abs_tol=1e-4)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


def assert_same(stack, route: str, body: dict) -> dict:
    router, worker = stack
    body = {"model": "tiny", **body}
    want = ask(worker, route, body)
    got = ask(router, route, body)
    assert _close(got, want), f"\nrequest {body}\nrouter {got}\nworker {want}"
    return want


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---- the bugs, one by one ---------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompt", [
    ["The capital of France is", "The capital of Spain is"],  # equal token lengths
    ["The capital of France is", "Hello there my good friend, how are"],  # unequal
    [[1, 2, 3, 4, 5], [6, 7, 8]],  # lists of token ids
    [[9, 10, 11, 12]],  # one prompt of token ids in a list
])
def test_prompt_lists(stack, prompt, stream):
    out = assert_same(stack, "completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0, "stream": stream,
                                             "stream_options": {"include_usage": True} if stream else None})
    assert sorted(out["choices"]) == list(range(len(prompt)))


@pytest.mark.parametrize("stream", [False, True])
def test_echo(stack, stream):
    out = assert_same(stack, "completions", {"prompt": TEXTS[0], "echo": True, "logprobs": 1, "max_tokens": 3,
                                             "temperature": 0, "stream": stream})
    assert out["choices"][0]["text"].startswith(TEXTS[0])


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_prompt_logprobs(stack, route):
    """vLLM's prompt_logprobs: the router serves them whole on one worker, as the worker does."""
    key = {"prompt": TEXTS[3]} if route == "completions" else {"messages": chat(TEXTS[3])}
    out = assert_same(stack, route, {**key, "prompt_logprobs": 2, "max_tokens": 3, "temperature": 0})
    entries = out["choices"][0]["prompt_logprobs"] if route == "completions" else out["prompt_logprobs"]
    assert entries[0] is None and len(entries) == out["usage"]["prompt_tokens"]
    assert all(2 <= len(e) <= 3 for e in entries[1:])
    # Refused as the worker refuses it (not streamed), whichever path the router would take.
    r = httpx.post(stack[0] + PATHS[route], json={"model": "tiny", **key, "prompt_logprobs": 2, "stream": True},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_n_and_seed(stack, route):
    key = {"prompt": TEXTS[0]} if route == "completions" else {"messages": chat(TEXTS[0])}
    out = assert_same(stack, route, {**key, "n": 3, "seed": 7, "temperature": 1.0, "max_tokens": 6})
    assert len({c["text"] for c in out["choices"].values()}) > 1  # n samples, not one copied


def _first_two_tokens(stack, body: dict) -> tuple[str, str]:
    _, worker = stack
    r = httpx.post(worker + "/v1/completions", json={**body, "model": "tiny", "max_tokens": 2, "temperature": 0,
                                                     "ignore_eos": True, "logprobs": 0}, timeout=60).json()
    return tuple(r["choices"][0]["logprobs"]["tokens"])


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_spanning_first_and_second_token(stack, stream):
    body = {"prompt": TEXTS[0], "ignore_eos": True}
    t0, t1 = _first_two_tokens(stack, body)
    assert t0 and t1
    for stop in (t0[-1] + t1[0], t0 + t1[0], t0[-1] + t1):
        out = assert_same(stack, "completions", {**body, "stop": [stop], "max_tokens": 6, "temperature": 0,
                                                 "stream": stream})
        want = (t0 + t1)[:(t0 + t1).index(stop)]
        assert out["choices"][0]["text"] == want and out["choices"][0]["finish_reason"] == "stop"


def test_min_tokens_above_one(stack):
    # The prefill leg samples one token: it must neither refuse min_tokens nor let EOS end it.
    out = assert_same(stack, "completions", {"prompt": TEXTS[0], "max_tokens": 6, "min_tokens": 4, "temperature": 0})
    assert out["usage"]["completion_tokens"] >= 4
    out = assert_same(stack, "chat", {"messages": chat(TEXTS[1]), "max_tokens": 5, "min_tokens": 5, "temperature": 0,
                                      "stream": True, "stream_options": {"include_usage": True}})
    assert out["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("stream", [False, True])
def test_seeded_sampling_is_path_independent(stack, stream):
    for seed in (123, 7):
        out = assert_same(stack, "chat", {"messages": chat(TEXTS[3]), "seed": seed, "temperature": 1.0,
                                          "max_tokens": 10, "ignore_eos": True, "stream": stream,
                                          "stream_options": {"include_usage": True} if stream else None})
        assert out["usage"]["completion_tokens"] == 10


def test_models_header_ids_and_stream_serialisation(stack):
    router, worker = stack
    card = httpx.get(router + "/v1/models").json()["data"][0]
    assert card["id"] == "tiny" and card["max_model_len"] == 256
    r = httpx.post(router + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
                   headers={"x-request-id": "abc123"}, timeout=60)
    assert r.headers["x-request-id"] == "abc123" and r.json()["id"] == "cmpl-abc123"
    r = httpx.post(router + "/v1/chat/completions", json={"model": "tiny", "messages": chat("Hi"), "max_tokens": 2},
                   timeout=60)
    assert r.headers["x-request-id"] and r.json()["id"] == "chatcmpl-" + r.headers["x-request-id"]
    # Every streamed event, the prefill's first token included, is what the worker itself sends.
    for route, key in (("chat", {"messages": chat(TEXTS[2])}), ("completions", {"prompt": TEXTS[2]})):
        body = {"model": "tiny", **key, "max_tokens": 4, "temperature": 0, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        events = []
        for url in (router, worker):
            r = httpx.post(url + PATHS[route], json=body, timeout=60, headers={"x-request-id": "same"})
            assert url == worker or r.headers["x-request-id"] == "same"
            events.append([_without_created(e) for e in r.text.split("\n\n") if e])
        assert events[0] == events[1]


# Structured outputs: the prefill's first token obeys the grammar, the decode worker's matcher
# consumes it before masking the second (worker/structured/structured_output.py).
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n"],
          "properties": {"name": {"type": "string", "maxLength": 10}, "n": {"type": "integer", "minimum": 0,
                                                                             "maximum": 999}}}
REGEX = r"[A-Z][a-z]{1,6} [0-9]{2,4}"
CHOICES = ["alpha", "beta gamma", "delta"]
STRUCTURED = [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}},
    {"response_format": {"type": "json_object"}},
    {"guided_json": SCHEMA},
    {"guided_regex": REGEX},
    {"guided_choice": CHOICES},
    {"structured_outputs": {"regex": REGEX}},
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("constraint", STRUCTURED, ids=lambda c: next(iter(c)) + ":" + str(
    c.get("response_format", {}).get("type", "")))
def test_structured_outputs(stack, constraint, stream):
    router, _ = stack
    for route, key in (("chat", {"messages": chat(TEXTS[3])}), ("completions", {"prompt": TEXTS[2]})):
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 11}):
            before = disaggregated(router)
            out = assert_same(stack, route, {**key, **constraint, **sampling, "max_tokens": 60, "stream": stream})
            assert disaggregated(router) > before  # it did go through a prefill worker
            text, reason = out["choices"][0]["text"], out["choices"][0]["finish_reason"]
            if "guided_choice" in constraint:
                assert text in CHOICES
            elif "guided_regex" in constraint or "structured_outputs" in constraint:
                assert re.fullmatch(REGEX, text)
            elif reason == "stop":  # json_object's keys are unbounded: a random model may run out of tokens
                value = json.loads(text)
                if constraint.get("response_format", {}).get("type") != "json_object":
                    jsonschema.validate(value, SCHEMA)
            else:
                assert constraint.get("response_format", {}).get("type") == "json_object" and text.startswith("{")


def test_structured_output_errors_pass_through(stack):
    router, worker = stack
    for extra, param in (({"guided_regex": "a(b"}, "guided_regex"), ({"guided_choice": []}, "guided_choice"),
                         ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
                          "response_format.json_schema.schema")):
        for url in (router, worker):
            r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": TEXTS[2], "max_tokens": 4,
                                                          **extra}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (url, r.text)


def _without_created(event: str) -> str:
    if event == "data: [DONE]":
        return event
    chunk = json.loads(event[6:])
    chunk.pop("created")
    if chunk.get("usage"):  # cached prompt tokens depend on each worker's cache, not on the path
        chunk["usage"]["prompt_tokens_details"].pop("cached_tokens")
    return json.dumps(chunk)  # key order as sent


# ---- the property: any request, same answer ----------------------------------------------------

STOPS = ["e", " t", "an", "\n", "er", "s ", "the", "ing"]


@st.composite
def requests(draw) -> tuple[str, dict]:
    route = draw(st.sampled_from(["completions", "chat"]))
    body: dict = {}
    if route == "completions":
        body["prompt"] = draw(st.one_of(
            st.sampled_from(TEXTS),
            st.lists(st.sampled_from(TEXTS), min_size=1, max_size=3),
            st.lists(st.integers(1, 5000), min_size=1, max_size=12),
            st.lists(st.lists(st.integers(1, 5000), min_size=1, max_size=8), min_size=1, max_size=2)))
    else:
        body["messages"] = chat(draw(st.sampled_from(TEXTS)))
    max_tokens = draw(st.integers(1, 8))
    body["max_tokens" if route == "completions" or draw(st.booleans()) else "max_completion_tokens"] = max_tokens
    if draw(st.booleans()):
        body["min_tokens"] = draw(st.integers(0, max_tokens))
    if draw(st.booleans()):
        body["stop"] = draw(st.lists(st.sampled_from(STOPS), min_size=1, max_size=3))
    if draw(st.integers(0, 3)) == 0:
        body["stop_token_ids"] = draw(st.lists(st.integers(0, 2000), min_size=1, max_size=3))
    if draw(st.booleans()):
        body["temperature"] = 0
    else:
        body["seed"] = draw(st.integers(0, 2**31))
        body["temperature"] = draw(st.sampled_from([0.5, 1.0, 1.5]))
        if draw(st.booleans()):
            body["top_p"] = draw(st.sampled_from([0.5, 0.9]))
        if draw(st.booleans()):
            body["top_k"] = draw(st.sampled_from([5, 50]))
    body["n"] = draw(st.sampled_from([1, 1, 2]))
    if draw(st.booleans()):
        if route == "completions":
            body["logprobs"] = draw(st.integers(0, 3))
        else:
            body["logprobs"] = True
            body["top_logprobs"] = draw(st.integers(0, 3))
    if route == "completions" and draw(st.integers(0, 4)) == 0:
        body["echo"] = True
    if draw(st.integers(0, 3)) == 0:
        body.update(draw(st.sampled_from(STRUCTURED)))
    body["ignore_eos"] = draw(st.booleans())
    body["stream"] = draw(st.booleans())
    if body["stream"] and draw(st.booleans()):
        body["stream_options"] = {"include_usage": True}
    return route, body


def disaggregated(router: str) -> float:
    return metric(router, "pdserve_router_requests_total", disaggregated="yes")


@live_settings(40)
@given(case=requests())
def test_any_request_equals_single_worker(stack, case):
    route, body = case
    before = disaggregated(stack[0])
    assert_same(stack, route, body)
    # What the router did with it (--hypothesis-show-statistics): one sequence should be P/D.
    event("P/D" if disaggregated(stack[0]) > before else "one worker")


@live_settings(12)
@given(case=requests())
def test_moe_model_any_request_equals_single_worker(moe_stack, case):
    route, body = case
    assert_same(moe_stack, route, body)


def test_moe_model_greedy_through_prefill_and_decode(moe_stack):
    router, worker = moe_stack
    before = disaggregated(router), metric(worker, "pdserve_kv_local_prefill_fallbacks_total")
    pulled = metric(worker, "pdserve_kv_transfer_bytes_total")
    assert_same(moe_stack, "completions", {"prompt": TEXTS[3], "max_tokens": 12, "temperature": 0,
                                           "ignore_eos": True, "logprobs": 2})
    assert disaggregated(router) > before[0]  # the KV really moved from prefill to decode...
    assert metric(worker, "pdserve_kv_local_prefill_fallbacks_total") == before[1]  # ...pulled, not refused
    assert metric(worker, "pdserve_kv_transfer_bytes_total") > pulled


@live_settings(8)
@given(case=requests())
def test_gpt_oss_any_request_equals_single_worker(gpt_oss_stack, case):
    """P/D == one worker for gpt-oss (fewer examples: the request handling is the dense
    model's; what differs is the model's layers and the KV they hand off)."""
    route, body = case
    assert_same(gpt_oss_stack, route, body)


# Prompts of 3 to 11 windows (block size 4: 6 to 22 blocks), so the first decode steps attend
# through a window that lies wholly in pulled KV, and a full-attention layer reads all of it.
LONG = [" ".join(TEXTS), " ".join(TEXTS[2:] * 3)]


@pytest.mark.parametrize("stream", [False, True])
def test_gpt_oss_prompts_past_the_window_greedy_and_seeded(gpt_oss_stack, stream):
    router, worker = gpt_oss_stack
    for prompt in LONG:
        n = len(httpx.post(worker + "/tokenize", json={"model": "tiny", "prompt": prompt}, timeout=30).json()["tokens"])
        assert n > 3 * GPT_OSS_WINDOW, n
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 5, "top_k": 50}):
            before = disaggregated(router), metric(worker, "pdserve_kv_transfer_bytes_total")
            fallbacks = metric(worker, "pdserve_kv_local_prefill_fallbacks_total")
            out = assert_same(gpt_oss_stack, "completions", {"prompt": prompt, "max_tokens": 12, "ignore_eos": True,
                                                            "logprobs": 1, "stream": stream, **sampling,
                                                            "stream_options": {"include_usage": True} if stream
                                                            else None})
            assert out["usage"]["completion_tokens"] == 12
            assert disaggregated(router) == before[0] + 1  # the KV moved from prefill to decode
            assert metric(worker, "pdserve_kv_transfer_bytes_total") > before[1]
            # Pulled, not refused: both workers' hybrid layouts match. (The decode worker answered
            # the same prompt first, so only the blocks its prefix cache lacks move: the window's
            # saving is counted in tests/worker/test_pd_window.py, on a cold decode cache.)
            assert metric(worker, "pdserve_kv_local_prefill_fallbacks_total") == fallbacks


def test_bf16_shared_prefixes_equal_single_worker_in_either_order(bf16_stack):
    """Prompts sharing a prefix, each asked of the worker first and then through P/D or the other
    way round, greedy and seeded, streamed or not: the prefix cache of whichever worker answers
    second holds the prompt (or part of it), the first one's did not, and the answers are equal."""
    router, worker = bf16_stack
    shared = list(range(300, 353))  # token ids of the word vocabulary; 53: not whole blocks
    prompts = [shared + [7, 8, 9], shared + list(range(1000, 1031)), shared, shared[:20] + [42] * 5]
    before = disaggregated(router)
    asked = 0
    for i, prompt in enumerate(prompts):
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
            for stream in (False, True):
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "ignore_eos": True, "logprobs": 1,
                        "stream": stream, **sampling}
                first, second = (router, worker) if (i + stream) % 2 else (worker, router)
                a, b = ask(first, "completions", body), ask(second, "completions", body)
                assert _close(a, b), f"\nrequest {body}\n{first} {a}\n{second} {b}"
                asked += 1
    assert disaggregated(router) == before + asked  # every router request went through P/D


@live_settings(10)
@given(case=requests())
def test_fp8_kv_any_request_equals_single_worker(fp8_stack, case):
    """P/D with an fp8 KV cache == one worker with an fp8 KV cache (fewer examples: the
    dimensions above are the same code path; what differs is the bytes moved)."""
    route, body = case
    assert_same(fp8_stack, route, body)


def test_fp8_kv_stack_moves_fp8_blocks(fp8_stack):
    router, worker = fp8_stack
    before = disaggregated(router), metric(worker, "pdserve_kv_local_prefill_fallbacks_total")
    pulled = metric(worker, "pdserve_kv_transfer_bytes_total")
    for stream in (False, True):
        assert_same(fp8_stack, "completions", {"prompt": TEXTS[3], "max_tokens": 4, "temperature": 0,
                                               "stream": stream})
    assert disaggregated(router) == before[0] + 2
    assert metric(worker, "pdserve_kv_local_prefill_fallbacks_total") == before[1]  # pulled, not refused
    assert metric(worker, "pdserve_kv_transfer_bytes_total") > pulled


def test_fp8_latent_pd_equals_single_worker(fp8_mla_stack):
    """P/D with an fp8 latent cache == one worker with one, greedy and seeded, streamed or not;
    every request's KV pulled (not refused and prefilled locally)."""
    router, worker = fp8_mla_stack
    before = disaggregated(router), metric(worker, "pdserve_kv_local_prefill_fallbacks_total")
    pulled = metric(worker, "pdserve_kv_transfer_bytes_total")
    cases = [("completions", {"prompt": TEXTS[3], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                              "logprobs": 2}),
             ("completions", {"prompt": TEXTS[2], "max_tokens": 6, "temperature": 1.0, "seed": 3, "stream": True}),
             ("chat", {"messages": chat(TEXTS[0]), "max_tokens": 6, "temperature": 0, "stream": True})]
    for route, body in cases:
        assert_same(fp8_mla_stack, route, body)
    assert disaggregated(router) == before[0] + len(cases)
    assert metric(worker, "pdserve_kv_local_prefill_fallbacks_total") == before[1]  # pulled, not refused
    assert metric(worker, "pdserve_kv_transfer_bytes_total") > pulled


def test_mismatched_kv_dtypes_fall_back_to_local_prefill(tiny_checkpoint):
    """A prefill worker whose KV dtype differs from the decode worker's (bf16 -> fp8 here; the
    other way round is the same string comparison, test_scheduler_kv.py): the decode worker
    refuses its KV at the hand-off (the layouts differ) and prefills locally, so the answer is
    still exactly the decode worker's own, streamed or not, and never an error or garbage. One
    transport: the refusal comes before any transfer."""
    with pd_stack(tiny_checkpoint("llama"), "tcp", (), FP8) as pair:
        router, worker = pair
        for route, stream in (("completions", False), ("chat", True), ("completions", True)):
            key = {"prompt": TEXTS[3]} if route == "completions" else {"messages": chat(TEXTS[2])}
            before = metric(worker, "pdserve_kv_local_prefill_fallbacks_total")
            assert_same(pair, route, {**key, "max_tokens": 6, "temperature": 0, "stream": stream})
            assert metric(worker, "pdserve_kv_local_prefill_fallbacks_total") == before + 1


