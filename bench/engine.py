"""Engine benchmark (a CUDA machine; not a test): pdserve against the hardware and Hugging Face.

    python -m pdserve.bench.engine [--models qwen2.5-0.5b llama-3.1-8b] [--out results.md]

One run measures, in this order: the device-to-device copy bandwidth; then per model (random
bf16 weights in the real model's configuration, made once, saved as safetensors in a temp
dir): Hugging Face `generate` on those weights in memory, then pdserve loading the saved files.
Scenarios: batch-1 decode at input 128 and 1024 (ms/step; the bytes a step must read over the
measured bandwidth), offline throughput at 1024-in/128-out and at input lengths uniform in
[100, 1024] with 128 out (output tokens/s). Output lengths are fixed (ignore_eos /
min_new_tokens); pdserve runs each offline scenario once untimed first, HF a small batch;
CUDA-graph capture time is reported separately. `--smoke` runs tiny models on CPU to check the script, not to time it.
A device run short of time picks less (`BenchPlan`): `--decode-inputs 128 --offline 1024 --no-hf
--no-eager` keeps what issue 17's table needs (tools/gpu/perf.sh runs exactly that).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from pdserve.bench.host_probe import host_probe_us
from pdserve.bench.model_shapes import MODELS, ModelSpec

OUT_TOKENS = 128
# A command line's engine switch (--async-scheduling, --fused-gemv): the engine's default or forced.
SWITCH = {"default": None, "on": True, "off": False}
HF_BATCH = 64  # HF generate pads a static batch: one batch of 64 prompts of each offline scenario


def decode_step_seconds(engine, prompt: list[int], steps: int, after_prefill=None) -> list[float]:
    """Wall seconds of each decode step of one greedy request (every step ends on the sampled ids).
    `after_prefill`: called once the prefill step is done (a profiler's start: decode steps only)."""
    from pdserve.worker.request.sampling_params import SamplingParams

    engine.add_request(f"b{random.random()}", prompt, SamplingParams(max_tokens=steps + 1, temperature=0.0,
                                                                      ignore_eos=True))
    times = []
    while engine.has_work():
        if len(times) == 1 and after_prefill is not None:
            after_prefill()
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times[1:]  # the first step is the prefill


def profile_decode(engine, prompt: list[int], path: str, steps: int = 16, title: str = "bs=1 decode") -> float:
    """torch.profiler over `steps` decode steps of one request (this process's kernels: rank 0's
    under TP): the kernels by GPU time per step, as a markdown table written to `path`. Returns the
    GPU busy time per step (ms), so wall - GPU = the host's gap."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    # The window opens after the prompt's prefill: its kernels would swamp a decode step's.
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    wall = decode_step_seconds(engine, prompt, steps, after_prefill=prof.start)
    prof.stop()
    kernels = sorted(
        (e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0),
        key=lambda e: -e.self_device_time_total,
    )
    gpu_us = sum(e.self_device_time_total for e in kernels) / steps
    launches = sum(e.count for e in kernels) / steps
    lines = [
        f"{title}, {steps} steps under torch.profiler: wall {1e3 * statistics.median(wall):.3f} ms/step "
        f"(median), GPU kernels {gpu_us / 1e3:.3f} ms/step in {launches:.0f} kernels/step",
        "",
        "| kernel | calls/step | us/step | us/call | share |",
        "|---|---:|---:|---:|---:|",
    ]
    for e in kernels[:40]:
        lines.append(
            f"| {e.key[:90]} | {e.count / steps:.1f} | {e.self_device_time_total / steps:.1f} | "
            f"{e.self_device_time_total / max(e.count, 1):.2f} | {100 * e.self_device_time_total / steps / gpu_us:.0f}% |"  # noqa: E501
        )
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return gpu_us / 1e3


@dataclass
class Row:
    model: str
    scenario: str
    impl: str
    ms_step: float | None = None
    tok_s: float | None = None
    ratio: str = ""


OFFLINE = {"1024": "offline 1024/128", "uniform": "offline U[100,1024]/128"}


@dataclass(frozen=True)
class BenchPlan:
    """What one run measures (the full plan by default; a device run with little time picks less)."""

    decode_inputs: tuple[int, ...] = (128, 1024)
    offline: tuple[str, ...] = ("1024", "uniform")  # keys of OFFLINE
    hf: bool = True  # Hugging Face generate beside pdserve
    eager: bool = True  # pdserve --enforce-eager bs=1 beside the graphs
    # The engine's own bs=1 graph captured on v4's unfused decode path and on the fused one,
    # timed (step and forward) and profiled per kernel in the same run.
    decode_paths: bool = False
    # EngineConfig.async_scheduling: None = the engine's default (on with a GPU), or forced.
    async_scheduling: bool | None = None
    # TritonAttentionBackend.fused_gemv: None = the engine's default (the measured shapes), or forced.
    fused_gemv: bool | None = None

    def __post_init__(self):
        if any(k not in OFFLINE for k in self.offline):
            raise ValueError(f"BenchPlan.offline: unknown {self.offline}; choose from {sorted(OFFLINE)}")
        if any(not 1 <= L <= 1900 for L in self.decode_inputs):
            raise ValueError("BenchPlan.decode_inputs: input lengths must be in [1, 1900] (max_model_len 2048)")


class Bench:
    def __init__(self, device: str, smoke: bool, profile_dir: str | None = None, token_budget: int = 16384,
                 plan: BenchPlan = BenchPlan()):
        self.device, self.smoke, self.profile_dir, self.token_budget = device, smoke, profile_dir, token_budget
        self.plan = plan
        self.rows: list[Row] = []
        self.notes: list[str] = []
        self.sections: list[str] = []  # markdown after the table (per-kernel profiles)
        self.bw = self.copy_bandwidth()
        self.flops = self.matmul_rate()

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def copy_bandwidth(self) -> float:
        """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
        if self.device != "cuda":
            return 1e10
        from pdserve.bench.kernels import copy_bandwidth

        return copy_bandwidth()

    def matmul_rate(self) -> float:
        """FLOP/s of a bf16 8192^3 matrix product on random data (the prefill compute ceiling)."""
        if self.device != "cuda":
            return 1e11
        from triton.testing import do_bench

        a, b = torch.randn(2, 8192, 8192, dtype=torch.bfloat16, device="cuda")
        ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
        return 2 * 8192**3 / (ms * 1e-3)

    def profile(self, name: str, fn) -> None:
        """cProfile of fn() (host-side Python of the engine) -> PROFILE_DIR/profile_<name>.txt."""
        if not self.profile_dir:
            return
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.runcall(fn)
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
        os.makedirs(self.profile_dir, exist_ok=True)
        with open(f"{self.profile_dir}/profile_{name}.txt", "w") as f:
            f.write(buf.getvalue())

    def gemv_floor_ms(self, m) -> float:
        """One CUDA graph of just the step's matrix products at batch 1 (every layer's qkv, o,
        gate_up, down, then lm_head): what the step costs with all other kernels free."""
        from triton.testing import do_bench

        lins = [lin for layer in m.layers for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                      layer.mlp.gate_up_proj, layer.mlp.down_proj)]
        head = m.embed_tokens.weight if m.lm_head is None else m.lm_head.weight
        xs = [torch.randn(1, lin.in_features, dtype=head.dtype, device="cuda") for lin in lins]
        xh = torch.randn(1, head.shape[1], dtype=head.dtype, device="cuda")

        def body():
            for lin, x in zip(lins, xs):
                lin(x)
            xh @ head.t()

        with torch.inference_mode():
            body()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                body()
        return do_bench(g.replay, warmup=20, rep=200, return_mode="median")

    def add(self, row: Row):
        self.rows.append(row)
        ms = f"{row.ms_step:.3f} ms" if row.ms_step is not None else ""
        tok = f"{row.tok_s:.0f} tok/s" if row.tok_s is not None else ""
        print(f"  {row.model:14s} {row.scenario:28s} {row.impl:34s} {ms:>12s} {tok:>14s} {row.ratio}", flush=True)

    # -- workloads ------------------------------------------------------------------------------

    def prompts(self, vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths]

    def scenarios(self):
        n = 4 if self.smoke else 256
        rng = random.Random(1)
        every = {
            "1024": [1024] * n,
            "uniform": [rng.randint(100, 1024) for _ in range(n)],
        }
        return {OFFLINE[k]: every[k] for k in OFFLINE if k in self.plan.offline}

    # -- Hugging Face -------------------------------------------------------------------------

    def hf_generate(self, model, batch: list[list[int]], new: int) -> float:
        """Seconds for one left-padded generate() of exactly `new` tokens per prompt."""
        width = max(len(p) for p in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        self.sync()
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
        self.sync()
        assert out.shape[1] == width + new
        return time.perf_counter() - t0

    def run_hf(self, spec: ModelSpec, model, vocab: int) -> dict[str, float]:
        tput = {}
        steps = 8 if self.smoke else 64
        for L in self.plan.decode_inputs:
            p = self.prompts(vocab, [L], 7)
            self.hf_generate(model, p, 4)  # warm-up
            t1 = self.hf_generate(model, p, 1)
            tn = self.hf_generate(model, p, steps + 1)
            self.add(Row(spec.name, f"bs=1 decode in={L}", "HF generate", ms_step=1e3 * (tn - t1) / steps))
        for name, lengths in self.scenarios().items():
            batch = self.prompts(vocab, lengths[:HF_BATCH], 11)
            self.hf_generate(model, batch[:2], 2)  # warm-up
            sec = self.hf_generate(model, batch, OUT_TOKENS)
            tput[name] = len(batch) * OUT_TOKENS / sec
            self.add(Row(spec.name, name, f"HF generate (batch {len(batch)})", tok_s=tput[name]))
        return tput

    # -- pdserve ------------------------------------------------------------------------------

    def decode_steps(self, engine, prompt: list[int], steps: int) -> list[float]:
        return decode_step_seconds(engine, prompt, steps)

    def run_pdserve(self, spec: ModelSpec, path: str, hf_tput: dict[str, float]) -> None:
        from pdserve.worker.config.engine import EngineConfig
        from pdserve.worker.attention.triton_backend import TritonAttentionBackend
        from pdserve.worker.engine.llm_engine import LLMEngine
        from pdserve.worker.request.sampling_params import SamplingParams

        TritonAttentionBackend.fused_gemv = self.plan.fused_gemv  # read when the model is built
        t0 = time.perf_counter()
        engine = LLMEngine(EngineConfig(model=path, device=self.device, dtype="bfloat16", max_model_len=2048,
                                        max_num_seqs=256, max_num_batched_tokens=self.token_budget,
                                        enable_prefix_caching=False, async_scheduling=self.plan.async_scheduling,
                                        kv_cache_memory=None if self.device == "cuda" else 1 << 28))
        graphs = engine.runner.graphs
        cap = graphs.capture_seconds if graphs else 0.0
        kv_gib = engine.kv_cache.tensor.numel() * engine.kv_cache.tensor.element_size() / 2**30
        self.notes.append(
            f"{spec.name}: engine start {time.perf_counter() - t0:.1f}s, of which CUDA-graph capture "
            f"{cap:.2f}s ({len(graphs.buckets) if graphs else 0} batch sizes); KV cache {kv_gib:.1f} GiB "
            f"({engine.block_manager.num_blocks} blocks x 16 tokens), attention={engine.attention_backend}, "
            f"max_num_seqs 256, max_num_batched_tokens {self.token_budget}"
        )
        m = engine.runner.model  # the runner owns the model (worker/executor/model_runner.py)
        weight_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
        if m.lm_head is not None:  # untied: decode reads one embedding row, not the table
            weight_bytes -= m.embed_tokens.weight.numel() * m.embed_tokens.weight.element_size()
        head_bytes = m.embed_tokens.weight.numel() * m.embed_tokens.weight.element_size()  # same size either way
        kv_per_token = engine.kv_cache.block_bytes // engine.block_manager.block_size
        vocab = engine.model_config.vocab_size
        steps = 16 if self.smoke else 128
        for L in self.plan.decode_inputs:
            prompt = self.prompts(vocab, [L], 7)[0]
            self.decode_steps(engine, prompt, 8)  # warm-up
            step_bytes = weight_bytes + kv_per_token * (L + steps // 2)
            roof_ms = 1e3 * step_bytes / self.bw
            scen = f"bs=1 decode in={L}"
            self.add(Row(spec.name, scen, f"roofline ({step_bytes / 1e9:.2f} GB/step)", ms_step=roof_ms))
            ms = 1e3 * statistics.median(self.decode_steps(engine, prompt, steps))
            self.add(Row(spec.name, scen, "pdserve (CUDA graphs)" if graphs else "pdserve", ms_step=ms,
                         ratio=f"{100 * roof_ms / ms:.0f}% of copy BW"))
            if graphs is not None and self.device == "cuda":
                # GPU time of the same step alone: the bucket-1 graph replayed back to back
                # over the static inputs the last step left (context L + steps).
                from triton.testing import do_bench

                fwd = do_bench(lambda: graphs.replay(1), warmup=20, rep=200, return_mode="median")
                fwd_roof = 1e3 * (step_bytes - head_bytes) / self.bw  # the graph stops before lm_head
                self.add(Row(spec.name, scen, "pdserve forward only (graph replay, no lm_head)", ms_step=fwd,
                             ratio=f"{100 * fwd_roof / fwd:.0f}% of copy BW"))
                if L == self.plan.decode_inputs[0]:
                    gemv = self.gemv_floor_ms(m)
                    lin_bytes = sum(p.numel() * p.element_size() for n, p in m.named_parameters() if "proj" in n)
                    self.add(Row(spec.name, scen, "matrix products alone, + lm_head (graph)", ms_step=gemv,
                                 ratio=f"{100 * (lin_bytes + head_bytes) / self.bw * 1e3 / gemv:.0f}% of copy BW"))
            if graphs is not None and self.device == "cuda" and self.plan.eager:
                engine.runner.graphs = None
                ms_e = 1e3 * statistics.median(self.decode_steps(engine, prompt, steps))
                engine.runner.graphs = graphs
                self.add(Row(spec.name, scen, "pdserve --enforce-eager", ms_step=ms_e,
                             ratio=f"{100 * roof_ms / ms_e:.0f}% of copy BW"))
            if L == 128:
                self.profile(f"{spec.arch}_bs1_decode", lambda: self.decode_steps(engine, prompt, 64))
            if self.plan.decode_paths and graphs is not None and L == self.plan.decode_inputs[0]:
                self.decode_path_rows(spec, engine, prompt, steps, scen, roof_ms)
        params = SamplingParams(max_tokens=OUT_TOKENS, temperature=0.0, ignore_eos=True)
        for name, lengths in self.scenarios().items():
            prompts = self.prompts(vocab, lengths, 13)
            # Warm-up: the whole scenario once. Triton compiles a kernel again for each new
            # specialization of its integer arguments (==1, divisible by 16), and which ones a
            # workload meets depends on its batch mix: a small warm-up left seconds of
            # compilation inside the timed run (see docs/performance.md, v3).
            engine.generate(prompts, params)
            self.sync()
            probe = host_probe_us()
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params)
            sec = time.perf_counter() - t0
            assert all(len(o) == OUT_TOKENS for o in outs)
            self.notes.append(f"{spec.name} {name}: host probe {probe:.0f} / {host_probe_us():.0f} µs before / after "
                              "the timed run (bench/host_probe.py: a slower host makes a small model's run slower)")
            tput = len(prompts) * OUT_TOKENS / sec
            floor = self.offline_floor_s(engine, lengths, weight_bytes, kv_per_token)
            self.add(Row(spec.name, name, "floor: prefill FLOPs / matmul rate + decode bytes / copy BW",
                         tok_s=len(prompts) * OUT_TOKENS / floor))
            vs_hf = f"{tput / hf_tput[name]:.1f}x HF, " if name in hf_tput else ""
            self.add(Row(spec.name, name, f"pdserve ({len(prompts)} prompts)", tok_s=tput,
                         ratio=f"{vs_hf}{100 * floor / sec:.0f}% of floor"))
            if name.startswith("offline 1024"):
                self.profile(f"{spec.arch}_offline", lambda: engine.generate(prompts[:64], params))
        del engine, m
        gc.collect()

    def decode_path_rows(self, spec: ModelSpec, engine, prompt: list[int], steps: int, scen: str,
                         roof_ms: float) -> None:
        """The engine's own batch-1 decode graph, captured on each decode path in turn (v4's
        separate rotary / KV write / attention / merge launches, then the fused ones), with
        the step, the forward replay and the kernels the profiler sees in that graph. The
        kernel harness (bench/profile_decode.py) builds its own model and graph; this asks
        whether the engine's graph gains what the harness does."""
        from triton.testing import do_bench

        from pdserve.bench.profile_decode import kernel_table, set_path, short
        from pdserve.worker.executor.cuda_graphs import DecodeGraphConfig, DecodeGraphs

        runner = engine.runner
        model, full = runner.model, runner.graphs
        backend = model.layers[0].self_attn.backend
        n_layers = len(model.layers)
        try:
            for fused in (False, True):
                set_path(model, backend, fused)
                one = DecodeGraphs(model, DecodeGraphConfig(1, full.config.max_blocks_per_seq), runner.device)
                one.capture()
                runner.graphs = one
                self.decode_steps(engine, prompt, 8)  # warm-up on this graph
                ms = 1e3 * statistics.median(self.decode_steps(engine, prompt, steps))
                fwd = do_bench(lambda: one.replay(1), warmup=20, rep=200, return_mode="median")
                rows, total_us, per_layer = kernel_table(one._graphs[1], 20, n_layers)
                path = "fused" if fused else "v4 path (unfused)"
                self.add(Row(spec.name, scen, f"engine bs=1 graph, {path}: step", ms_step=ms,
                             ratio=f"{100 * roof_ms / ms:.0f}% of copy BW"))
                self.add(Row(spec.name, scen, f"engine bs=1 graph, {path}: forward replay", ms_step=fwd,
                             ratio=f"{sum(r[1] for r in rows):.0f} kernels, {per_layer}/layer, "
                                   f"GPU busy {total_us / 1e3:.3f} ms"))
                self.sections += [
                    f"### {spec.name}: the engine's bs=1 decode graph, {path}: forward replay {fwd:.3f} ms, "
                    f"kernels busy {total_us / 1e3:.3f} ms, step {ms:.3f} ms",
                    "",
                    "| kernel | calls/step | µs/step | µs/call |",
                    "| --- | ---: | ---: | ---: |",
                ]
                self.sections += [f"| `{short(k)}` | {c:.0f} | {us:.1f} | {us / c:.2f} |" for k, c, us in rows]
                self.sections.append("")
                del one
        finally:
            set_path(model, backend, True)
            runner.graphs = full

    def offline_floor_s(self, engine, lengths: list[int], weight_bytes: int, kv_per_token: int) -> float:
        """Seconds no engine can beat: prefill matrix + causal attention FLOPs at the measured
        matmul rate, plus OUT_TOKENS decode steps reading the weights and the average live KV."""
        mc = engine.model_config
        params = weight_bytes // 2 - mc.vocab_size * mc.hidden_size  # non-embedding, bf16 (lm_head once per sequence)
        attn = sum(2 * L * L * mc.num_heads * mc.head_dim * mc.num_layers for L in lengths)  # causal QK^T + PV
        prefill = (2 * params * sum(lengths) + attn) / self.flops
        avg_ctx = statistics.fmean(lengths) + OUT_TOKENS / 2
        decode = OUT_TOKENS * (weight_bytes + kv_per_token * avg_ctx * len(lengths)) / self.bw
        return prefill + decode

    # -- one model ----------------------------------------------------------------------------

    def run_model(self, spec: ModelSpec) -> None:
        import transformers
        from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

        print(f"== {spec.name}", flush=True)
        cfg = (LlamaConfig if spec.arch == "llama" else Qwen2Config)(**spec.hf, bos_token_id=1, eos_token_id=2)
        tmp = tempfile.mkdtemp(prefix="pdserve-bench-")
        try:
            t0 = time.perf_counter()
            torch.manual_seed(0)
            with torch.device(self.device):
                model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
            model.eval()
            model.save_pretrained(tmp)
            save_tokenizer(tmp)
            self.notes.append(f"{spec.name}: random weights made and saved in {time.perf_counter() - t0:.1f}s "
                              f"(transformers {transformers.__version__}, sdpa attention)")
            with torch.inference_mode():
                hf_tput = self.run_hf(spec, model, cfg.vocab_size) if self.plan.hf else {}
            del model
            gc.collect()
            if self.device == "cuda":
                torch.cuda.empty_cache()
            self.run_pdserve(spec, tmp, hf_tput)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            gc.collect()
            if self.device == "cuda":
                torch.cuda.empty_cache()

    def table(self) -> str:
        lines = ["| model | scenario | impl | ms/step | output tok/s | vs limit / HF |",
                 "| --- | --- | --- | ---: | ---: | --- |"]
        for r in self.rows:
            ms = f"{r.ms_step:.3f}" if r.ms_step is not None else ""
            tok = f"{r.tok_s:.0f}" if r.tok_s is not None else ""
            lines.append(f"| {r.model} | {r.scenario} | {r.impl} | {ms} | {tok} | {r.ratio} |")
        return "\n".join(lines)


def save_tokenizer(path: str, size: int = 1024) -> None:
    """A word-level tokenizer ("t<id>" words): the engine loads one with every checkpoint, the
    bench feeds ids. `size` = the model's vocabulary makes every id's text name it (bench/tp_pd.py)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(size)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")),
                            unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench engine", description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "llama-3.1-8b"], choices=sorted(MODELS))
    ap.add_argument("--out", help="also write the results (markdown) to this file, after each model")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script, times nothing")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384, help="pdserve's token budget per step")
    ap.add_argument("--profile-dir", help="write cProfile summaries of bs=1 decode and an offline batch here")
    ap.add_argument("--decode-inputs", type=int, nargs="+", default=[128, 1024], metavar="L",
                    help="input lengths of the bs=1 decode rows (default 128 1024)")
    ap.add_argument("--offline", nargs="*", default=["1024", "uniform"], choices=sorted(OFFLINE),
                    help="offline scenarios: 1024 (1024/128), uniform (U[100,1024]/128); none given = skip")
    ap.add_argument("--no-hf", action="store_true", help="skip Hugging Face generate")
    ap.add_argument("--no-eager", action="store_true", help="skip the --enforce-eager bs=1 rows")
    ap.add_argument("--decode-paths", action="store_true",
                    help="GPU: also capture the engine's bs=1 graph on the unfused (v4) and fused decode paths, "
                         "timed and profiled per kernel in the same run")
    ap.add_argument("--async-scheduling", choices=list(SWITCH), default="default",
                    help="the engine's async scheduling: its default (on with a GPU) or forced on / off")
    ap.add_argument("--fused-gemv", choices=list(SWITCH), default="default",
                    help="the small-batch GEMV path: its default (the shapes measured to win on this card), "
                         "every shape, or none")
    ap.add_argument("--gemv-table", metavar="GEMV_MD",
                    help="a bench/gemv.py sweep's output: its MEASURED entries over the shipped ones (this run only)")
    args = ap.parse_args(argv)
    try:
        plan = BenchPlan(tuple(args.decode_inputs), tuple(args.offline), hf=not args.no_hf, eager=not args.no_eager,
                         decode_paths=args.decode_paths,
                         async_scheduling=SWITCH[args.async_scheduling], fused_gemv=SWITCH[args.fused_gemv])
    except ValueError as e:
        ap.error(str(e))
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("pdserve bench engine: needs a CUDA GPU (none visible); --smoke runs a CPU check", file=sys.stderr)
        return 2
    if args.gemv_table:
        from pdserve.bench.gemv import use_swept_table

        print(f"GEMV table: {use_swept_table(args.gemv_table, torch.device(device))} swept entries from "
              f"{args.gemv_table} over the shipped ones", flush=True)
    models = ["tiny-llama"] if args.smoke else args.models
    bench = Bench(device, args.smoke, args.profile_dir, args.max_num_batched_tokens, plan)
    import triton

    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke run)"
    header = (
        f"{name} · torch {torch.__version__} · triton {triton.__version__} · {datetime.date.today()} · "
        f"bf16 · measured copy bandwidth {bench.bw / 1e9:.0f} GB/s · bf16 matmul {bench.flops / 1e12:.0f} TFLOP/s"
    )
    print(header, flush=True)
    for key in models:
        bench.run_model(MODELS[key])
        text = (header + "\n\n" + bench.table() + "\n\n" + "\n".join(f"- {n}" for n in bench.notes)
                + ("\n\n" + "\n".join(bench.sections) if bench.sections else ""))
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
