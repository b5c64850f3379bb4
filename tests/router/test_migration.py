"""Exact mid-stream migration (router/migration.py, protocol/continuation.py), on real workers.

1. The worker side alone: a stream cut after any of its events and continued on the same kind
   of worker from the token ids reported so far gives, appended to what was out before the cut,
   exactly the uninterrupted answer (text, logprobs, finish, usage): greedy, seeded, penalties,
   min_tokens, a stop string, response_format.
2. The router: the decode worker serving a stream is SIGKILLed once the client has k tokens;
   the stream goes on on the other decode worker and the client's whole answer equals the
   uninterrupted one (direct and P/D over TCP, greedy and seeded, logprobs).
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time

import httpx
import pytest

from pdserve.protocol.continuation import HEADER_TOKEN_IDS, strip_token_ids
from tests.checkpoints import write_checkpoint, write_word_tokenizer
from tests.helpers.answer_trap import AnswerTrap
from tests.helpers.metrics import metric
from tests.helpers.processes import stop_together
from tests.net import free_port
from tests.router.test_failures import eventually
from tests.router.test_pd_equality import _close
from tests.worker.test_server_harness import WorkerProcess

pytestmark = pytest.mark.slow

ARGS = ("--served-model-name", "tiny", "--max-model-len", "512", "--block-size", "4",
        "--kv-cache-memory", str(1 << 23), "--kv-peer-allow", "127.0.0.1")
ENV = {"PDSERVE_KV_SECRET": "migration-test-shared-secret"}
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# No arguments: the grammar closes the call within a few tokens even on random weights.
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
PROMPT = "Tell me a story about a fox and a dog who became friends in the forest."


def worker(ckpt, role: str = "decode", transport: str = "tcp") -> WorkerProcess:
    return WorkerProcess(ckpt, *ARGS, "--role", role, "--kv-transfer", transport, "--kv-port", str(free_port()),
                         "--shutdown-grace", "0", env=ENV).start()


@pytest.fixture(scope="module")
def word_worker(tmp_path_factory):
    """A worker over a word-level tokenizer (tests/checkpoints.py): its decoder joins words with
    spaces, and a token that decodes to nothing (EOS, skipped) drops the space before the next
    word in what an incremental detokenizer releases, so the text a client has is not what the
    ids decode to at once."""
    tok = write_word_tokenizer(tmp_path_factory.mktemp("word-tok"))
    w = WorkerProcess(write_checkpoint(tmp_path_factory.mktemp("word-ckpt"), "llama", tok), *ARGS, env=ENV)
    yield w.start().wait_ready()
    w.stop()


@pytest.fixture(scope="module")
def one_worker(tiny_checkpoint):
    w = WorkerProcess(tiny_checkpoint("llama"), *ARGS, "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
                      env=ENV).start().wait_ready()
    yield w
    w.stop()


def events_of(url: str, route: str, body: dict, headers: dict | None = None) -> list[bytes]:
    with httpx.stream("POST", url + PATHS[route], json={"model": "tiny", **body}, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        raw = b"".join(r.iter_raw())
    return [e + b"\n\n" for e in raw.split(b"\n\n") if e]


def answer(events: list[bytes], route: str) -> dict:
    """A stream's events as comparable data, per choice (no ids, no timestamps)."""
    choices: dict[int, dict] = {}
    usage, done = None, False
    for e in events:
        assert e.startswith(b"data: "), e
        if e == b"data: [DONE]\n\n":
            done = True
            continue
        chunk = json.loads(e[6:])
        assert "error" not in chunk, chunk
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            slot = choices.setdefault(c["index"], {"text": "", "logprobs": [], "finish": None, "tools": []})
            slot["text"] += (c.get("text") if route == "completions" else c["delta"].get("content")) or ""
            slot["tools"] += [{k: v for k, v in t.items() if k != "id"}  # a fresh id per call
                              for t in c.get("delta", {}).get("tool_calls") or []]
            lp = c.get("logprobs")
            if lp:
                slot["logprobs"] += lp["content"] if route == "chat" else [list(t) for t in zip(
                    lp["tokens"], lp["token_logprobs"], lp["text_offset"])]
            slot["finish"] = c.get("finish_reason") or slot["finish"]
    usage = usage and {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return {"choices": choices, "usage": usage, "done": done}


BODIES = [
    ("completions", {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 2}),
    ("completions", {"prompt": PROMPT, "max_tokens": 24, "seed": 11, "temperature": 1.0, "presence_penalty": 0.5,
                     "frequency_penalty": 0.7, "repetition_penalty": 1.3, "min_tokens": 20}),
    ("chat", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 20, "seed": 3, "temperature": 0.9,
              "logprobs": True, "top_logprobs": 2}),
    ("chat", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 30, "seed": 5,
              "response_format": {"type": "json_object"}}),
    # A forced tool call: its grammar and the hermes parser's state continue.
    ("chat", {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "max_tokens": 40,
              "seed": 1, "tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
    # Choices of several lengths (some end before the cut, and are not generated again).
    ("completions", {"prompt": [PROMPT, "Hello"], "n": 2, "seed": 4, "max_tokens": 16, "logprobs": 0,
                     "stop": [" a", "e"]}),
]


# Greedy with logprobs on the word tokenizer, EOS made likely (ignored): the text out has words
# joined where an EOS decoded to nothing, so `text_offset`s continue only from the client's text.
WORD_EOS = ("completions", {"prompt": "t5 t6 t7 t8 t9 t10", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                            "logprobs": 1, "logit_bias": {"2": 4}})


@pytest.mark.parametrize("route,body,on", [(*b, "one_worker") for b in BODIES] + [(*WORD_EOS, "word_worker")],
                         ids=["greedy-logprobs", "seeded-penalties", "chat-seeded-logprobs", "chat-json",
                              "chat-forced-tool", "n2-prompts2-stops", "greedy-logprobs-word-eos"])
def test_a_continuation_from_any_event_equals_the_uninterrupted_stream(request, route, body, on):
    one_worker = request.getfixturevalue(on)
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    want = answer(events_of(one_worker.url, route, body), route)
    tagged = events_of(one_worker.url, route, body, {HEADER_TOKEN_IDS: "1"})
    ids: dict[int, list[int]] = {}
    plain = [strip_token_ids(e, ids) for e in tagged]
    assert _close(answer([e for e in plain if e], route), want)  # the lines stripped, the same stream
    assert sum(map(len, ids.values())) == want["usage"]["completion_tokens"]
    num = len(want["choices"])
    # Cut after a few outputs' groups (where a router may cut: the stop tail and partial
    # characters held at each), continue.
    ends = [k for k in range(1, len(tagged)) if tagged[k - 1].startswith(b": token_ids ")][:-1]  # not the last
    cuts = {ends[0], ends[min(1, len(ends) - 1)], ends[len(ends) // 2], ends[-1]}
    # Right after a token that decodes to nothing (the word tokenizer's EOS): the next word's
    # text depends on the detokenizer's window over the last output, which the replay restores.
    cuts = sorted(cuts | {k for k in ends if tagged[k - 1] == b": token_ids 0 2\n\n"})
    moved_ended = []
    for cut in cuts:
        seen: dict[int, list[int]] = {}
        before = [e for e in (strip_token_ids(e, seen) for e in tagged[:cut]) if e]
        ended = answer(before, route)["choices"]
        cont = {**body, "continuation": {"token_ids": [seen.get(i, []) for i in range(num)],
                                         "finished": [i for i, c in ended.items() if c["finish"]]}}
        if route == "completions" and body.get("logprobs") is not None:  # as the router counts it
            cont["continuation"]["text_offset"] = [len(ended[i]["text"]) if i in ended else 0 for i in range(num)]
        moved_ended.append(len(cont["continuation"]["finished"]))
        rest = events_of(one_worker.url, route, cont)
        got = answer(before + rest, route)
        assert _close(got, want), f"cut after event {cut} ({seen})\n{got}\n{want}"
    assert num == 1 or 0 < max(moved_ended) < num  # some cut moved a stream with a choice already ended


def test_a_continuation_is_checked(one_worker):
    base = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "stream": True}
    for cont, why in (({"token_ids": [[1], [2]]}, "one list"), ({"token_ids": [[10 ** 9]]}, "vocabulary"),
                      ({"token_ids": [[1]], "finished": [0]}, "nothing left"),
                      ({"token_ids": [[1]], "text_offset": [3, 4]}, "one length"),
                      ({"token_ids": [[1]], "text_offset": [-1]}, "a length")):
        r = httpx.post(one_worker.url + "/v1/completions", json={**base, "continuation": cont}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "continuation", (why, r.text)
    r = httpx.post(one_worker.url + "/v1/completions", json={**base, "stream": False,
                                                              "continuation": {"token_ids": [[1]]}}, timeout=30)
    assert r.status_code == 400


# ---- the router: a decode worker killed mid-stream ---------------------------------------------

def serving(workers: list[WorkerProcess]) -> WorkerProcess:
    """The worker running a request now (its engine's running count)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for w in workers:
            if httpx.get(w.url + "/debug/kv", timeout=5).json()["num_running"] > 0:
                return w
        time.sleep(0.01)
    raise AssertionError("no worker is running the request")


def stream_killing(router_url: str, route: str, body: dict, workers: list[WorkerProcess], after: int,
                   sig: int = signal.SIGKILL) -> list[bytes]:
    """The router's stream; once `after` events with text are in, the worker serving it gets `sig`
    (SIGTERM: drained, its in-flight requests aborted at once: --shutdown-grace 0)."""
    out, texts, killed = [], 0, None
    with httpx.stream("POST", router_url + PATHS[route], json={"model": "tiny", **body}, timeout=120) as r:
        assert r.status_code == 200
        buf = b""
        for data in r.iter_raw():
            buf += data
            *whole, buf = buf.split(b"\n\n")
            for e in whole:
                out.append(e + b"\n\n")
                texts += b'"text":"' in e or b'"content":"' in e
            if killed is None and texts >= after:
                killed = serving(workers)
                killed.proc.send_signal(sig)
    assert killed is not None
    killed.proc.wait(60)
    return out


@pytest.fixture(scope="module")
def pools(tiny_checkpoint, module_launch):
    """Per KV transport, a prefill worker and two decode workers, started on first use; a killed
    one is started again by the next test."""
    ckpt, made = tiny_checkpoint("llama"), {}

    def get(transport: str) -> dict[str, WorkerProcess]:
        if transport not in made:
            made[transport] = {name: worker(ckpt, role, transport)
                               for name, role in (("prefill", "prefill"), ("d0", "decode"), ("d1", "decode"))}
            for w in made[transport].values():
                w.wait_ready()
        return made[transport]

    yield get, module_launch
    stop_together([w.proc for ws in made.values() for w in ws.values()])


def _idle(w: WorkerProcess) -> bool:
    kv = httpx.get(w.url + "/debug/kv", timeout=5).json()
    return kv["num_pinned_blocks"] == 0 and kv["num_running"] == 0 and kv["num_waiting"] == 0


def revive(decode: list[WorkerProcess]) -> None:
    for w in decode:
        if w.proc.poll() is not None:
            w.start().wait_ready()


GREEDY = ("completions", {"prompt": PROMPT, "max_tokens": 120, "temperature": 0, "ignore_eos": True, "logprobs": 1})
SEEDED = ("chat", {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 120, "seed": 9, "temperature": 1.0,
                   "ignore_eos": True, "logprobs": True, "top_logprobs": 1, "stop": ["zz"]})


# Each sampling and each path once (greedy direct, seeded through P/D on either transport): how a
# continuation is built does not depend on the path (the continuation property above checks it
# for every request shape, on one worker).
@pytest.mark.parametrize("route,body,pd,sig", [
    (*GREEDY, None, signal.SIGKILL), (*SEEDED, "tcp", signal.SIGKILL), (*SEEDED, "nixl", signal.SIGKILL),
    (*GREEDY, None, signal.SIGTERM),
    ("completions", {"prompt": [PROMPT, "Hello"], "n": 2, "max_tokens": 100, "seed": 2, "ignore_eos": True}, None,
     signal.SIGKILL),
], ids=["greedy-direct", "seeded-pd-tcp", "seeded-pd-nixl", "greedy-drained", "n2-prompts2"])
def test_a_decode_worker_killed_mid_stream_is_not_seen_by_the_client(pools, route, body, pd, sig):
    """`pd`: the KV transport of a P/D request (None: served whole by a decode worker)."""
    get, launch = pools
    ws = get(pd or "tcp")
    decode = [ws["d0"], ws["d1"]]
    revive(decode)
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    want = answer(events_of(decode[0].url, route, body), route)
    args = ("--prefill", ws["prefill"].url) if pd else ()
    router = launch.router(*args, "--decode", decode[0].url, "--decode", decode[1].url, "--pd-min-prompt-tokens", "1")
    got = answer(stream_killing(router.url, route, body, decode, after=4, sig=sig), route)
    assert _close(got, want), f"\n{got}\n{want}"
    cause = "drained" if sig == signal.SIGTERM else "lost"
    assert metric(router, "pdserve_router_migrations_total", cause=cause) == 1
    assert metric(router, "pdserve_router_migration_gap_seconds_count") == 1
    assert metric(router, "pdserve_router_requests_total", status="200", disaggregated="yes" if pd else "no") == 1
    # Nothing is held anywhere: the surviving workers' blocks all free again, no pin left.
    for w in [ws["prefill"], *decode]:
        if w.proc.poll() is None:
            eventually(lambda: _idle(w))
    router.stop()


def test_every_stream_of_a_killed_worker_moves_under_load(pools):
    """Six concurrent streams over two decode workers (seeded, each its own seed); once each has
    a few tokens, the worker serving the most is SIGKILLed: every answer equals its twin."""
    get, launch = pools
    ws = get("tcp")
    decode = [ws["d0"], ws["d1"]]
    revive(decode)
    bodies = [{"prompt": f"{PROMPT} ({i})", "max_tokens": 100, "seed": i, "ignore_eos": True, "logprobs": 0,
               "stream": True} for i in range(6)]
    wants = [answer(events_of(decode[0].url, "completions", b), "completions") for b in bodies]
    router = launch.router("--decode", decode[0].url, "--decode", decode[1].url)
    streams: list[list[bytes]] = [[] for _ in bodies]

    def run(i: int) -> None:
        with httpx.stream("POST", router.url + "/v1/completions", json={"model": "tiny", **bodies[i]},
                          timeout=120) as r:
            for e in r.iter_raw():
                streams[i].append(e)

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool_:
        running = [pool_.submit(run, i) for i in range(len(bodies))]
        eventually(lambda: all(b"".join(s).count(b'"text":"') >= 3 for s in streams) or all(r.done() for r in running))
        loads = [httpx.get(w.url + "/debug/kv", timeout=5).json()["num_running"] for w in decode]
        victim = decode[loads.index(max(loads))]
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(60)
        for r in running:
            r.result()
    for i, (raw, want) in enumerate(zip(streams, wants)):
        got = answer([e + b"\n\n" for e in b"".join(raw).split(b"\n\n") if e], "completions")
        assert _close(got, want), f"stream {i}\n{got}\n{want}"
    assert metric(router, "pdserve_router_migrations_total", cause="lost") == max(loads) > 0
    assert metric(router, "pdserve_router_requests_total", status="200") == len(bodies)
    router.stop()



def _unary_answer(data: dict) -> dict:
    """A non-streamed completion as comparable data (as `answer` makes of a stream)."""
    choices = {}
    for c in data["choices"]:
        lp = c.get("logprobs")
        choices[c["index"]] = {"text": c["text"], "finish": c["finish_reason"], "tools": [], "logprobs": [
            list(t) for t in zip(lp["tokens"], lp["token_logprobs"], lp["text_offset"])] if lp else []}
    usage = {k: data["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    return {"choices": choices, "usage": usage, "done": True}


def _ask(url: str, route: str, body: dict) -> dict:
    if body["stream"]:
        return answer(events_of(url, route, body), route)
    r = httpx.post(url + PATHS[route], json={"model": "tiny", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return _unary_answer(r.json())


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_a_decode_worker_killed_between_the_handoff_and_its_first_byte(pools, stream):
    """The P/D request's only decode worker takes the hand-off in, pulls the KV (the prefill
    worker's pin is released) and is SIGKILLed before its first byte reaches the router
    (tests/helpers/answer_trap.py): the client has the prefill's first token at most. The
    request goes on on the prefill worker (a stream as a continuation of prompt + that token;
    an unary request, of which nothing was sent, whole) and its answer is one uninterrupted
    worker's. (Killing an alive one of the two decode workers: no restart when the module ends.)"""
    get, launch = pools
    ws = get("tcp")
    decode = [w for w in (ws["d0"], ws["d1"]) if w.proc.poll() is None] or [revive([ws["d0"]]) or ws["d0"]]
    victim, prefill = decode[0], ws["prefill"]
    route, body = GREEDY
    body = {**body, "max_tokens": 24, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    want = _ask(prefill.url, route, body)

    def kill() -> None:
        eventually(lambda: httpx.get(prefill.url + "/debug/kv", timeout=5).json()["num_pinned_blocks"] == 0)
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(60)

    trap = AnswerTrap(victim.port, kill)
    try:
        router = launch.router("--prefill", prefill.url, "--decode", trap.url, "--pd-min-prompt-tokens", "1")
        got = _ask(router.url, route, body)
        assert trap.sprung.is_set() and victim.proc.poll() is not None
        assert _close(got, want), f"\n{got}\n{want}"
        assert metric(router, "pdserve_router_requests_total", status="200") == 1
        if stream:
            assert metric(router, "pdserve_router_migrations_total", cause="lost") == 1
        eventually(lambda: _idle(prefill))
        router.stop()
    finally:
        trap.close()


def test_a_busy_decode_pool_at_the_handoff_is_counted_busy_not_lost(pools):
    """Every decode worker answers the hand-off 429 (busy: stand-in processes refusing each
    completion, tests/router/fake_worker.py; a real worker's 429 needs a grammar backlog), once
    the client has the prefill's first token (their answers are held until then; a streamed
    hand-off refused before it is a 429 to the client, nothing moves): the stream goes on on the
    prefill worker as a continuation of that token, equal to one uninterrupted worker's answer,
    and the move is counted `busy`, never `lost`; the prefill worker's pin is released. Both
    hand-offs, one router each, sharing the workers."""
    get, launch = pools
    prefill = get("tcp")["prefill"]
    busy = [launch.fake_worker(), launch.fake_worker()]
    route, body = GREEDY
    body = {**body, "max_tokens": 24, "stream": True, "stream_options": {"include_usage": True}}
    want = _ask(prefill.url, route, body)
    for handoff in ("streamed", "after-prefill"):
        for w in busy:
            w.control(refuse=429, hold="answer")
        asked = [len(w.requests()) for w in busy]
        router = launch.router("--prefill", prefill.url, "--decode", busy[0].url, "--decode", busy[1].url,
                               "--pd-min-prompt-tokens", "1", "--pd-handoff", handoff)
        events: list[bytes] = []
        with httpx.stream("POST", router.url + PATHS[route], json={"model": "tiny", **body}, timeout=120) as r:
            assert r.status_code == 200, r.read()
            buf = b""
            for data in r.iter_raw():
                buf += data
                *whole, buf = buf.split(b"\n\n")
                if not events and whole:  # the first token is out: the decode workers may refuse now
                    for w in busy:
                        w.control(release=True)
                events += [e + b"\n\n" for e in whole]
        got = answer(events, route)
        assert _close(got, want), f"{handoff}\n{got}\n{want}"
        assert all(len(w.requests()) > n for w, n in zip(busy, asked)), handoff  # both asked, both refused
        assert metric(router, "pdserve_router_migrations_total", cause="busy") == 1, handoff
        assert metric(router, "pdserve_router_migrations_total", cause="lost") == 0, handoff
        assert metric(router, "pdserve_router_requests_total", status="200", disaggregated="yes") == 1, handoff
        eventually(lambda: _idle(prefill))
        router.stop()
    for w in busy:
        w.stop()
