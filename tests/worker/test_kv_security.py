"""Attacks on the P/D data path (issue 15, items 2-5), against two real worker processes per
transport. The attacker is this test process: it speaks ZMQ to the prefill worker's side
channel and HTTP to the decode worker, as anyone on the network could.

The pair runs as a deployment should: the same --kv-secret on both (from the environment, as
a Kubernetes Secret passes it), --kv-peer-allow naming loopback only, and --api-key on both.
Every test ends with both workers' blocks all free and nothing pinned.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
import zmq

from pdserve.worker.kv import side_channel, tcp_stream
from pdserve.worker.kv.auth import SideChannelAuth
from pdserve.worker.kv.prompt_binding import bind_token, prompt_digest
from tests.worker.data_port_flood import Flood
from tests.worker.kv_harness import kv_state, leaves_no_kv, metric, pd_pair, wait_clean
from tests.net import free_port
from tests.worker.test_server_harness import WorkerProcess

# Dispatched with the slow modules, before the quick ones (tests/conftest.py):
# a prefill/decode pair of worker processes per transport.
pytestmark = pytest.mark.slow

SECRET = "the-deployment's-kv-secret-0123456789"
AUTH, WRONG, NONE = SideChannelAuth(SECRET), SideChannelAuth("a-different-secret-0123456789"), SideChannelAuth(None)
KEY = "worker-api-key-for-the-router"
HEADERS = {"Authorization": f"Bearer {KEY}"}
ARGS = ("--max-model-len", "256", "--block-size", "4", "--kv-cache-memory", str(1 << 22), "--api-key", KEY,
        "--kv-peer-allow", "127.0.0.1")
PULL_TIMEOUT = 20  # long, so forged pulls to a silent peer are still waiting when the genuine one lands
A = list(range(1000, 1022))  # token-id prompts: 22 tokens, 6 blocks of 4
B = A[:-5] + [2001, 2002, 2003, 2004, 2005]  # same length, different content
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def pair(request, tiny_checkpoint):
    with pd_pair(tiny_checkpoint("llama"), request.param, ARGS, {"PDSERVE_KV_SECRET": SECRET},
                 pin_ttl=30, pull_timeout=PULL_TIMEOUT) as (p, d):
        yield request.param, p, d


@pytest.fixture
def clean(pair):
    with leaves_no_kv(pair[1:], timeout=PULL_TIMEOUT + 15):
        yield


def post(w: WorkerProcess, body: dict, headers=HEADERS) -> httpx.Response:
    return httpx.post(f"{w.url}/v1/completions", json=body, headers=headers, timeout=120)


def prefill(p: WorkerProcess, prompt: list[int]) -> dict:
    r = post(p, {"prompt": prompt, **GREEDY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 200, r.text
    return r.json()


def pd(p, d, prompt) -> tuple[str, httpx.Response]:
    first = prefill(p, prompt)
    rest = post(d, {"prompt": prompt, **GREEDY, "kv_transfer_params": first["kv_transfer_params"]})
    return first["choices"][0]["text"], rest


def assert_pd_pulls(p, d, prompt) -> None:
    """A genuine P/D request for `prompt` answers 200 by pulling: bytes moved, no local prefill."""
    fallbacks = metric(d, "pdserve_kv_local_prefill_fallbacks_total")
    pulled = metric(d, "pdserve_kv_transfer_bytes_total")
    _, rest = pd(p, d, prompt)
    assert rest.status_code == 200
    assert metric(d, "pdserve_kv_transfer_bytes_total") > pulled
    assert metric(d, "pdserve_kv_local_prefill_fallbacks_total") == fallbacks


def release(params: dict) -> None:
    side_channel.call(params["remote_host"], params["remote_port"], "release",
                      {"request_id": params["remote_request_id"], "token": params["transfer_token"]}, 5, AUTH,
                      params["remote_engine_id"])


def where(params: dict) -> tuple[str, int]:
    return params["remote_host"], params["remote_port"]


def test_side_channel_refuses_peers_without_the_secret(pair, clean):
    """describe/lease/read without the secret (or with another one) get nothing; with it,
    describe still gives only the layout: NIXL metadata travels only in a lease's reply."""
    transport, p, _ = pair
    params = prefill(p, A)["kv_transfer_params"]
    host, port = where(params)
    read = {"request_id": params["remote_request_id"], "token": params["transfer_token"], "indices": [0],
            "prompt_digest": prompt_digest(A)}
    for auth in (NONE, WRONG):
        for op, body in (("describe", {}), ("lease", read), ("read", read), ("release", read)):
            with pytest.raises(side_channel.SideChannelError, match="unauthenticated"):
                side_channel.call(host, port, op, body, 5, auth)
    desc, _ = side_channel.call(host, port, "describe", {}, 5, AUTH)
    assert set(desc) == {"engine_id", "kv_layout", "block_bytes", "transport"}  # no agent metadata, no address
    if transport == "nixl":
        engine = params["remote_engine_id"]
        lease, _ = side_channel.call(host, port, "lease", read, 5, AUTH, engine)
        assert "nixl" not in lease  # not asked for
        lease, _ = side_channel.call(host, port, "lease", {**read, "want_metadata": True}, 5, AUTH, engine)
        assert {"agent", "metadata", "base"} <= set(lease["nixl"])  # the one way to get it: secret + live token
    # A captured, correctly signed message cannot be replayed.
    raw, mac, _ = AUTH.sign_request("describe", {"to": side_channel.destination(None, host, port).to_body()})
    with zmq.Context.instance().socket(zmq.DEALER) as s:
        s.setsockopt(zmq.RCVTIMEO, 5000)
        s.connect(f"tcp://{host}:{port}")
        replies = []
        for _ in range(2):
            s.send_multipart([b"", b"describe", raw, mac])
            replies.append(s.recv_multipart()[1])
    assert replies == [b"ok", b"err"]
    release(params)


class Listener:
    """An attacker's ZMQ endpoint on an allowed host: keeps every message it is sent ([op, body,
    mac]) and answers each with an error, so the decode worker gives up at once."""

    def __init__(self, host: str = "127.0.0.1"):
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.received: list[list[bytes]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)  # the only user of the socket

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(50):
                ident, *parts = self.sock.recv_multipart()
                self.received.append(parts[1:])
                self.sock.send_multipart([ident, b"", b"err", b"not a KV peer", b""])

    def __enter__(self) -> "Listener":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def relay(host: str, port: int, message: list[bytes]) -> tuple[bytes, bytes]:
    """Send a captured [op, body, mac] unchanged to host:port; (status, payload) of its answer."""
    with zmq.Context.instance().socket(zmq.DEALER) as s:
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 5000)
        s.connect(f"tcp://{host}:{port}")
        s.send_multipart([b"", *message])
        reply = s.recv_multipart()
    return reply[1], reply[2]


def test_a_message_the_decode_worker_signed_for_another_peer_is_refused(pair, clean):
    """Issue 23 item 1, the attack itself. The attacker holds the worker API key (as the router
    and Prometheus do) but not the KV secret. It prefills a prompt, then hands the decode worker
    those params with the port changed to one it listens on (the host stays allowed) and the
    engine id changed (a new one: a NIXL decode worker then asks for the agent metadata) or
    kept. The decode worker signs a read (TCP) or lease (NIXL) and sends it there; relayed
    unchanged to the real prefill worker, it returned the KV bytes or the NIXL metadata of the
    whole cache. Now the signed body names the worker it is for, and the prefill worker refuses
    it, and any message signed for another host or port of it; the request itself is served
    (local prefill)."""
    transport, p, d = pair
    genuine = prefill(p, A)["kv_transfer_params"]
    host, port = where(genuine)
    with Listener() as attacker:
        for engine in (f"attacker-{secrets.token_hex(4)}", genuine["remote_engine_id"]):
            forged = {**genuine, "remote_port": attacker.port, "remote_engine_id": engine}
            seen = len(attacker.received)
            r = post(d, {"prompt": A, **GREEDY, "kv_transfer_params": forged})
            assert r.status_code == 200, r.text  # the pull failed: decode prefilled locally
            captured = attacker.received[seen:]
            assert any(m[0] == (b"read" if transport == "tcp" else b"lease") for m in captured), captured
            for message in captured:  # the pull, and the release that followed its failure
                status, payload = relay(host, port, message)
                assert status == b"err" and b"not for this worker" in payload, (message[0], status, payload[:200])
    # The same holds for messages signed by a secret holder for another host or port of this worker.
    engine = genuine["remote_engine_id"]
    body = {"request_id": genuine["remote_request_id"], "token": genuine["transfer_token"], "indices": [0],
            "prompt_digest": prompt_digest(A)}
    for to in (side_channel.destination(engine, "127.0.0.2", port), side_channel.destination(engine, host, port + 1),
               side_channel.destination("another-engine", host, port), None):
        raw, mac, _ = AUTH.sign_request("read", {**body, **({"to": to.to_body()} if to else {})})
        status, payload = relay(host, port, [b"read", raw, mac])
        assert status == b"err" and b"refused" in payload, payload
    # Nothing above touched the pin: addressed to this worker, the release finds it.
    reply, _ = side_channel.call(host, port, "release", {"request_id": genuine["remote_request_id"],
                                                         "token": genuine["transfer_token"]}, 5, AUTH, engine)
    assert reply == {"released": True}


def test_params_naming_an_allowed_host_on_another_port_are_refused(pair, tiny_checkpoint, clean):
    """Issue 23 item 1, the allowlist half: a decode worker allowed only the prefill worker's KV
    port (`--kv-peer-allow 127.0.0.1:PORT`, as `pdserve up` and the operator now pass) refuses
    params naming that host on another port (400, before any connection: the attacker's port is
    never contacted), and params whose TP size would make it contact PORT + 1; the genuine
    params still pull."""
    transport, p, _ = pair
    if transport != "tcp":
        pytest.skip("the allowlist is the same code for both transports")
    first = prefill(p, A)["kv_transfer_params"]
    host, port = where(first)
    release(first)  # only its address was wanted: the pin is made again once the decode worker is up
    with Listener() as attacker, WorkerProcess(
            tiny_checkpoint("llama"), *ARGS, "--role", "decode", "--kv-transfer", transport, "--kv-port",
            str(free_port()), "--kv-peer-allow", f"127.0.0.1:{port}", env={"PDSERVE_KV_SECRET": SECRET}) as d:
        # Pinned now, not before the worker started: on a loaded machine its start once outlasted
        # the pin's TTL, and the genuine pull below fell back to a local prefill.
        genuine = prefill(p, A)["kv_transfer_params"]
        for forged in ({**genuine, "remote_port": attacker.port}, {**genuine, "kv_tp_size": 2}):
            r = post(d, {"prompt": A, **GREEDY, "kv_transfer_params": forged})
            assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
            assert "--kv-peer-allow" in r.json()["error"]["message"] and "port" in r.json()["error"]["message"]
        assert metric(d, "pdserve_kv_transfer_failures_total") == 0
        r = post(d, {"prompt": A, **GREEDY, "kv_transfer_params": genuine})
        assert r.status_code == 200
        assert metric(d, "pdserve_kv_transfer_bytes_total") > 0
        assert metric(d, "pdserve_kv_local_prefill_fallbacks_total") == 0
    assert attacker.received == []


def test_decode_with_the_wrong_secret_cannot_pull(pair, tiny_checkpoint, clean):
    """A decode worker of another deployment (another secret) is refused; it prefills locally."""
    transport, p, _ = pair
    with WorkerProcess(tiny_checkpoint("llama"), *ARGS, "--role", "decode", "--kv-transfer", transport,
                       "--kv-port", str(free_port()), env={"PDSERVE_KV_SECRET": "another-deployment-secret"}) as other:
        plain = post(other, {"prompt": A, **GREEDY}).json()["choices"][0]["text"]
        first = prefill(p, A)
        rest = post(other, {"prompt": A, **GREEDY, "kv_transfer_params": first["kv_transfer_params"]})
        assert rest.status_code == 200
        assert first["choices"][0]["text"] + rest.json()["choices"][0]["text"] == plain
        assert metric(other, "pdserve_kv_local_prefill_fallbacks_total") == 1
        assert metric(other, "pdserve_kv_transfer_bytes_total") == 0
        assert kv_state(other)["num_free_blocks"] == kv_state(other)["num_total_blocks"]
        release(first["kv_transfer_params"])  # its own release was refused too: free the pin now, not at TTL


def test_nixl_read_without_metadata_is_impossible(pair, clean):
    """What this proves: a NIXL agent that did not get the prefill agent's metadata cannot even
    build a READ towards it (NIXL needs the remote agent loaded from that metadata), and the
    metadata is not to be had without the secret (previous test). It does not prove UCX would
    refuse a peer that *has* the metadata: that residual risk is in docs/security.md."""
    transport, p, _ = pair
    if transport != "nixl":
        pytest.skip("NIXL only")
    import torch

    from pdserve.worker.kv.nixl_transport import import_nixl

    params = prefill(p, A)["kv_transfer_params"]
    nixl_agent, nixl_agent_config = import_nixl()
    attacker = nixl_agent("attacker", nixl_agent_config(enable_listen_thread=False, backends=["UCX"]))
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    attacker.register_memory(buf)
    prefill_agent = f"pdserve-{params['remote_engine_id']}"  # the name is guessable; the metadata is not
    local = attacker.get_xfer_descs([(buf.data_ptr(), 4096, 0)], "DRAM")
    remote = attacker.get_xfer_descs([(0x7f0000000000, 4096, 0)], "DRAM")  # a guessed address
    with pytest.raises(Exception) as refused:
        attacker.initialize_xfer("READ", local, remote, prefill_agent)
    assert type(refused.value).__name__ == "nixlNotFoundError"  # "metadata for remote agent ... not found"
    release(params)


def test_forged_params_to_a_silent_peer_do_not_stall_other_pulls(pair, clean):
    """Forged params naming an allowed host that never answers: at most --kv-max-pulls-per-peer
    (4) pulls ever reach it, the rest fail fast once it timed out, and a genuine P/D request
    pulls (no local fallback) while the forged ones are still waiting."""
    _, p, d = pair
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # accepts connections, never answers
    silent_port = silent.bind_to_random_port("tcp://127.0.0.1")
    received = []
    stop = threading.Event()

    def sink():
        while not stop.is_set():
            if silent.poll(50):
                received.append(silent.recv_multipart())

    sinker = threading.Thread(target=sink, daemon=True)
    sinker.start()
    try:
        genuine = prefill(p, A)["kv_transfer_params"]
        forged = {**genuine, "remote_port": silent_port}
        fallbacks = metric(d, "pdserve_kv_local_prefill_fallbacks_total")
        with ThreadPoolExecutor(12) as pool:
            attacks = [pool.submit(post, d, {"prompt": A, **GREEDY, "kv_transfer_params": forged})
                       for _ in range(12)]
            deadline = time.monotonic() + 60
            while len(received) < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(received) == 4  # the per-peer bound: 4 pulls in flight, 8 waiting in its queue
            pulled = metric(d, "pdserve_kv_transfer_bytes_total")
            rest = post(d, {"prompt": A, **GREEDY, "kv_transfer_params": genuine})
            assert rest.status_code == 200
            assert not any(a.done() for a in attacks)  # still waiting on the silent peer
            assert metric(d, "pdserve_kv_transfer_bytes_total") > pulled  # really pulled
            assert metric(d, "pdserve_kv_local_prefill_fallbacks_total") == fallbacks
            results = [a.result() for a in attacks]
        assert all(r.status_code == 200 for r in results)  # each prefilled locally in the end
        assert len(received) == 4  # after the first timeout the queued 8 failed without connecting
    finally:
        stop.set()
        sinker.join(5)
        silent.close()


def test_params_for_another_prompt_are_refused_and_do_not_poison_the_cache(pair, clean):
    """Prompt B with prompt A's params (same length): 400. With the token's digest forged to
    B's, the prefill side refuses the pull (its pin holds A's digest) and decode computes B
    itself. Afterwards both prompts get the single-worker answers from decode's cache."""
    _, p, d = pair
    expect = {name: post(p, {"prompt": prompt, **GREEDY}).json()["choices"][0]["text"]
              for name, prompt in (("A", A), ("B", B))}  # the prefill worker never saw a forged pull
    assert expect["A"] != expect["B"]  # else a poisoned cache could not show
    params = prefill(p, A)["kv_transfer_params"]
    r = post(d, {"prompt": B, **GREEDY, "kv_transfer_params": params})
    assert r.status_code == 400 and "different prompt" in r.json()["error"]["message"]
    fallbacks = metric(d, "pdserve_kv_local_prefill_fallbacks_total")
    random_part = params["transfer_token"].rpartition(".")[0]
    forged = {**params, "transfer_token": bind_token(random_part, prompt_digest(B))}
    r = post(d, {"prompt": B, **GREEDY, "kv_transfer_params": forged})
    assert r.status_code == 200
    assert metric(d, "pdserve_kv_local_prefill_fallbacks_total") == fallbacks + 1  # the pull was refused
    # Clean path now: decode serves both from its own (prefix-cached) KV.
    for name, prompt in (("B", B), ("A", A)):
        out = post(d, {"prompt": prompt, **GREEDY}).json()
        assert out["choices"][0]["text"] == expect[name], name
    assert post(d, {"prompt": B, **GREEDY}).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    release(params)


def _raw_messages(host: str, port: int) -> None:
    ctx = zmq.Context.instance()
    valid_raw, valid_mac, _ = AUTH.sign_request("read", {"request_id": 5, "token": [], "indices": "x"})
    odd_raw, odd_mac, _ = AUTH.sign_request("lease", {"request_id": "r", "token": "t", "indices": [10**30]})
    messages = [
        [b"x"], [b"", b"describe"], [b"", b"describe", b"{}"],  # 1, 2, 3 frames (the old killer: 3)
        [b""] + [b"f%d" % i for i in range(9)],  # 10 frames
        [b"", b"read", b"\xff\xfe not json", b"mac"], [b"", b"\x00" * 300, b"[]", b""],
        [b"", b"describe", b"[1, 2]", b""], [b"", b"describe", b"null", AUTH.sign_request("x", {})[1]],
        [b"", b"read", valid_raw, valid_mac], [b"", b"lease", odd_raw, odd_mac],  # signed, but nonsense fields
        [b"", b"describe", b"{" * 100_000, b""],  # over MAXMSGSIZE: libzmq drops the connection
    ]
    for msg in messages:
        with ctx.socket(zmq.DEALER) as s:
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://{host}:{port}")
            s.send_multipart(msg)
            s.poll(500)
    with socket.create_connection((host, port), timeout=5) as raw:  # not ZMTP at all
        raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)) * 40)
    with ctx.socket(zmq.REQ) as s:  # another ZMQ socket type
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://{host}:{port}")
        s.send(b"hello")


def test_malformed_messages_do_not_kill_the_side_channel(pair, clean):
    _, p, d = pair
    plain = post(d, {"prompt": B, **GREEDY}).json()["choices"][0]["text"]
    fallbacks = metric(d, "pdserve_kv_local_prefill_fallbacks_total")
    params = prefill(p, A)["kv_transfer_params"]
    _raw_messages(*where(params))
    desc, _ = side_channel.call(*where(params), "describe", {}, 5, AUTH)
    assert desc["engine_id"] == params["remote_engine_id"]
    release(params)
    assert httpx.get(f"{p.url}/health").status_code == 200
    first, rest = pd(p, d, B)  # P/D still pulls
    assert rest.status_code == 200 and first + rest.json()["choices"][0]["text"] == plain
    assert metric(d, "pdserve_kv_local_prefill_fallbacks_total") == fallbacks


def test_slow_readers_do_not_stall_other_peers(pair, clean):
    """Peers that send reads and describes by the thousand and never read a reply (one with a
    tiny receive buffer, one raw TCP connection that never speaks) leave the channel free: a
    genuine P/D pull goes through meanwhile, without local fallback."""
    _, p, d = pair
    ctx = zmq.Context.instance()
    pins = [prefill(p, A)["kv_transfer_params"] for _ in range(3)]
    host, port = where(pins[0])
    slow = ctx.socket(zmq.DEALER)
    slow.setsockopt(zmq.LINGER, 0)
    slow.setsockopt(zmq.RCVBUF, 4096)
    slow.setsockopt(zmq.RCVHWM, 1)
    slow.connect(f"tcp://{host}:{port}")
    stalled = socket.create_connection((host, port), timeout=5)
    try:
        for params in pins:
            raw, mac, _ = AUTH.sign_request("read", {"request_id": params["remote_request_id"], "indices": [0, 1, 2],
                                                     "token": params["transfer_token"],
                                                     "prompt_digest": prompt_digest(A),
                                                     "to": side_channel.destination(params["remote_engine_id"], host,
                                                                                    port).to_body()})
            slow.send_multipart([b"", b"read", raw, mac])
        for _ in range(3000):
            raw, mac, _ = AUTH.sign_request("describe", {"to": side_channel.destination(None, host, port).to_body()})
            slow.send_multipart([b"", b"describe", raw, mac])
        assert_pd_pulls(p, d, B)
        for params in pins:  # reads refused as "busy" (two replies to this address unsent) kept theirs
            release(params)
        # Nothing stays leased for the unread replies: they are copies, so every pin frees now, not at TTL.
        assert wait_clean(p, {"num_free_blocks": kv_state(p)["num_total_blocks"]}, timeout=10)["num_pinned_blocks"] == 0
    finally:
        slow.close()
        stalled.close()


def data_port(p: WorkerProcess) -> int:
    """The prefill worker's TCP data port (it opens with the first data read, and only a grant
    names it): a signed read of a pin of our own, its one stream drained (the read is the release)."""
    params = prefill(p, A)["kv_transfer_params"]
    host, port = where(params)
    read = {"request_id": params["remote_request_id"], "token": params["transfer_token"], "indices": [0],
            "prompt_digest": prompt_digest(A), "data": True, "streams": 1}
    grant, _ = side_channel.call(host, port, "read", read, 5, AUTH, params["remote_engine_id"])
    plan = tcp_stream.Plan(*(grant[k] for k in ("nblocks", "block_bytes", "chunk_blocks", "streams")))
    tcp_stream.receive(host, grant["data_port"], bytes.fromhex(grant["ticket"]), plan, [0],
                       torch.zeros(1, plan.block_bytes, dtype=torch.uint8), time.monotonic() + 10, AUTH)
    return grant["data_port"]


def test_connections_trickling_to_the_data_port_do_not_keep_pulls_out(pair, clean):
    """Issue 44: 80 connections from 10 addresses, no credentials, each trickling a hello to the
    prefill worker's TCP data port a byte every 0.5 s (whole in 30 s). They hold only handshake
    slots (64; 16 displaced at once), never the streams pulls need: a genuine P/D request pulls
    meanwhile (bytes moved, no local prefill), and each trickler is closed by its whole-hello
    deadline (5 s). Before, they held all 64 connection slots for 30 s and every pull fell back."""
    transport, p, d = pair
    if transport != "tcp":
        pytest.skip("the data port carries TCP pulls (a NIXL decode worker READs over UCX)")
    with Flood("127.0.0.1", data_port(p), addresses=10, per_address=8, trickle_s=0.5) as flood:
        assert flood.wait_closed(16)
        assert_pd_pulls(p, d, B)
        assert flood.wait_closed(80, timeout=20)


def test_keyed_decode_worker_refuses_remote_params_without_the_key(pair, clean):
    """The worker half of "decode accepts remote params only from an authenticated router":
    with --api-key, a request carrying kv_transfer_params needs the key (the router forwards it)."""
    _, p, d = pair
    params = prefill(p, A)["kv_transfer_params"]
    r = post(d, {"prompt": A, **GREEDY, "kv_transfer_params": params}, headers={})
    assert r.status_code == 401
    r = post(d, {"prompt": A, **GREEDY, "kv_transfer_params": params})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == GREEDY["max_tokens"]


def test_health_is_503_once_the_side_channel_thread_is_gone(tiny_checkpoint):
    """In process (real uvicorn socket, real engine and side channel): the thread survives
    every message (tests above), so the test stops it from inside, as a bug would. The
    worker's /health, which the router polls and Kubernetes probes, then answers 503."""
    import uvicorn

    from pdserve.worker.config.engine import EngineConfig
    from pdserve.worker.engine.async_engine import AsyncEngine
    from pdserve.worker.server.app import build_app
    from pdserve.worker.server.config import ServerConfig

    cfg = EngineConfig(model=str(tiny_checkpoint("llama")), device="cpu", max_model_len=64, kv_cache_memory=8 << 20,
                       role="prefill", kv_transfer="tcp", kv_port=free_port(), kv_secret=SECRET)
    port = free_port()
    app = build_app(ServerConfig(host="127.0.0.1", port=port), "p", lambda: AsyncEngine.from_config(cfg))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert httpx.get(f"{url}/health").status_code == 200
        desc, _ = side_channel.call("127.0.0.1", cfg.kv_port, "describe", {}, 5, AUTH)  # it serves
        app.state.worker.engine.engine.kv_connector.server.stop()
        r = httpx.get(f"{url}/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    finally:
        server.should_exit = True
        thread.join(60)
