"""P/D between tensor-parallel workers (CPU, gloo, fp32): real `pdserve worker` processes on
loopback, TCP and NIXL (UCX moving DRAM between processes).

One group of workers per (transport, model): prefill TP=2, decode TP=2, and one TP=1 worker with
--role both (the TP=1 prefill and the TP=1 decode).
Each P/D pair's output (the prefill's first token + the decode's rest) must equal the TP=1
decode worker's own greedy output for the same prompt, the decode worker must have pulled
(bytes counted, no local-prefill fallback), and afterwards no worker holds a block it did not
hold before. Llama with 2 KV heads maps heads across ranks (TP=2 -> TP=1 interleaves both
prefill ranks' heads; TP=1 -> TP=2 keeps each rank's slice); Qwen2 with 1 KV head has it
replicated on both ranks of a TP=2 worker; gpt-oss hands off its hybrid KV cache (the full
layers' blocks and the sliding layers' window, docs/kv-cache.md) across TP sizes; DeepSeek-V3's
latent cache (multi-head latent attention: one latent per token and layer, which every rank
computes and holds whole) takes that replicated path, so one prefill rank's blocks serve every
decode rank. A pull that
fails on one rank only falls back to local prefill on every rank, with the same output.
"""

from __future__ import annotations

import time

import httpx
import pytest

from pdserve.protocol.kv_layout import KVLayout
from pdserve.protocol.kv_transfer import KVTransferParams
from pdserve.worker.kv import side_channel
from pdserve.worker.kv.auth import SideChannelAuth
from pdserve.worker.kv.nixl_transport import nixl_available
from pdserve.worker.kv.tp_transfer import Source, TPRank, kv_sources
from tests.checkpoints import write_checkpoint
from tests.helpers.processes import stop_together
from tests.net import free_port
from tests.worker.kv_harness import kv_state, metric
from tests.worker.test_server_harness import WorkerProcess

# Dispatched with the slow modules, before the quick ones (tests/conftest.py):
# four groups of three worker processes (five ranks), ~30 s each to start on CI.
pytestmark = pytest.mark.slow

SECRET = "tp-pd-tests-shared-secret"
ENV = {"PDSERVE_KV_SECRET": SECRET}
ARGS = ("--served-model-name", "x", "--max-model-len", "128", "--block-size", "4", "--kv-cache-memory", str(1 << 21),
        "--kv-peer-allow", "127.0.0.1", "--kv-pull-timeout", "5", "--kv-pin-ttl", "20",
        "--kv-stream-chunk-tokens", "8")  # a streamed hand-off's 23-token prompt in 3 chunks
MAX_TOKENS = 8
LAYOUT = KVLayout(1, 1, 1, "float32", 16)  # what the params name (16 tokens a block); a pull compares none


# -- which prefill rank holds each decode rank's heads ---------------------------------------------

@pytest.mark.parametrize("kv,remote,local,rank,want", [
    (2, 2, 2, 1, [Source(1, [0], [0], 1, 1)]),  # same TP: the matching rank, whole blocks
    (2, 2, 1, 0, [Source(0, [0], [0], 1, 2), Source(1, [0], [1], 1, 2)]),  # interleave both ranks' heads
    (2, 1, 2, 1, [Source(0, [1], [0], 2, 1)]),  # keep our slice of the full-head block
    (1, 2, 2, 1, [Source(1, [0], [0], 1, 1)]),  # a replicated head: the matching replica
    (1, 2, 1, 0, [Source(0, [0], [0], 1, 1)]),  # one replica is enough
    (4, 2, 4, 3, [Source(1, [1], [0], 2, 1)]),
    (2, 4, 1, 0, [Source(0, [0], [0], 1, 2), Source(2, [0], [1], 1, 2)]),  # 2 KV heads on 4 ranks
])
def test_kv_sources(kv, remote, local, rank, want):
    got = kv_sources(kv, remote, TPRank(rank, local, kv))
    assert got == want
    assert [s.direct for s in got] == [s.remote_num_heads == s.local_num_heads and s.remote_heads == s.local_heads
                                       == list(range(s.local_num_heads)) for s in want]


def test_unreadable_remote_tp_is_refused():
    with pytest.raises(ValueError, match="tensor-parallel size 3 cannot shard this model's 2 KV heads"):
        kv_sources(2, 3, TPRank(0, 1, 2))


# -- real workers -----------------------------------------------------------------------------------

def free_kv_ports() -> int:
    """A port p with p and p + 1 free: a TP=2 prefill worker serves rank r's shard on --kv-port + r."""
    return free_port(span=2)


# Each group a transport and a way heads split: KV heads split over the ranks (llama over NIXL,
# gpt-oss over TCP: also the hybrid KV cache, its sliding layers' window only handed off), one KV
# head replicated (qwen2), the MLA latent (deepseek-v3: one replicated "KV head" whatever the
# config's num_key_value_heads). A dense model split over TCP adds nothing gpt-oss does not cover.
GROUPS = [("nixl", "llama", 2), ("tcp", "qwen2", 1), ("tcp", "gpt-oss", 2), ("tcp", "deepseek-v3", 1)]


@pytest.fixture(scope="module", params=GROUPS, ids=[f"{t}-{a}-kv{k}" for t, a, k in GROUPS])
def workers(request, tmp_path_factory, default_model_dir):
    transport, arch, kv = request.param
    if transport == "nixl" and not nixl_available():
        pytest.skip("needs the nixl extra (pip install 'pdserve[nixl]')")
    ckpt = write_checkpoint(tmp_path_factory.mktemp(f"ckpt-{arch}-kv{kv}"), arch, default_model_dir,
                            num_key_value_heads=kv)
    ws = {}
    for role, tp in (("both", 1), ("prefill", 2), ("decode", 2)):
        # --async-scheduling everywhere: the TP=1 worker overlaps its steps, a P/D worker under
        # TP ignores the flag (docs/async-scheduling.md), and hand-offs between the two work.
        ws[role, tp] = WorkerProcess(ckpt, *ARGS, "--role", role, "--kv-transfer", transport,
                                     "--tensor-parallel-size", str(tp), "--kv-port", str(free_kv_ports()),
                                     "--async-scheduling", env=ENV).start()
    # One TP=1 worker plays both roles (--role both: it pins for a decode worker and pulls from a
    # prefill worker): the prefill of TP 1 -> 2, the decode of TP 2 -> 1 and the reference. A
    # TP=1 worker per role would cost a group one more start and change nothing under test: the
    # head mapping is the TP sizes', whichever role flag a worker has.
    ws["prefill", 1] = ws["decode", 1] = ws.pop(("both", 1))
    try:
        for w in ws.values():
            w.wait_ready()
        for (role, tp), w in ws.items():
            assert ("async scheduling on" in w.output()) == (tp == 1), (role, tp)
            assert ("--async-scheduling ignored" in w.output()) == (tp == 2), (role, tp)
        yield transport, ws, kv
    finally:
        # each once (a second SIGTERM skips the graceful shutdown), together: their shutdowns overlap
        stop_together({w.proc for w in ws.values()})


@pytest.fixture
def no_leaks(workers):
    _, ws, _ = workers
    start = {k: kv_state(w)["num_free_blocks"] for k, w in ws.items()}
    yield
    for k, w in ws.items():
        deadline = time.monotonic() + 15
        while True:  # pins are freed by the engine loop shortly after the release
            s = kv_state(w)
            if (s["num_free_blocks"] == start[k] and s["num_pinned_blocks"] == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert s["num_pinned_blocks"] == 0, f"{k} still pins blocks"
        assert s["num_free_blocks"] == start[k], f"{k} leaked KV blocks"


def prompt_of(tag: str) -> list[int]:
    # Token ids: a prompt of several blocks that no worker has seen (no prefix-cache hit on decode).
    base = sum(map(ord, tag)) * 7
    return [(base + 13 * i) % 900 + 50 for i in range(23)]


def pd(p: WorkerProcess, d: WorkerProcess, prompt: list[int], tamper=None) -> str:
    """The P/D text: the prefill worker's first token, then the decode worker's rest."""
    body = {"model": "x", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    first = httpx.post(f"{p.url}/v1/completions", timeout=120,
                       json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    if tamper:
        tamper(params)
    rest = httpx.post(f"{d.url}/v1/completions", timeout=120, json={**body, "kv_transfer_params": params})
    assert rest.status_code == 200, rest.text
    assert rest.json()["usage"]["completion_tokens"] == MAX_TOKENS
    return first.json()["choices"][0]["text"] + rest.json()["choices"][0]["text"]


def pd_streamed(p: WorkerProcess, d: WorkerProcess, prompt: list[int]) -> str:
    """The streamed hand-off: the decode request starts on the prefill's first line (its pin, made
    at admission), every rank reading its heads chunk by chunk; then the prefill's answer."""
    import json
    import threading

    body = {"model": "x", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    rest: dict = {}
    with httpx.stream("POST", f"{p.url}/v1/completions", timeout=120,
                      json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True,
                                                                            "stream_kv": True}}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        early = json.loads(next(lines))["kv_transfer_params"]
        t = threading.Thread(target=lambda: rest.update(httpx.post(
            f"{d.url}/v1/completions", timeout=120, json={**body, "kv_transfer_params": early}).json()))
        t.start()
        first = json.loads(next(lines))
    t.join(120)
    assert rest["usage"]["completion_tokens"] == MAX_TOKENS, rest
    return first["choices"][0]["text"] + rest["choices"][0]["text"]


def single(w: WorkerProcess, prompt: list[int]) -> str:
    r = httpx.post(f"{w.url}/v1/completions", timeout=120,
                   json={"model": "x", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


PAIRS = [(2, 2), (2, 1), (1, 2)]  # (prefill TP, decode TP)


@pytest.mark.parametrize("streamed", [False, True], ids=["after-prefill", "streamed"])
def test_tp_pd_equals_single_worker_greedy(workers, no_leaks, streamed):
    transport, ws, _ = workers
    results = {}
    for ptp, dtp in PAIRS:
        p, d = ws["prefill", ptp], ws["decode", dtp]
        prompt = prompt_of(f"{transport}{ptp}{dtp}{streamed}")
        pulled = metric(d, "pdserve_kv_transfer_bytes_total")
        skipped = metric(d, "pdserve_kv_window_skipped_bytes_total")
        results[ptp, dtp] = (prompt, (pd_streamed if streamed else pd)(p, d, prompt))
        assert metric(d, "pdserve_kv_transfer_bytes_total") > pulled, f"TP {ptp} -> {dtp} did not pull"
        # A hybrid cache (its engine says so at start) leaves the sliding blocks before the window behind.
        windowed = "sliding window" in d.output()
        assert (metric(d, "pdserve_kv_window_skipped_bytes_total") > skipped) == windowed
    for w in (ws["decode", 1], ws["decode", 2]):
        assert metric(w, "pdserve_kv_local_prefill_fallbacks_total") == 0
    # The reference: one TP=1 worker serving the whole request (after the P/D runs, so its prefix
    # cache could not have spared any pull above).
    for (ptp, dtp), (prompt, text) in results.items():
        assert text == single(ws["decode", 1], prompt), f"TP {ptp} -> {dtp} differs from a single worker"


@pytest.mark.parametrize("ptp,dtp", [(2, 2), (2, 1)])
def test_one_rank_failing_falls_back_on_all_ranks(workers, no_leaks, ptp, dtp):
    """Prefill rank 1's pin is released before the decode worker pulls: the read of rank 1's
    shard fails, rank 0's succeeds; every decode rank must prefill locally, with the same output.
    (With one replicated KV head, a TP=1 decode reads rank 0's replica only: no fallback then.)"""
    transport, ws, kv = workers
    if transport != "tcp":
        pytest.skip("one transport is enough for the fallback's bookkeeping")
    p, d = ws["prefill", ptp], ws["decode", dtp]
    prompt = prompt_of(f"fail{ptp}{dtp}")

    def release_rank1(params):
        side_channel.call("127.0.0.1", params["remote_port"] + 1, "release",
                          {"request_id": params["remote_request_id"], "token": params["transfer_token"]},
                          5.0, SideChannelAuth(SECRET), params["remote_engine_id"])

    reads_rank1 = any(s.remote_rank == 1 for r in range(dtp) for s in kv_sources(kv, ptp, TPRank(r, dtp, kv)))
    fallbacks = metric(d, "pdserve_kv_local_prefill_fallbacks_total")
    text = pd(p, d, prompt, tamper=release_rank1)
    assert metric(d, "pdserve_kv_local_prefill_fallbacks_total") == fallbacks + reads_rank1
    assert text == single(ws["decode", 1], prompt)


# -- the head mapping byte for byte, in process (two "ranks" are two connectors on port, port + 1) --

@pytest.mark.parametrize("kv_dtype", ["float32", "float8_e4m3fn"])
@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_staged_pulls_put_every_head_where_it_belongs(transport, kv_dtype):
    """Prefill TP=2 -> decode TP=1 interleaves both ranks' heads; prefill TP=1 -> decode TP=2 keeps
    each rank's slice: the decode caches must equal the prefill caches' heads exactly (byte for
    byte; an fp8 KV cache (--kv-cache-dtype fp8) moves as it is, one byte a value)."""
    if transport == "nixl" and not nixl_available():
        pytest.skip("needs the nixl extra (pip install 'pdserve[nixl]')")
    import torch

    from pdserve.worker.config.engine import EngineConfig
    from pdserve.worker.kv.connector import KVConnector
    from pdserve.worker.kv.prompt_binding import prompt_digest

    layers, bs, kv, dim, blocks = 2, 4, 2, 8, 16
    prompt = list(range(10, 10 + 3 * bs))
    digest = prompt_digest(prompt)
    src_ids, dst_ids = [3, 4, 9], [7, 1, 2]

    def config(port):
        return EngineConfig(device="cpu", kv_transfer=transport, kv_port=port, kv_peer_allow=("127.0.0.1",),
                            kv_secret=SECRET, kv_pull_timeout=10)

    def cache(heads, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(blocks, layers, 2, bs, heads, dim, generator=g).to(getattr(torch, kv_dtype))

    def serve(size):
        """A prefill worker of TP `size`: one connector per rank, rank r on port + r, one pin."""
        port = free_kv_ports()
        ranks = [KVConnector(config(port), cache(kv // size, r), "eng", LAYOUT, tp=TPRank(r, size, kv))
                 for r in range(size)]
        token = None
        for c in ranks:
            c.start_server()
            token, _ = c.pins.add("req", src_ids, digest, token=token)
        params = {"remote_engine_id": "eng", "remote_host": "127.0.0.1", "remote_port": port,
                  "remote_request_id": "req", "transfer_token": token, "kv_tp_size": size,
                  "transport": transport,  # absent, a pull goes over TCP
                  "remote_block_ids": list(src_ids), "num_prompt_tokens": 16 * len(src_ids), "first_token_id": 0,
                  "kv_layout": str(LAYOUT)}
        return ranks, KVTransferParams.from_dict(params)

    def pull(size, rank, params):
        c = KVConnector(config(free_kv_ports()), cache(kv // size, 99), "dec", LAYOUT, tp=TPRank(rank, size, kv))
        c.cache.zero_()
        c._pull(params, list(range(len(src_ids))), dst_ids, digest)
        if transport == "nixl":  # it really read over NIXL, into its registered staging buffer
            assert c.kv.staging.registrations == 1
        c.shutdown()
        return c.cache[dst_ids].view(torch.uint8)

    prefill, params = serve(2)  # TP=2 -> TP=1: head h comes from rank h
    try:
        want = torch.cat([r.cache[src_ids].view(torch.uint8) for r in prefill], dim=4)
        assert torch.equal(pull(1, 0, params), want)
    finally:
        for r in prefill:
            r.shutdown()
    prefill, params = serve(1)  # TP=1 -> TP=2: rank r keeps head r
    try:
        full = prefill[0].cache[src_ids].view(torch.uint8)
        for rank in (0, 1):
            assert torch.equal(pull(2, rank, params), full[:, :, :, :, rank:rank + 1])
    finally:
        prefill[0].shutdown()
