"""Where a split prefill's time goes (a CUDA machine; not a test).

    python tools/gpu/prefill_split.py [--checkpoint DIR] [--prompt 3000] [--out split.md]

A streamed P/D hand-off cuts a prompt's prefill into chunks (worker/kv/connector_scheduler.py:
"tail" 2488 + 512, "taper" 1464 + 1024 + 512 for 3000 tokens) so the KV moves while the next
chunk is computed; over TCP the prefill worker's TTFT then grew by 35-75 ms at 3000 tokens on an
H200 (docs/tcp-kv-gpu-results.md), and a profile could not tell what made it: the
chunks' own GPU work (smaller matrix products, attention that re-reads the context), their
launches (eager steps: Python per layer), or the TCP senders' threads taking the GIL the launch
needs. This bench separates them on one engine, no server, no transfer:

- per split: the prefill's wall time (add_request .. the first token on the host), the GPU
  kernels' busy time under torch.profiler, and the host time of each step's launch;
- the same with `--pressure` threads that do what a TCP sender does between its socket sends
  (slice the cache, queue device-to-host copies of a few runs on a side stream, wait for them;
  a 1 ms sleep stands for the GIL-free send); `N:gate`: they wait while a step launches;
  `N:big`: 8x the runs per piece and 8x the send time.

Measured (H200, docs/tcp-kv-gpu-results.md, "the TTFT cost is the GIL"): without sender threads a split costs
the prefill little (3000 tokens: 74.5 / 77.7 / 77.7 ms one step / tail / taper); four of them
make each eager launch (~17 ms) 2.5-3.5x as long, and a launch-bound step (512 tokens) is then
that much slower. Holding the threads while the launch runs removes it here, but in the server
it starved the real senders (the first gap over TCP went from 8 to 55 ms): not built.

One engine, Llama-3.1-8B shaped random bf16 weights (bench/tp.py's writer), async scheduling as
the server runs it, the step budget set per step to the split's next chunk.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from contextlib import nullcontext

import torch

SPLITS = {"one step": None, "tail 512": "tail", "taper 512": "taper", "even 512": "even"}


def chunks_of(split: str | None, prompt: int, tail: int = 512) -> list[int]:
    """The chunk lengths the connector's chunk_cap makes of a `prompt`-token prefill (no budget)."""
    from pdserve.worker.kv.connector_scheduler import stream_chunk

    if split is None:
        return [prompt]
    out, left = [], prompt
    while left:
        out.append(stream_chunk(split, left, left, tail))
        left -= out[-1]
    return out


class Gate:
    """The step thread is launching: gated pressure threads hold their Python until it is done."""

    def __init__(self):
        self.busy, self.on = False, False
        self.cond = threading.Condition()

    def close(self):
        if self.on:
            with self.cond:
                self.busy = True

    def open(self):
        if self.on:
            with self.cond:
                self.busy = False
                self.cond.notify_all()

    def wait(self):
        if self.busy:
            with self.cond:
                self.cond.wait_for(lambda: not self.busy, 1.0)


class Pressure:
    """`n` threads doing a TCP sender's Python between sends, until stopped (see the module doc):
    a piece of `runs` runs, then `send_s` without the GIL; gated: each piece waits for the gate."""

    def __init__(self, n: int, cache: torch.Tensor, layers: int, gate: Gate, send_s: float = 0.001, runs: int = 3):
        self.stop = threading.Event()
        self.cache, self.layers, self.gate, self.send_s, self.runs = cache, layers, gate, send_s, runs
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()

    def _run(self, i: int) -> None:
        blocks = self.cache
        lb = blocks.shape[1] // self.layers
        view = blocks.view(blocks.shape[0], self.layers, lb)
        group = max(1, self.layers // 8)
        host = torch.empty(4 * self.runs * group * lb, dtype=blocks.dtype, pin_memory=True)
        stream = torch.cuda.Stream(blocks.device)
        rng = random.Random(i)
        while not self.stop.is_set():
            self.gate.wait()
            lo = rng.randrange(0, self.layers - group + 1)
            with torch.cuda.stream(stream):
                for r in range(self.runs):  # a piece: a few runs of blocks, one layer group
                    first = rng.randrange(0, blocks.shape[0] - 4)
                    part = view[first:first + 4, lo:lo + group]
                    host[r * 4 * group * lb:(r + 1) * 4 * group * lb].view(part.shape).copy_(part, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            event.synchronize()
            time.sleep(self.send_s)  # the socket send: no GIL


def prefill_once(engine, prompt: list[int], chunks: list[int]) -> float:
    """Seconds from add_request to the first token on the host."""
    from pdserve.worker.request.sampling_params import SamplingParams

    sched = engine.scheduler
    budget = sched.max_num_batched_tokens
    rid = f"p{random.random()}"
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    k, done = 0, False
    try:
        while not done:
            sched.max_num_batched_tokens = chunks[min(k, len(chunks) - 1)]
            k += 1
            done = any(o.request_id == rid and o.new_token_ids for o in engine.step())
    finally:
        sched.max_num_batched_tokens = budget
    wall = time.perf_counter() - t0
    while engine.has_work():
        engine.step()
    return wall


def gpu_busy(engine, prompt: list[int], chunks: list[int]) -> tuple[float, list[tuple[str, float]]]:
    """One prefill under torch.profiler: (GPU kernel ms, top kernels)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill_once(engine, prompt, chunks)
        torch.cuda.synchronize()
    ks = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in ks) / 1e3
    top = sorted(((e.key[:70], e.self_device_time_total / 1e3) for e in ks), key=lambda x: -x[1])[:8]
    return total, top


class LaunchTimer:
    """Wraps the runner's launch: the host seconds each step's launch took (Python, eager)."""

    def __init__(self, runner, gate: Gate):
        self.inner, self.seconds, self.gate = runner.launch, [], gate
        runner.launch = self

    def __call__(self, *a, **k):
        t0 = time.perf_counter()
        self.gate.close()
        try:
            return self.inner(*a, **k)
        finally:
            self.gate.open()
            self.seconds.append(time.perf_counter() - t0)


def cprofile(engine, prompt: list[int], chunks: list[int], path: str) -> None:
    """One prefill under cProfile: where the host time of its launches goes."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    prefill_once(engine, prompt, chunks)
    prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(40)
    st.sort_stats("cumulative").print_stats(60)
    with open(path, "w") as f:
        f.write(buf.getvalue())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", help="a model directory (default: write Llama-3.1-8B shaped random weights)")
    ap.add_argument("--prompt", type=int, nargs="+", default=[3000], help="prompt lengths")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--pressure", nargs="+", default=["0", "4"],
                    help="sender-like threads: N, or N:gate (they wait while a step launches), N:big (pieces of "
                         "8x the runs, 8x the send time: the same bytes in 1/8 of the pieces); 0: none")
    ap.add_argument("--out")
    ap.add_argument("--cprofile", help="write a cProfile of one 3000-token even-512 prefill here")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script, times nothing")
    args = ap.parse_args(argv)

    from pdserve.bench.model_shapes import MODELS
    from pdserve.bench.tp import write_checkpoint
    from pdserve.worker.config.engine import EngineConfig
    from pdserve.worker.engine.llm_engine import LLMEngine

    device = "cpu" if args.smoke else "cuda"
    spec = MODELS["tiny-llama" if args.smoke else "llama-3.1-8b"]
    t0 = time.perf_counter()
    path = write_checkpoint(spec, device, args.checkpoint)
    print(f"[prefill_split] checkpoint {path} in {time.perf_counter() - t0:.0f}s", flush=True)
    engine = LLMEngine(EngineConfig(model=path, device=device, dtype="bfloat16" if device == "cuda" else "float32",
                                    max_model_len=max(args.prompt) + 64, max_num_seqs=8, max_num_batched_tokens=16384,
                                    enable_prefix_caching=False, async_scheduling=not args.smoke,
                                    kv_cache_memory=None if device == "cuda" else 1 << 26))
    print(f"[prefill_split] engine up in {time.perf_counter() - t0:.0f}s (async scheduling "
          f"{engine.async_scheduling})", flush=True)
    vocab = spec.hf["vocab_size"]
    rng = random.Random(0)
    lines = [f"# Split prefill, {torch.cuda.get_device_name() if device == 'cuda' else 'CPU (smoke)'}, "
             f"{spec.name} random bf16, {time.strftime('%Y-%m-%d')}", "",
             "| prompt | split (chunks) | sender-like threads | wall ms p50 (min) | launch ms per step p50 | "
             "GPU kernels ms |", "|---|---|---:|---:|---:|---:|"]
    gate = Gate()
    timer = LaunchTimer(engine.runner, gate)
    tops = []
    kv = engine.runner.kv_cache.tensor  # as the connector sees it: [blocks, block bytes]
    cache = kv.view(torch.uint8).view(kv.shape[0], -1)
    layers = engine.model_config.num_layers
    for n in args.prompt:
        for name, split in SPLITS.items():
            chunks = chunks_of(split, n)
            prompt = lambda: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
            for _ in range(2):  # warm-up: Triton autotune and compiles for these shapes
                prefill_once(engine, prompt(), chunks)
            busy, top = gpu_busy(engine, prompt(), chunks) if device == "cuda" else (0.0, [])
            tops.append((n, name, top))
            for pressure in args.pressure:
                p, _, how = pressure.partition(":")
                p = int(p)
                timer.seconds.clear()
                gate.on = how == "gate"
                big = how == "big"
                with (
                    Pressure(p, cache, layers, gate, 0.008 if big else 0.001, 24 if big else 3) if p else nullcontext()
                ):
                    walls = [1e3 * prefill_once(engine, prompt(), chunks) for _ in range(args.repeat)]
                hosts = [1e3 * x for x in timer.seconds]
                row = (f"| {n} | {name} ({'+'.join(map(str, chunks))}) | {pressure} | {statistics.median(walls):.1f} "
                       f"({min(walls):.1f}) | {statistics.median(hosts):.1f} | {busy:.1f} |")
                lines.append(row)
                print(row, flush=True)
                if args.out:
                    _write(args.out, lines, tops)
    if args.cprofile:
        n = 3000 if 3000 in args.prompt else args.prompt[0]
        cprofile(engine, [rng.randrange(3, vocab) for _ in range(n)], chunks_of("even", n), args.cprofile)
    if args.out:
        _write(args.out, lines, tops)
    else:
        print("\n".join(lines))
    return 0


def _write(path: str, lines: list[str], tops) -> None:
    out = list(lines) + ["", "Top kernels per split (one prefill under torch.profiler, ms):", ""]
    for n, name, top in tops:
        out.append(f"- {n} {name}: " + "; ".join(f"{k} {ms:.1f}" for k, ms in top))
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    sys.exit(main())
