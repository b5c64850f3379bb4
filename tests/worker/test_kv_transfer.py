"""P/D KV transfer between two real worker processes on loopback, for each transport.

Every test ends by checking that both workers' free-block counts are back at their start
and nothing is left pinned.
"""

from __future__ import annotations

import time

import httpx
import pytest

from pdserve.worker.kv import side_channel
from pdserve.worker.kv.auth import SideChannelAuth
from pdserve.worker.kv.prompt_binding import token_digest
from tests.worker.kv_harness import PD_ARGS, kv_state, leaves_no_kv, metric, wait_clean
from tests.worker.kv_harness import pd_pair as start_pd_pair
from tests.net import free_port
from tests.worker.test_server_harness import WorkerProcess

PROMPT = "The quick brown fox jumps over the lazy dog, then runs into the forest to find"
BASE = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
ARGS = PD_ARGS
SECRET = "kv-transfer-tests-shared-secret"
ENV = {"PDSERVE_KV_SECRET": SECRET}  # as a Kubernetes Secret would pass it
AUTH = SideChannelAuth(SECRET)
PIN_TTL = 8


def prefill(p: WorkerProcess, body: dict) -> dict:
    r = httpx.post(f"{p.url}/v1/completions", timeout=60,
                   json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["kv_transfer_params"]["transfer_token"]
    return out


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def pd_pair(request, tiny_checkpoint):
    # The TTL is short for the TTL tests, yet long enough that a starved CI machine does not let
    # a pin expire between a prefill and its decode (a pull after expiry recomputes locally).
    with start_pd_pair(tiny_checkpoint("llama"), request.param, ARGS, ENV, pin_ttl=PIN_TTL, pull_timeout=30) as (p, d):
        yield request.param, p, d


@pytest.fixture
def clean(pd_pair):
    with leaves_no_kv(pd_pair[1:]):
        yield


def test_pd_equals_single_worker_greedy(pd_pair, clean):
    transport, p, d = pd_pair
    body = {**BASE, "prompt": "A fresh prompt that neither worker has cached before: " + PROMPT}
    first = prefill(p, body)
    assert first["kv_transfer_params"]["transport"] == transport
    pulled_before = metric(d, "pdserve_kv_transfer_bytes_total")
    rest = httpx.post(f"{d.url}/v1/completions", timeout=60,
                      json={**body, "kv_transfer_params": first["kv_transfer_params"]}).json()
    plain = httpx.post(f"{d.url}/v1/completions", json=body, timeout=60).json()
    assert first["choices"][0]["text"] + rest["choices"][0]["text"] == plain["choices"][0]["text"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):  # prompt once, all 12 completion tokens
        assert rest["usage"][key] == plain["usage"][key]
    assert rest["usage"]["completion_tokens"] == 12
    assert metric(d, "pdserve_kv_transfer_bytes_total") > pulled_before  # really pulled, not recomputed
    assert metric(d, "pdserve_kv_local_prefill_fallbacks_total") == 0


def test_streamed_decode_continues_after_first_token(pd_pair, clean):
    _, p, d = pd_pair
    plain = httpx.post(f"{d.url}/v1/completions", json=BASE, timeout=60).json()["choices"][0]["text"]
    first = prefill(p, BASE)
    text = first["choices"][0]["text"]
    with httpx.stream("POST", f"{d.url}/v1/completions", timeout=60,
                      json={**BASE, "stream": True, "kv_transfer_params": first["kv_transfer_params"]}) as r:
        import json

        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == plain


def test_unpulled_blocks_are_freed_at_ttl(pd_pair, clean):
    _, p, _ = pd_pair
    before = kv_state(p)
    prefill(p, BASE)
    assert kv_state(p)["num_pinned_blocks"] > 0
    # --kv-pin-ttl PIN_TTL: the `clean` fixture's poll sees them freed without any release.
    end = wait_clean(p, before, timeout=PIN_TTL + 30)
    assert end["num_pinned_blocks"] == 0


def test_forged_and_expired_tokens_are_rejected(pd_pair, clean):
    _, p, d = pd_pair
    params = prefill(p, BASE)["kv_transfer_params"]
    host, port = params["remote_host"], params["remote_port"]
    digest = token_digest(params["transfer_token"])
    forged = {"request_id": params["remote_request_id"], "token": "forged", "indices": [0], "prompt_digest": digest}
    with pytest.raises(side_channel.SideChannelError, match="refused"):
        side_channel.call(host, port, "read", forged, 5, AUTH, params["remote_engine_id"])
    # A decode worker handed the forged token (bound to the right prompt, so it passes the decode
    # side's early check) cannot pull; it prefills locally and still answers right.
    plain = httpx.post(f"{d.url}/v1/completions", json=BASE, timeout=60).json()["choices"][0]["text"]
    fallbacks = metric(d, "pdserve_kv_local_prefill_fallbacks_total")
    bad = {**params, "transfer_token": f"forged.{digest}"}
    rest = httpx.post(f"{d.url}/v1/completions", json={**BASE, "kv_transfer_params": bad}, timeout=60).json()
    assert params and rest["choices"][0]["text"] == plain[len(plain) - len(rest["choices"][0]["text"]):]
    assert metric(d, "pdserve_kv_local_prefill_fallbacks_total") == fallbacks + 1
    # Expired: after the TTL the genuine token is refused too (polled: it is accepted until then).
    genuine = {**forged, "token": params["transfer_token"], "keep": True}  # keep: a read would release it
    deadline = time.monotonic() + PIN_TTL + 30
    while True:
        try:
            side_channel.call(host, port, "read", genuine, 5, AUTH, params["remote_engine_id"])
        except side_channel.SideChannelError as e:
            assert "refused" in str(e)
            break
        assert time.monotonic() < deadline, "the genuine token was still accepted long after its TTL"
        time.sleep(0.5)


def test_peer_outside_allowlist_is_never_contacted(pd_pair, clean):
    _, p, d = pd_pair
    params = prefill(p, BASE)["kv_transfer_params"]
    failures = metric(d, "pdserve_kv_transfer_failures_total")
    for host in ("203.0.113.7", "169.254.169.254", "metadata.google.internal"):  # not in --kv-peer-allow
        forged = {**params, "remote_host": host}
        r = httpx.post(f"{d.url}/v1/completions", json={**BASE, "kv_transfer_params": forged}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
        assert "--kv-peer-allow" in r.json()["error"]["message"]
    assert metric(d, "pdserve_kv_transfer_failures_total") == failures  # refused before any connection
    release(params)  # the genuine pin: the leak check passes promptly


def release(params: dict) -> None:
    """Free a pin nobody will read (else it holds its blocks until the TTL)."""
    side_channel.call(params["remote_host"], params["remote_port"], "release",
                      {"request_id": params["remote_request_id"], "token": params["transfer_token"]}, 5, AUTH,
                      params["remote_engine_id"])


def test_mismatched_block_size_is_refused(tiny_checkpoint, pd_pair, clean):
    _, p, _ = pd_pair
    ckpt = tiny_checkpoint("llama")
    params = prefill(p, BASE)["kv_transfer_params"]
    args = ("--max-model-len", "256", "--block-size", "8", "--kv-cache-memory", str(1 << 22), "--kv-peer-allow",
            "127.0.0.1")
    with WorkerProcess(ckpt, *args, "--role", "decode", "--kv-transfer", "tcp") as d8:
        r = httpx.post(f"{d8.url}/v1/completions", json={**BASE, "kv_transfer_params": params}, timeout=60)
        assert r.status_code == 400
        err = r.json()["error"]
        assert "block size is 4" in err["message"] and "8" in err["message"]
        assert err["param"] == "kv_transfer_params"
        assert kv_state(d8)["num_free_blocks"] == kv_state(d8)["num_total_blocks"]
    release(params)


def test_killed_prefill_worker_means_local_prefill(tiny_checkpoint):
    ckpt = tiny_checkpoint("llama")
    with WorkerProcess(ckpt, *ARGS, "--role", "decode", "--kv-transfer", "tcp", "--kv-pull-timeout", "2", env=ENV) as d:
        start = kv_state(d)
        plain = httpx.post(f"{d.url}/v1/completions", json=BASE, timeout=60).json()["choices"][0]["text"]
        with WorkerProcess(ckpt, *ARGS, "--role", "prefill", "--kv-transfer", "tcp", "--kv-port", str(free_port()),
                           env=ENV) as p:
            first = prefill(p, BASE)
            p.stop(sig=9)
        rest = httpx.post(f"{d.url}/v1/completions", timeout=60,
                          json={**BASE, "kv_transfer_params": first["kv_transfer_params"]}).json()
        assert first["choices"][0]["text"] + rest["choices"][0]["text"] == plain
        assert metric(d, "pdserve_kv_local_prefill_fallbacks_total") == 1
        assert wait_clean(d, start)["num_free_blocks"] == start["num_free_blocks"]


def test_prompt_blocks_cached_on_decode_are_not_pulled(pd_pair, clean):
    _, p, d = pd_pair

    def pulled_for(body) -> tuple[float, int]:
        before = metric(d, "pdserve_kv_transfer_bytes_total")
        first = prefill(p, body)
        rest = httpx.post(f"{d.url}/v1/completions", json={**body, "kv_transfer_params": first["kv_transfer_params"]},
                          timeout=60).json()
        assert rest["usage"]["completion_tokens"] == body["max_tokens"]
        blocks = -(-rest["usage"]["prompt_tokens"] // 4)  # --block-size 4
        return metric(d, "pdserve_kv_transfer_bytes_total") - before, blocks

    fresh = {**BASE, "prompt": "Seven quiet owls watched the harbour lights fade over the grey water at dawn"}
    full, fresh_blocks = pulled_for(fresh)  # nothing cached: every prompt block crosses over
    block_bytes = full / fresh_blocks
    cached = {**BASE, "prompt": "Nine restless gulls circled the fishing boats returning with silver catch"}
    httpx.post(f"{d.url}/v1/completions", json=cached, timeout=60)  # decode now caches this prompt
    partial, _ = pulled_for(cached)
    # Every full block is a local prefix-cache hit; only the block with the last token is pulled.
    assert partial == block_bytes


def test_metrics_list_each_family_once(pd_pair):
    """One registry per process: engine, server and KV-transfer series each appear once."""
    _, p, d = pd_pair
    for w in (p, d):
        text = httpx.get(f"{w.url}/metrics", timeout=10).text
        families = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
        assert len(families) == len(set(families)), sorted(f for f in families if families.count(f) > 1)
        for name in ("pdserve_kv_pinned_blocks", "pdserve_kv_transfer_bytes_total", "vllm:num_requests_running"):
            assert name in families


def _sse_text(r: httpx.Response) -> tuple[str, list[int]]:
    import json

    text, offsets = "", []
    for line in r.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            offsets += (choice.get("logprobs") or {}).get("text_offset", [])
    return text, offsets


@pytest.mark.parametrize("stream", [False, True])
def test_streamed_hand_off_over_http_equals_one_worker(pd_pair, clean, stream):
    """The two-line prefill answer: the params first (the decode call starts on them while the
    prefill runs), the ordinary answer second; the decode worker learns the first token with
    its pull. Text, usage and logprob offsets equal one worker's."""
    import json
    import threading

    _, p, d = pd_pair
    body = {**BASE, "prompt": f"Streamed {stream}, then " + PROMPT, "logprobs": 1}
    plain = httpx.post(f"{d.url}/v1/completions", json=body, timeout=60).json()
    with httpx.stream("POST", f"{p.url}/v1/completions", timeout=60,
                      json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True,
                                                                            "stream_kv": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = r.iter_lines()
        early = json.loads(next(lines))["kv_transfer_params"]
        assert early["stream_kv"] is True and early["first_token_id"] is None
        decoded: dict = {}

        def decode():  # started before the prefill's answer is read
            dbody = {**body, "stream": stream, "kv_transfer_params": early}
            if stream:
                with httpx.stream("POST", f"{d.url}/v1/completions", json=dbody, timeout=60) as dr:
                    decoded["text"], decoded["offsets"] = _sse_text(dr)
            else:
                out = httpx.post(f"{d.url}/v1/completions", json=dbody, timeout=60).json()
                decoded["text"] = out["choices"][0]["text"]
                decoded["offsets"] = out["choices"][0]["logprobs"]["text_offset"]
                decoded["usage"] = out["usage"]

        t = threading.Thread(target=decode)
        t.start()
        answer = json.loads(next(lines))
    t.join(60)
    assert not t.is_alive()
    final = answer["kv_transfer_params"]
    assert final["first_token_id"] is not None and "stream_kv" not in final
    first_text = answer["choices"][0]["text"]
    assert first_text + decoded["text"] == plain["choices"][0]["text"]
    # A streamed decode's offsets continue after the first token's text; a whole answer's start at
    # its own text (the router's merge shifts them, as for any hand-off).
    shift = 0 if stream else len(first_text)
    assert answer["choices"][0]["logprobs"]["text_offset"] + [o + shift for o in decoded["offsets"]] == \
        plain["choices"][0]["logprobs"]["text_offset"]
    if not stream:
        assert decoded["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]


def test_a_prefill_client_that_leaves_after_the_announcement_frees_everything(pd_pair, clean):
    import json

    _, p, d = pd_pair
    body = {**BASE, "prompt": "Hang up after the params: " + PROMPT * 3}
    with httpx.stream("POST", f"{p.url}/v1/completions", timeout=60,
                      json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True,
                                                                            "stream_kv": True}}) as r:
        early = json.loads(next(r.iter_lines()))["kv_transfer_params"]
    # The decode worker may still get the params: it waits for a prefill that was aborted (or
    # finished and then released by nobody) and ends the request or prefills as the pin says.
    out = httpx.post(f"{d.url}/v1/completions", json={**body, "kv_transfer_params": early}, timeout=60)
    assert out.status_code == 200


def test_sigterm_keeps_pinned_kv_until_the_decode_worker_reads_it(tiny_checkpoint):
    """A scale-down (SIGTERM) of a prefill worker that holds KV for a decode worker: it stops
    taking requests but stays up, its side channel serving, until the decode worker has pulled
    (the answer is one worker's, with no local prefill), and then exits 0 at once."""
    import signal

    args = (*ARGS, "--shutdown-grace", "120")
    with start_pd_pair(tiny_checkpoint("llama"), "tcp", args, ENV, pin_ttl=120, pull_timeout=10) as (p, d):
        body = {**BASE, "prompt": "Scaled down while its KV waits: " + PROMPT}
        plain = httpx.post(f"{d.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        first = prefill(p, body)
        assert kv_state(p)["num_pinned_blocks"] > 0
        p.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while "waiting for decode workers to read" not in p.output():
            assert p.proc.poll() is None and time.monotonic() < deadline, p.output()
            time.sleep(0.05)
        assert p.proc.poll() is None  # the grace (120 s) and the pin's TTL (120 s) are far off
        rest = httpx.post(f"{d.url}/v1/completions", timeout=60,
                          json={**body, "kv_transfer_params": first["kv_transfer_params"]}).json()
        assert first["choices"][0]["text"] + rest["choices"][0]["text"] == plain
        assert metric(d, "pdserve_kv_local_prefill_fallbacks_total") == 0
        assert p.proc.wait(60) == 0, p.output()
        assert "unread at the end of the grace period" not in p.output()
