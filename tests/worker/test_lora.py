"""LoRA adapters (worker/lora/): PEFT checkpoints written by peft itself over a tiny Llama, held
to transformers + PEFT merged (fp32 greedy), alone and batched with the base model and other
adapters; more adapters than GPU slots and host-cache entries (swaps, re-reads); the prefix
cache never shared across adapters; refused adapters named and never half-loaded; the server's
model names, /v1/models and runtime endpoints; a P/D hand-off over TCP under an adapter."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.protocol.flags import ConfigError
from pdserve.worker.engine.block_manager import hash_prefix_blocks, lora_hash_root
from pdserve.worker.lora.adapter import LoRAError
from pdserve.worker.lora.layer import LoRAOps, segments_of
from pdserve.worker.config.lora_modules import LoRAModule, parse_lora_module
from pdserve.worker.request.request import RequestError
from pdserve.worker.request.sampling_params import SamplingParams
from tests.helpers.engines import ON_GPU, device_engine, engine_config, make_engine
from tests.lora_checkpoints import merged_greedy, write_adapter
from tests.net import free_port

PROMPTS = [[5, 17, 300, 42, 9, 1000, 77], list(range(100, 123)), [3, 4, 5]]
MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    """The base checkpoint and three adapters: every projection (rank 8); q/v/down only with
    rsLoRA (rank 4); every projection again (rank 16, the slots' full width)."""
    base = tiny_checkpoint("llama")
    d = tmp_path_factory.mktemp("lora")
    return base, {
        "a": write_adapter(d / "a", base, seed=1),
        "b": write_adapter(d / "b", base, seed=2, r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                           use_rslora=True),
        "c": write_adapter(d / "c", base, seed=3, r=16, alpha=16),
    }


@pytest.fixture(scope="module")
def engine(adapters):
    """Two GPU slots and two host-cache entries for three adapters; decodes through the CUDA
    graphs' static buffers (not captured on the CPU) so the graphs' slot row is exercised."""
    base, paths = adapters
    return make_engine(base, static_decode=True, enable_lora=True, max_loras=2, max_cpu_loras=2,
                       lora_modules=tuple(f"{n}={p}" for n, p in paths.items()))


def expected(adapters, name, prompt) -> list[int]:
    base, paths = adapters
    return merged_greedy(str(base), None if name is None else str(paths[name]), tuple(prompt), MAX_NEW)


def test_adapters_alone_and_mixed_with_the_base_equal_peft_merged(adapters, engine):
    names = [None, "a", "b", "c"]
    want = {(n, i): expected(adapters, n, p) for n in names for i, p in enumerate(PROMPTS)}
    for i in range(len(PROMPTS)):  # each adapter changes the answer: the comparison means something
        assert len({tuple(want[(n, i)]) for n in names}) == len(names)
    assert engine.generate([PROMPTS[0]], GREEDY, ["b"]) == [want[("b", 0)]]  # alone
    # One batch of all: three adapters for two slots (the third waits for one, then swaps in),
    # three for two host-cache entries (one is read from disk again).
    order = [(n, i) for i in range(len(PROMPTS)) for n in names]
    got = engine.generate([PROMPTS[i] for _, i in order], GREEDY, [n for n, _ in order])
    assert dict(zip(order, got)) == want
    assert engine.lora.num_swaps >= 3
    s = engine.stats()
    assert s.num_free_blocks == s.num_total_blocks


def test_the_prefix_cache_is_never_shared_across_adapters(engine):
    prompt = list(range(400, 421))  # 5 full blocks of 4
    bm = engine.block_manager
    events = []
    bm.on_event, real = (lambda *a, **k: events.append((a, k))), bm.on_event
    try:
        def hits(name) -> int:
            before = bm.prefix_hits
            engine.generate([prompt], GREEDY, [name])
            return bm.prefix_hits - before

        assert hits(None) == 0
        assert hits("a") == 0  # the base's blocks are not a's
        assert hits("a") == 20  # a's own are
        assert hits("b") == 0
        assert hits(None) == 20
        engine.add_request("running", prompt[:9], GREEDY, lora_name="a")
        engine.step()
        assert engine.scheduler.lora_adapters == (["a"], [])  # what vllm:lora_requests_info reports
        while engine.has_work():
            engine.step()
    finally:
        bm.on_event = real
    stored = [(a, k) for a, k in events if a[0] == "BlockStored"]
    a_stored = [(a, k) for a, k in stored if k.get("lora_name") == "a"]
    assert a_stored and all("lora_name" not in k for a, k in stored if a[2] is None)
    (first, _), = [(a, k) for a, k in a_stored if a[1][0] == hash_prefix_blocks(prompt, 4, lora_hash_root("a"))[0]]
    assert first[2] == lora_hash_root("a")  # a prompt's first block: the adapter's root, not null
    assert lora_hash_root("a") != lora_hash_root("b") != lora_hash_root(None)


def _copy(src, dst, config=None, tensors=None):
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **(config or {})}))
    weights = load_file(src / "adapter_model.safetensors")
    save_file(tensors(weights) if tensors else weights, dst / "adapter_model.safetensors")
    return dst


def test_bad_adapters_are_refused_by_name_and_nothing_is_loaded(adapters, engine, tmp_path):
    _, paths = adapters
    a = paths["a"]
    q = next(k for k in load_file(a / "adapter_model.safetensors") if "layers.0.self_attn.q_proj.lora_A" in k)
    bad = {
        "too-wide": (_copy(a, tmp_path / "r", config={"r": 32}), "rank 32 exceeds --max-lora-rank 16"),
        "no-files": ((tmp_path / "empty").mkdir() or tmp_path / "empty", "adapter_config.json is missing"),
        "no-weights": (_copy(a, tmp_path / "nw"), "adapter_model.safetensors is missing"),
        "deep": (_copy(a, tmp_path / "deep", tensors=lambda w: {k.replace("layers.1.", "layers.7."): v
                                                                 for k, v in w.items()}),
                 "which the model lacks"),
        "other-base": (_copy(a, tmp_path / "wide", tensors=lambda w: {**w, q: torch.zeros(8, 32)}),
                       "maps 32 -> 64 features but the model.s maps 64 -> 64"),
        "embeddings": (_copy(a, tmp_path / "emb", tensors=lambda w: {
            **w, "base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(8, 64)}), "adapts nothing"),
    }
    (tmp_path / "nw" / "adapter_model.safetensors").unlink()
    slots_before = engine.lora.loaded_in_slots()
    for name, (path, why) in bad.items():
        with pytest.raises(LoRAError, match=why) as e:
            engine.lora.add(LoRAModule(name, str(path)))
        assert repr(name) in str(e.value)
        assert not engine.lora.serves(name) and name not in engine.lora._host
    assert engine.lora.loaded_in_slots() == slots_before
    with pytest.raises(LoRAError, match="'a' is already loaded"):
        engine.lora.add(LoRAModule("a", str(a)))
    # At start: the worker does not come up with an adapter it could not serve, and says which.
    with pytest.raises(LoRAError, match="'too-wide'.*rank 32"):
        make_engine(adapters[0], enable_lora=True, lora_modules=(f"too-wide={bad['too-wide'][0]}",))


def test_flags_as_vllm_writes_them(adapters):
    import argparse

    from pdserve.worker.server.main import add_arguments, configs_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}',
                              "--lora-modules", "c=/z", "--max-loras", "3", "--max-lora-rank", "64",
                              "--max-cpu-loras", "5"])
    cfg, _ = configs_from_args(args, environ={})
    assert cfg.enable_lora and (cfg.max_loras, cfg.max_lora_rank, cfg.cpu_loras) == (3, 64, 5)
    assert cfg.lora_modules == ("a=/x", '{"name": "b", "path": "/y"}', "c=/z")
    assert parse_lora_module('{"name": "x", "path": "/p", "base_model_name": "m"}') == LoRAModule("x", "/p", "m")
    for bad in ("x", "=p", '{"name": 1}', "{not json"):
        with pytest.raises(ValueError):
            parse_lora_module(bad)
    base = adapters[0]
    with pytest.raises(ConfigError, match="--lora-modules: needs --enable-lora"):
        engine_config(base, lora_modules=("a=/p",))
    with pytest.raises(ConfigError, match="--lora-modules: adapter name 'a' given twice"):
        engine_config(base, enable_lora=True, lora_modules=("a=/p", "a=/q"))
    with pytest.raises(ConfigError, match="adapter name 'tiny' is the base model's"):
        engine_config(base, enable_lora=True, served_model_name="tiny", lora_modules=("tiny=/p",))
    with pytest.raises(ConfigError, match="--max-cpu-loras"):
        engine_config(base, enable_lora=True, max_loras=4, max_cpu_loras=2)


def test_the_server_serves_lists_loads_and_unloads_adapters(adapters, monkeypatch):
    """In process: model=<adapter> runs it (its tokens are the merged model's), /v1/models lists
    it with the base as parent, an unknown name is 404; with $VLLM_ALLOW_RUNTIME_LORA_UPDATING
    an adapter is loaded (bad ones 400, nothing registered) and unloaded at runtime."""
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from pdserve.worker.engine.async_engine import AsyncEngine
    from pdserve.worker.server.app import build_app
    from pdserve.worker.server.config import ServerConfig

    base, paths = adapters
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
    cfg = engine_config(base, enable_lora=True, lora_modules=(f"a={paths['a']}",))
    app = build_app(ServerConfig(), "tiny", lambda: AsyncEngine.from_config(cfg))
    prompt = PROMPTS[0]
    tokenizer = AutoTokenizer.from_pretrained(base)

    def complete(c, model):
        return c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": MAX_NEW,
                                               "temperature": 0, "ignore_eos": True})

    def text(name) -> str:
        return tokenizer.decode(expected(adapters, name, prompt))

    with TestClient(app) as c:
        deadline = time.monotonic() + 120
        while c.get("/health").status_code != 200:  # the engine loads on a thread
            assert time.monotonic() < deadline, "the engine did not load"
            time.sleep(0.05)
        models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert set(models) == {"tiny", "a"} and models["a"]["parent"] == "tiny" and "parent" not in models["tiny"]
        assert models["a"]["root"] == str(paths["a"]) and c.get("/v1/models/a").json()["parent"] == "tiny"
        r = complete(c, "a")
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "a"
        assert r.json()["choices"][0]["text"] == text("a") != text(None)
        assert complete(c, "tiny").json()["choices"][0]["text"] == text(None)
        r = complete(c, "b")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

        r = c.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(paths["b"])})
        assert r.status_code == 200, r.text
        assert complete(c, "b").json()["choices"][0]["text"] == text("b")
        assert "b" in {m["id"] for m in c.get("/v1/models").json()["data"]}
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": str(paths["a"] / "nowhere")})
        assert r.status_code == 400 and "'z'" in r.json()["error"]["message"]
        assert complete(c, "z").status_code == 404
        assert c.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(paths["b"])}).status_code == 400
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
        assert complete(c, "b").status_code == 404
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 404
        info = [line for line in c.get("/metrics").text.splitlines() if line.startswith("vllm:lora_requests_info{")]
        assert len(info) == 1 and 'max_lora="1"' in info[0] and 'running_lora_adapters=""' in info[0]
    # Off by default, as vLLM: the routes do not exist.
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    plain = TestClient(build_app(ServerConfig(), "tiny", lambda: AsyncEngine.from_config(cfg)))
    assert plain.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "/x"}).status_code == 404


def test_pd_over_tcp_under_an_adapter_equals_the_merged_model(adapters):
    """The prefill runs adapter a and names it in the hand-off; the decode worker runs a too
    (its tokens the merged model's); a request for another adapter (or the base) with those
    params is refused, and so is one on a decode worker that does not serve a."""
    base, paths = adapters
    pd = dict(kv_peer_allow=("127.0.0.1",), kv_secret="lora-pd-test-secret", enable_lora=True)
    p = make_engine(base, role="prefill", kv_transfer="tcp", kv_port=free_port(), **pd,
                    lora_modules=(f"a={paths['a']}",))
    d = make_engine(base, role="decode", kv_transfer="tcp", kv_port=free_port(), **pd,
                    lora_modules=(f"a={paths['a']}", f"b={paths['b']}"))
    try:
        prompt = PROMPTS[1]
        p.add_request("p", prompt, GREEDY, {"do_remote_decode": True}, lora_name="a")
        params = None
        while params is None:
            params = next((o.kv_transfer_params for o in p.step() if o.finished), None)
        assert params.lora_name == "a" and params.to_dict()["lora_name"] == "a"
        for wrong in ("b", None):
            with pytest.raises(RequestError, match="the prefill ran a"):
                d.add_request(f"wrong-{wrong}", prompt, GREEDY, params, lora_name=wrong)
        d.add_request("d", prompt, GREEDY, params, lora_name="a")
        out, deadline = [params.first_token_id], time.monotonic() + 60
        while len(out) < MAX_NEW:
            assert time.monotonic() < deadline, "decode did not finish"
            for o in d.step():
                out += o.new_token_ids
            p.step()  # frees the pin once the decode side released it
        assert out == expected(adapters, "a", prompt)
        assert d.kv_connector.metrics.bytes.labels("recv", "tcp")._value.get() > 0  # pulled, not recomputed
    finally:
        p.shutdown()
        d.shutdown()
    plain = make_engine(base)
    with pytest.raises(RequestError, match="'a' is not loaded"):
        plain.add_request("x", prompt, GREEDY, lora_name="a")


def test_tensor_parallel_shards_adapters_like_their_layers(adapters):
    """TP=2 (gloo, two processes): the adapters' matrices sharded with their base layers (the
    row-parallel ones summed by the layer's own all-reduce); a batch of the base and two adapters
    equals the merged models, with a swap (two adapters, one slot) carried to the other rank."""
    base, paths = adapters
    engine = make_engine(base, tensor_parallel_size=2, enable_lora=True, max_loras=1,
                         lora_modules=(f"a={paths['a']}", f"b={paths['b']}"))
    try:
        names = [None, "a", "b", None]
        prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
        got = engine.generate(prompts, GREEDY, names)
        assert got == [expected(adapters, n, p) for n, p in zip(names, prompts)]
        assert engine.lora.num_swaps == 2
    finally:
        engine.shutdown()


@pytest.mark.skipif(not ON_GPU, reason="tier 4: under the interpreter this takes ~30 s of CI's CPU; the kernels "
                                        "are held to their references in tests/kernels/test_lora.py")
@pytest.mark.parametrize("fork_shrink", [False, True])
def test_triton_kernels_in_the_model_and_decode_graphs(adapters, fork_shrink, monkeypatch):
    """The Triton backend, compiled, decode steps replayed from captured CUDA graphs, runs the
    shrink/expand kernels (the prefill's 23-token runs by segment, SGMV; the decodes by token,
    BGMV): the base and an adapter in one batch still equal the merged models; also with the
    shrinks forked onto a second stream (PDSERVE_LORA_FORK_SHRINK: branches of the graphs)."""
    from pdserve.worker.lora import layer

    monkeypatch.setattr(layer, "FORK_SHRINK", fork_shrink)
    base, paths = adapters
    engine = device_engine(base, attention_backend="triton", static_decode=True, enable_lora=True,
                           lora_modules=(f"a={paths['a']}",), max_num_seqs=4)
    prompts, names = [PROMPTS[1], PROMPTS[1]], [None, "a"]
    few = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    got = engine.generate(prompts, few, names)
    assert got == [expected(adapters, n, p)[:4] for n, p in zip(names, prompts)]
    assert engine.runner.graphs.num_replays > 0
    # The base model alone replays the graphs captured without LoRA (its GEMV paths back on).
    assert engine.generate([PROMPTS[1]], few, [None]) == [expected(adapters, None, PROMPTS[1])[:4]]
    assert engine.runner.graphs.num_base_replays > 0
    assert (engine.lora.ctx.side is not None) == fork_shrink


def test_prefills_run_by_segment_and_decodes_by_token(adapters, engine):
    """Runs of one adapter long enough for a row tile take SGMV, decodes of alternating adapters
    BGMV; both in one generation still equal PEFT merged (the CPU path: the torch references).
    A step of base-model tokens only, eager or a decode graph's, launches no LoRA kernel."""
    assert segments_of([0] * 10 + [-1] * 6 + [1] * 9) == ([0, 10, 16, 25], [0, -1, 1], 10)
    assert segments_of([0, 1, 0, 1]) is None and segments_of([]) is None
    # q | k | v and gate | up are packed: one shrink and one expand each, 8 launches a decoder layer.
    assert [[p.module for p in lin.parts] for lin in engine.lora.layers[:4]] == [
        ["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]]
    assert engine.lora.layers[0].ends is not None and engine.lora.layers[1].ends is None
    ops = engine.lora.layers[0].ops
    calls = Counter()

    def counted(name):
        real = getattr(ops, name)
        return lambda *args: (calls.update([name]), real(*args))[1]

    spy = LoRAOps(*(counted(n) for n in ("shrink", "expand", "shrink_sgmv", "expand_sgmv")))
    for layer in engine.lora.layers:
        layer.ops = spy
    prompt = list(range(700, 723))  # in no test's prefix cache: the whole prompt is prefilled
    try:
        got = engine.generate([prompt, prompt], GREEDY, ["a", "c"])
        assert calls["shrink_sgmv"] == calls["expand_sgmv"] > 0 and calls["shrink"] == calls["expand"] > 0
        calls.clear()
        engine.add_request("base-only", list(range(800, 823)), GREEDY)
        engine.step()  # its prefill: no token runs an adapter, no LoRA kernel is launched
        assert not calls
        base_replays = engine.runner.graphs.num_base_replays
        while engine.has_work():
            engine.step()
        # Its decodes: the graphs' base-model set (LoRAContext.base_model), no LoRA kernel either.
        assert not calls and engine.runner.graphs.num_base_replays > base_replays
    finally:
        for layer in engine.lora.layers:
            layer.ops = ops
    assert got == [expected(adapters, "a", prompt), expected(adapters, "c", prompt)]


def test_on_demand_loads_share_one_read_and_fail_by_name(adapters, engine, tmp_path):
    """What a decode worker does with a hand-off's adapter it lacks (worker/lora/on_demand.py):
    concurrent hand-offs of one adapter read it once; a path that holds none is the adapter's
    error, nothing registered."""
    from pdserve.worker.lora.on_demand import OnDemandLoads

    _, paths = adapters
    loads = OnDemandLoads(engine.lora)

    async def main():
        await asyncio.gather(*(loads.ensure("a2", str(paths["a"])) for _ in range(4)))
        with pytest.raises(LoRAError, match="'missing'"):
            await loads.ensure("missing", str(tmp_path / "none"))

    asyncio.run(main())
    try:
        assert loads.num_loaded == 1 and engine.lora.serves("a2") and not engine.lora.serves("missing")
        assert engine.lora.path_of("a2") == str(paths["a"].resolve())
        assert engine.generate([PROMPTS[0]], GREEDY, ["a2"]) == [expected(adapters, "a", PROMPTS[0])]
    finally:
        engine.lora.remove("a2")


def test_unloading_an_adapter_in_use_lets_its_running_request_finish(adapters, engine):
    _, paths = adapters
    prompt = PROMPTS[1]
    engine.add_request("in-use", prompt, GREEDY, lora_name="b")
    out = [t for o in engine.step() for t in o.new_token_ids]
    engine.lora.remove("b")
    with pytest.raises(RequestError, match="'b' is not loaded"):
        engine.add_request("late", prompt, GREEDY, lora_name="b")
    while engine.has_work():
        out += [t for o in engine.step() for t in o.new_token_ids]
    assert out == expected(adapters, "b", prompt)
    engine.lora.add(LoRAModule("b", str(paths["b"])))  # the module's engine as it was
