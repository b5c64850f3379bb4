"""Tensor parallelism on CPU over gloo: TP=2 greedy output equals TP=1 token for token (fp32),
in process and through a real `pdserve worker --tensor-parallel-size 2`; a dead rank ends the
worker with a clear log line; no rank outlives the worker."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import signal
import time

import openai
import pytest
from transformers import AutoTokenizer

from pdserve.worker.config.engine import ConfigError, EngineConfig
from pdserve.worker.config.model import ModelConfig
from pdserve.worker.engine.llm_engine import LLMEngine
from pdserve.worker.parallel.shard import TPShard
from pdserve.worker.request.sampling_params import SamplingParams
from tests.checkpoints import write_checkpoint
from tests.helpers.engines import make_engine
from tests.worker.test_server_harness import WorkerProcess

# Dispatched with the slow modules, before the quick ones (tests/conftest.py): TP=2 engines start gloo rank processes.
pytestmark = pytest.mark.slow

PROMPTS = [
    [5, 17, 300, 42, 9, 1000, 77],
    list(range(100, 137)),  # several blocks
    [3, 4],
    [900 + 7 * i for i in range(19)],
]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, default_model_dir):
    """(arch, KV heads) -> a tiny checkpoint with 4 query heads. One KV head at TP=2 means each
    rank holds a replica of it (N > KV heads)."""
    made = {}

    def make(arch: str, kv_heads: int):
        if (arch, kv_heads) not in made:
            out = tmp_path_factory.mktemp(f"ckpt-{arch}-kv{kv_heads}")
            made[arch, kv_heads] = write_checkpoint(out, arch, default_model_dir, num_key_value_heads=kv_heads)
        return made[arch, kv_heads]

    return make


def generate(ckpt, tp: int, static_decode: bool | None = None, **kw) -> list[list[int]]:
    engine = make_engine(ckpt, static_decode=static_decode, **{"tensor_parallel_size": tp, **kw})
    try:
        return engine.generate(PROMPTS, GREEDY)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("arch,kv_heads,static_decode", [
    ("llama", 2, None),  # one KV head per rank
    ("qwen2", 1, None),  # q/k/v bias, tied (vocab-parallel) embeddings, the KV head replicated on both ranks
    ("qwen3", 2, True),  # per-head q/k norms; decode steps through the graphs' static-buffer plan
])
def test_tp2_greedy_equals_tp1(checkpoint, arch, kv_heads, static_decode):
    ckpt = checkpoint(arch, kv_heads)
    ref = generate(ckpt, 1)
    assert generate(ckpt, 2, static_decode) == ref


@pytest.mark.parametrize("static_decode", [None, True], ids=["eager", "graph-plan"])
def test_tp2_with_async_scheduling_equals_tp1(checkpoint, static_decode):
    # Rank 0 broadcasts each step's sampled ids on the device; the other ranks' next step reads
    # them, as rank 0's does, without any host knowing them (StepPlan.share_tokens).
    ckpt = checkpoint("llama", 2)
    engine = make_engine(ckpt, static_decode=static_decode, tensor_parallel_size=2, async_scheduling=True)
    try:
        assert engine.async_scheduling and engine.runner.share_sampled
        seeded = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
        got = engine.generate(PROMPTS, GREEDY) + engine.generate(PROMPTS[:2], seeded)
        assert engine.num_overlapped_steps > 0  # steps were launched with tokens still on the device
    finally:
        engine.shutdown()
    ref_engine = make_engine(ckpt)
    try:
        ref = ref_engine.generate(PROMPTS, GREEDY) + ref_engine.generate(PROMPTS[:2], seeded)
    finally:
        ref_engine.shutdown()
    assert got == ref


@pytest.mark.parametrize("arch,ep", [
    ("qwen3-moe", False),  # every expert's I columns split, as a dense MLP (one layer dense)
    ("qwen3-moe", True),  # 4 whole experts per rank, the all-reduce combines
    ("qwen2-moe", True),  # experts whole per rank, the shared expert split: one all-reduce for both
    # gpt-oss: the sinks split with the heads, o_proj's bias and the experts' down bias added once
    # (rank 0) when I is split, by each expert's rank when experts are whole; interleaved gate|up
    # sliced per rank from the checkpoint
    ("gpt-oss", False),
    ("gpt-oss", True),
    # DeepSeek-V3: query and kv_b up-projections split by heads, o_proj by its columns, the latent
    # (and its cache) whole on each rank; routed experts whole per rank, shared experts split
    ("deepseek-v3", True),
])
def test_moe_tp2_with_and_without_expert_parallel_equals_tp1(checkpoint, arch, ep):
    ckpt = checkpoint(arch, 4 if arch.startswith("deepseek") else 2)
    assert generate(ckpt, 2, enable_expert_parallel=ep) == _tp1_tokens(str(ckpt))


@functools.cache
def _tp1_tokens(ckpt: str) -> list[list[int]]:
    return generate(ckpt, 1)


def test_expert_parallel_needs_experts_divisible_by_ranks():
    cfg = dataclasses.replace(_cfg(), architecture="Qwen3MoeForCausalLM", num_experts=6, num_experts_per_tok=2,
                              moe_intermediate_size=256, moe_layers=(0, 1))
    assert list(TPShard(1, 2, cfg, expert_parallel=True).local_experts) == [3, 4, 5]
    assert TPShard(1, 2, cfg).expert_intermediate_size == 128
    with pytest.raises(ConfigError, match="--enable-expert-parallel.*6 experts"):
        TPShard(0, 4, cfg, expert_parallel=True)


def test_tp2_seeded_sampling_and_logprobs_equal_tp1(checkpoint):
    # Only rank 0 samples, from the gathered full-vocabulary logits: seeded sampling, top-p and
    # logprobs behave as at TP=1 (logprobs equal up to the all-reduce's summation order).
    ckpt = checkpoint("llama", 2)
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=123, logprobs=3, ignore_eos=True)
    runs = []
    for tp in (1, 2):
        engine = make_engine(ckpt, tensor_parallel_size=tp)
        try:
            engine.add_request("r", PROMPTS[0], params)
            outs = []
            while engine.has_work():
                outs += engine.step()
            runs.append(([t for o in outs for t in o.new_token_ids], [lp for o in outs for lp in o.logprobs or []]))
        finally:
            engine.shutdown()
    (tokens1, lps1), (tokens2, lps2) = runs
    assert tokens1 == tokens2 and len(lps1) == len(lps2) == 8
    for a, b in zip(lps1, lps2):
        assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_tp2_triton_backend_equals_tp1(checkpoint):
    # The GPU path's kernels (Triton interpreter on CPU): fused bias + rotary + KV write over a
    # rank's heads, decode through the graphs' static buffers. Short: the interpreter is slow.
    ckpt = checkpoint("qwen2", 1)
    prompts, params = PROMPTS[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = []
    for tp in (1, 2):
        engine = make_engine(ckpt, attention_backend="triton", static_decode=True, block_size=16, max_model_len=64,
                             tensor_parallel_size=tp)
        try:
            outs.append(engine.generate(prompts, params))
        finally:
            engine.shutdown()
    assert outs[0] == outs[1]


def test_tp2_chunked_prefill_equals_tp1(checkpoint):
    ckpt = checkpoint("llama", 2)
    # A 5-token budget splits prompts over steps and mixes prefill chunks with decodes.
    assert generate(ckpt, 2, max_num_batched_tokens=5) == generate(ckpt, 1, max_num_batched_tokens=5)


def _cfg(heads=32, kv=8, inter=14336, vocab=128256) -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", vocab, 4096, inter, 2, heads, kv, 128, 1e-5, 8192, False,
                       False, False, False, 1e4, (), ())


@pytest.mark.parametrize("n,kv,first_kv_heads", [
    (2, 8, [0, 4]),  # KV heads split 4 + 4
    (8, 8, list(range(8))),
    (4, 2, [0, 0, 1, 1]),  # N > KV heads: each KV head replicated on two ranks
    (8, 1, [0] * 8),
])
def test_kv_head_assignment(n, kv, first_kv_heads):
    shards = [TPShard(r, n, _cfg(kv=kv)) for r in range(n)]
    assert [s.first_kv_head for s in shards] == first_kv_heads
    assert {s.num_kv_heads for s in shards} == {max(1, kv // n)}
    # Every query head of a rank reads the KV head the rank holds (GQA groups never straddle ranks).
    group = 32 // kv
    for s in shards:
        heads = range(s.rank * s.num_heads, (s.rank + 1) * s.num_heads)
        assert {h // group for h in heads} <= set(range(s.first_kv_head, s.first_kv_head + s.num_kv_heads))


def test_vocab_shards_cover_the_vocabulary_once():
    shards = [TPShard(r, 4, _cfg(vocab=1001)) for r in range(4)]
    assert [s.vocab_range for s in shards] == [(0, 251), (251, 502), (502, 753), (753, 1001)]
    assert {s.vocab_per_rank for s in shards} == {251}  # the last shard is padded by 2 zero rows


@pytest.mark.parametrize("n,kw,message", [
    (3, {}, "3 does not divide the model's 32 attention heads"),
    (4, {"kv": 6, "heads": 24}, "4 and the model's 6 KV heads: one must divide the other"),
    (2, {"inter": 11}, "2 does not divide the MLP size 11"),
])
def test_unshardable_models_are_refused(n, kw, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        TPShard(0, n, _cfg(**kw))
    assert e.value.flag == "--tensor-parallel-size"


def test_engine_refuses_before_starting_ranks(checkpoint):
    # The tiny model has 4 heads: TP=3 fails in rank 0 with the flag named, no process started.
    with pytest.raises(ConfigError, match="--tensor-parallel-size: 3 does not divide"):
        LLMEngine(EngineConfig(model=str(checkpoint("llama", 2)), device="cpu", tensor_parallel_size=3))


def test_engine_refuses_expert_parallel_that_does_not_divide_the_experts(checkpoint):
    # Rank 0 checks before any process starts, naming the flag (the experts are checked first).
    ckpt = checkpoint("mixtral", 2)  # 4 experts
    with pytest.raises(ConfigError, match="--enable-expert-parallel: 3 ranks cannot share the model's 4 experts"):
        LLMEngine(EngineConfig(model=str(ckpt), device="cpu", tensor_parallel_size=3, enable_expert_parallel=True))


@pytest.mark.parametrize(
    "kw", [{"role": "prefill"}, {"role": "decode", "kv_transfer": "tcp", "kv_peer_allow": ("127.0.0.1",)}]
)
def test_tp_with_kv_transfer_is_accepted(kw):
    # P/D between tensor-parallel workers: tests/worker/test_tp_pd.py.
    assert EngineConfig(tensor_parallel_size=2, **kw).tensor_parallel_size == 2


def _follower_pids(worker: WorkerProcess) -> list[int]:
    m = re.search(r"tensor parallel: started ranks 1\.\.\d+ \(pids ([\d, ]+)\)", worker.output())
    assert m, worker.output()
    return [int(p) for p in m.group(1).split(", ")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.2)
    return False


def test_http_tp2_greedy_equals_tp1(checkpoint):
    ckpt = checkpoint("qwen2", 1)
    ref = generate(ckpt, 1, max_model_len=256)
    with WorkerProcess(ckpt, "--tensor-parallel-size", "2", "--served-model-name", "tiny", "--max-model-len", "256",
                       "--block-size", "4", "--kv-cache-memory", str(1 << 22)) as w:
        followers = _follower_pids(w)
        client = openai.OpenAI(base_url=f"{w.url}/v1", api_key="none", max_retries=0, timeout=120)
        tok = AutoTokenizer.from_pretrained(ckpt)
        # The prompt goes in as token ids; the greedy text must be the TP=1 tokens' text.
        for prompt, want in zip(PROMPTS, ref):
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=GREEDY.max_tokens, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].text == tok.decode(want)
            assert r.usage.completion_tokens == len(want)
        # Streamed, two at once (one batch): both ranks follow the same plans.
        streams = [client.completions.create(model="tiny", prompt=p, max_tokens=GREEDY.max_tokens, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True}) for p in PROMPTS[:2]]
        for s, want in zip(streams, ref):
            assert "".join(c.choices[0].text for c in s if c.choices) == tok.decode(want)
        assert w.stop() == 0  # SIGTERM: drain, stop the other ranks, exit 0
    for pid in followers:
        assert _wait_gone(pid, 15), f"rank process {pid} outlived the worker"


def test_killed_rank_takes_the_worker_down(checkpoint):
    with WorkerProcess(checkpoint("llama", 2), "--tensor-parallel-size", "2", "--max-model-len", "128",
                       "--kv-cache-memory", str(1 << 22)) as w:
        (rank1,) = _follower_pids(w)
        os.kill(rank1, signal.SIGKILL)
        try:
            code = w.proc.wait(30)
        except Exception:
            pytest.fail(f"worker still running 30 s after rank 1 was killed:\n{w.output()}")
        assert code == 1
        assert f"tensor-parallel rank 1 (pid {rank1}) exited with code -9" in w.output()


def test_killed_rank0_takes_the_other_ranks_down(checkpoint):
    with WorkerProcess(checkpoint("llama", 2), "--tensor-parallel-size", "2", "--max-model-len", "128",
                       "--kv-cache-memory", str(1 << 22)) as w:
        (rank1,) = _follower_pids(w)
        w.proc.kill()
        w.proc.wait()
        assert _wait_gone(rank1, 15), f"rank 1 outlived rank 0:\n{w.output()}"
        assert f"tensor-parallel rank 1: rank 0 (pid {w.proc.pid}) is gone" in w.output()


@pytest.mark.parametrize("argv,message", [
    (["--smoke", "--env", "NCCL_DEBUG"], "--env: expected KEY=VALUE"),
    (["--smoke", "--timeout", "0"], "--timeout: must be > 0"),
])
def test_bench_tp_debug_flags_refuse_bad_values(argv, message, capsys):
    """bench/tp.py's hang-debugging flags (--env, --timeout) name the flag on bad input, before
    any rank starts."""
    from pdserve.bench.tp import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
