"""Where an offline run's time goes, step by step (issue 50: Qwen2.5-0.5B offline 1024/128 moves with
the card's GEMV table although its decode batches are wider than the GEMV's 8 rows).

    python tools/gpu/offline_steps.py [--model qwen2.5-0.5b] [--prompts 256] [--runs 2] [--fused-gemv default|on|off]

bench/engine.py's offline 1024/128 scenario (random bf16 weights in the real configuration, the same
engine settings and prompts), warmed up once, then timed `--runs` times. Every `engine.step()` is
timed on the host, with the rows of the forward(s) it launched (0: a step that launched none, e.g.
the async engine's last collect); the table sums the steps per bucket of rows. Then one more run
under torch.profiler (GPU time per kernel: is the GPU's work the same?) and one under cProfile (host
time per Python function, per step). Each run line also gives the process's CPU seconds per wall
second, its GC passes and bench/host_probe.py's reading before and after (which host speed it got).
Run from a link farm (tools/gpu/lib.sh's) for each tree to compare: the same buckets side by side
say which steps moved.
"""

from __future__ import annotations

import argparse
import collections
import gc
import shutil
import statistics
import sys
import time

import torch

BUCKETS = [(0, 0), (1, 1), (2, 8), (9, 64), (65, 255), (256, 256), (257, 16384)]


def bucket(rows: int) -> str:
    for lo, hi in BUCKETS:
        if lo <= rows <= hi:
            return f"{lo}" if lo == hi else f"{lo}-{hi}"
    return ">16384"


def main(argv: list[str] | None = None) -> list[list[tuple[int, float]]]:
    """Prints the tables; returns each timed run's steps as (rows launched, seconds)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--fused-gemv", choices=["default", "on", "off"], default="default")
    ap.add_argument("--label", default="")
    ap.add_argument("--device", default="cuda", help="cpu: checks the script (use --prompt-len 16 --max-tokens 4)")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--kernels", type=int, default=15, metavar="N",
                    help="then one more run under torch.profiler: the N kernels of most GPU time (0: none)")
    ap.add_argument("--host-functions", type=int, default=20, metavar="N",
                    help="then one more run under cProfile: the N functions of most host time per step (0: none)")
    args = ap.parse_args(argv)
    from pdserve.bench.host_probe import host_probe_us
    from pdserve.bench.model_shapes import MODELS
    from pdserve.bench.tp import write_checkpoint
    from pdserve.worker.attention.triton_backend import TritonAttentionBackend
    from pdserve.worker.config.engine import EngineConfig
    from pdserve.worker.engine.llm_engine import LLMEngine
    from pdserve.worker.request.sampling_params import SamplingParams

    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    d = write_checkpoint(MODELS[args.model], args.device)  # random weights in the model's real configuration
    TritonAttentionBackend.fused_gemv = {"default": None, "on": True, "off": False}[args.fused_gemv]
    engine = LLMEngine(EngineConfig(model=d, device=args.device, dtype="bfloat16", max_model_len=2048, max_num_seqs=256,
                                    max_num_batched_tokens=16384, enable_prefix_caching=False,
                                    kv_cache_memory=None if cuda else 1 << 28))
    rows: list[int] = []
    model = engine.runner.model
    fwd = model.forward

    def counted(ids, *a, **k):
        rows.append(ids.shape[0])
        return fwd(ids, *a, **k)

    model.forward = counted
    graphs = engine.runner.graphs
    if graphs is not None:  # a replayed step calls no forward: count its rows instead
        graph_run = graphs.run

        def counted_run(input_ids, *a, **k):
            rows.append(len(input_ids))
            return graph_run(input_ids, *a, **k)

        graphs.run = counted_run
    step = engine.step
    steps: list[tuple[int, float]] = []

    def timed_step():
        del rows[:]
        t0 = time.perf_counter()
        out = step()
        steps.append((sum(rows), time.perf_counter() - t0))
        return out

    engine.step = timed_step
    g = torch.Generator().manual_seed(13)
    vocab = engine.model_config.vocab_size
    prompts = [torch.randint(3, vocab - 1, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, params)  # warm-up
    sync()
    label = args.label or f"fused_gemv={args.fused_gemv}"
    card = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"## {label}: {card}, {args.prompts} prompts {args.prompt_len}/{args.max_tokens}\n")
    runs = []
    for run in range(args.runs):
        steps = []
        probe = host_probe_us()
        gc0, cpu0 = sum(s["collections"] for s in gc.get_stats()), time.process_time()
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        sync()
        wall = time.perf_counter() - t0
        # CPU seconds of all the process's threads per wall second (1.0: one thread busy throughout)
        # and the garbage collector's passes: a host slowed by other threads or by GC shows here.
        cpu, gcs = time.process_time() - cpu0, sum(s["collections"] for s in gc.get_stats()) - gc0
        per = collections.defaultdict(list)
        for r, s in steps:
            per[bucket(r)].append(s)
        print(f"run {run + 1}: {wall:.3f} s, {args.prompts * args.max_tokens / wall:.0f} tok/s, {len(steps)} steps, "
              f"process CPU {cpu / wall:.2f} s/s, {gcs} GC passes, host probe {probe:.0f} / {host_probe_us():.0f} µs "
              "before / after\n")
        print("| rows launched | steps | total ms | median ms | max ms |\n| --- | ---: | ---: | ---: | ---: |")
        for lo, hi in BUCKETS:
            k = f"{lo}" if lo == hi else f"{lo}-{hi}"
            if k in per:
                v = per[k]
                print(f"| {k} | {len(v)} | {1e3 * sum(v):.1f} | {1e3 * statistics.median(v):.3f} | "
                      f"{1e3 * max(v):.2f} |")
        slow = sorted(steps, key=lambda x: -x[1])[:5]
        print("\nslowest steps (rows, ms): " + ", ".join(f"({r}, {1e3 * s:.1f})" for r, s in slow) + "\n")
        sys.stdout.flush()
        runs.append(steps)
    steps = []  # the profiled runs below step into a list of their own, not the last timed run's
    if args.kernels and cuda:
        kernel_table(engine, prompts, params, args.kernels)
    if args.host_functions:
        host_table(engine, prompts, params, args.host_functions, sync)
    shutil.rmtree(d, ignore_errors=True)
    return runs


def kernel_table(engine, prompts, params, top: int) -> None:
    """One more run under torch.profiler: GPU time per kernel name, the `top` largest, and the total."""
    from pdserve.bench.kernel_profile import kernel_lines, profile_kernels

    kernels = profile_kernels(lambda: engine.generate(prompts, params))
    print("\n".join(kernel_lines(kernels, top)) + "\n")


def host_table(engine, prompts, params, top: int, sync) -> None:
    """One more run under cProfile: the host's time per Python function (own time, µs per step),
    the `top` largest. cProfile slows Python ~2x: read the shares, not the totals."""
    import cProfile
    import pstats

    steps = [0]
    step = engine.step

    def counted():
        steps[0] += 1
        return step()

    engine.step = counted
    prof = cProfile.Profile()
    prof.enable()
    engine.generate(prompts, params)
    sync()
    prof.disable()
    engine.step = step
    stats = pstats.Stats(prof).stats
    total = sum(v[2] for v in stats.values())
    rows = sorted(((v[2], v[1], k) for k, v in stats.items()), reverse=True)[:top]
    print(f"under cProfile: {1e6 * total / steps[0]:.0f} µs of host time per step ({steps[0]} steps)\n")
    print("| function | calls/step | own µs/step | share |\n| --- | ---: | ---: | ---: |")
    for own, calls, (path, line, name) in rows:
        where = f"{'/'.join(path.split('/')[-2:])}:{line}" if line else path
        print(f"| {name} ({where}) | {calls / steps[0]:.1f} | {1e6 * own / steps[0]:.1f} | {100 * own / total:.0f}% |")
    print()


if __name__ == "__main__":
    main()
