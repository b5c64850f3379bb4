"""Host time per decode step, synchronous engine against --async-scheduling (same run, same card).

    python -m pdserve.bench.step_overlap [--models qwen2.5-0.5b] [--batch 1 8] [--steps 200] [--out FILE]
    python -m pdserve.bench.step_overlap --smoke      # CPU, tiny model: checks the script, times nothing real

For each model (random bf16 weights in the real configuration, saved once to a temp dir) and
batch size, each mode builds an engine, starts `batch` greedy requests, lets them reach steady
decode, then measures `--steps` consecutive `engine.step()` calls twice: once for wall time,
once under the profiler for device time (the sum of the step's kernel and copy times on the
GPU; on CPU one window, timing the forward and sampling inside it). Host time per step = wall − device: what
the GPU waits for the host. Synchronous, the
host schedules, prepares, launches, waits, reads the tokens back and builds outputs one after
the other; with async scheduling it does all but the launch while the GPU runs the previous
step, so wall time should approach device time. Each engine then generates greedy tokens for four
prompts of mixed lengths; the async row says whether they equal the synchronous engine's.

On CPU ("device" work is the forward and sampling, run on the host) there is no overlap to
gain: host time is the engine's bookkeeping around the model, printed to check the script.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import shutil
import sys
import time

import torch

from pdserve.bench.report import publish

WARMUP_STEPS = 8


def make_checkpoint(spec, device: str) -> str:
    """Random weights in the spec's real configuration, in a temporary folder (bench/tp.py's)."""
    from pdserve.bench.tp import write_checkpoint

    return write_checkpoint(spec, device)


class DeviceTimer:
    """Device seconds spent in a window of steps: CUDA kernel and copy times from the profiler;
    on CPU the time inside the model runner's forward and sampling (the CPU is the device)."""

    def __init__(self, engine):
        self.engine, self.cuda = engine, engine.device.type == "cuda"

    def measure(self, fn) -> float:
        if self.cuda:
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            us = 0.0
            for e in prof.key_averages():
                t = getattr(e, "self_device_time_total", None)
                us += t if t is not None else getattr(e, "self_cuda_time_total", 0.0)
            return us / 1e6
        runner = self.engine.runner
        spent = [0.0]
        execute, sample = runner.execute, runner.sampler.sample

        def timed(f):
            def run(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return f(*a, **kw)
                finally:
                    spent[0] += time.perf_counter() - t0
            return run

        runner.execute, runner.sampler.sample = timed(execute), timed(sample)
        try:
            fn()
        finally:
            runner.execute, runner.sampler.sample = execute, sample
        return spent[0]


def measure(ckpt: str, device: str, batch: int, steps: int, async_scheduling: bool) -> dict:
    from pdserve.worker.config.engine import EngineConfig
    from pdserve.worker.engine.llm_engine import LLMEngine
    from pdserve.worker.request.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=ckpt, device=device, max_model_len=1024, max_num_seqs=max(8, batch),
                                    gpu_memory_utilization=0.5, async_scheduling=async_scheduling))
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=WARMUP_STEPS + 2 * steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [(7 * i + j) % (vocab - 10) + 10 for j in range(128)], params)
    for _ in range(WARMUP_STEPS):
        engine.step()

    def window():
        for _ in range(steps):
            engine.step()

    timer = DeviceTimer(engine)
    if device == "cuda":  # the profiler costs host time: wall time from a window of its own
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        window()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
        dev = timer.measure(window) / steps
    else:  # the same window: on a shared CPU two windows differ by more than what is measured
        t0 = time.perf_counter()
        dev = timer.measure(window) / steps
        wall = (time.perf_counter() - t0) / steps
    while engine.has_work():  # the timed requests run out
        engine.step()
    # The two engines must agree (greedy, mixed lengths): checked here, on whatever card this runs on.
    tokens = engine.generate([[(13 * i + j) % (vocab - 10) + 10 for j in range(5 + 9 * i)] for i in range(4)],
                             SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    row = dict(wall=wall, device=dev, overlapped=engine.num_overlapped_steps, on=engine.async_scheduling,
               tokens=tokens)
    engine.shutdown()
    del engine
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def measure_alone(ckpt: str, device: str, batch: int, steps: int, async_scheduling: bool) -> dict:
    """measure() in a process of its own on CUDA: an engine's memory (CUDA graphs' pools, the
    profiler's references) is not all returned when it shuts down, and the next engine's
    --gpu-memory-utilization budget counts what the device already holds (on an H200 the second
    engine found room for -5436 blocks)."""
    if device != "cuda":
        return measure(ckpt, device, batch, steps, async_scheduling)
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure, (ckpt, device, batch, steps, async_scheduling))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench step-overlap", description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["qwen2.5-0.5b"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="concurrent decodes (default 1 8)")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per mode (default 200)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script")
    ap.add_argument("--out", help="also write the markdown table to this file")
    args = ap.parse_args(argv)
    from pdserve.bench.model_shapes import MODELS

    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        print(f"step-overlap: --models: unknown {unknown}; choose from {sorted(MODELS)}", file=sys.stderr)
        return 2
    if args.steps < 1 or min(args.batch) < 1:
        print("step-overlap: --steps and --batch must be positive", file=sys.stderr)
        return 2
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("step-overlap: needs a CUDA GPU (none visible); --smoke runs the CPU check", file=sys.stderr)
        return 2
    models = ["tiny-llama"] if args.smoke else args.models
    card = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke: no overlap to gain)"
    header = (f"{card} · torch {torch.__version__} · {datetime.date.today()} · "
              f"{'bf16' if device == 'cuda' else 'fp32'} · greedy decode at context 128+, {args.steps} steps per row")
    print(header, flush=True)
    lines = [
        "| model | batch | engine | wall ms/step | device ms/step | host ms/step (wall − device) | "
        "vs sync host time | same greedy tokens as sync |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for key in models:
        spec = MODELS[key]
        ckpt = make_checkpoint(spec, device)
        try:
            for bs in args.batch:
                base, ref = None, None
                for mode in (False, True):
                    r = measure_alone(ckpt, device, bs, args.steps, mode)
                    host = r["wall"] - r["device"]
                    base = host if base is None else base
                    name = "async scheduling" if mode else "synchronous (baseline)"
                    if mode and not r["on"]:
                        name += " (flag ignored)"
                    ratio = "" if not mode else f"{host / base:.2f}×" if base > 0 else "n/a"
                    ref = r["tokens"] if ref is None else ref
                    same = "" if not mode else "yes" if r["tokens"] == ref else "**NO**"
                    lines.append(f"| {spec.name} | {bs} | {name} | {1e3 * r['wall']:.3f} | {1e3 * r['device']:.3f} | "
                                 f"{1e3 * host:.3f} | {ratio} | {same} |")
                    print(lines[-1], flush=True)
        finally:
            shutil.rmtree(ckpt, ignore_errors=True)
    publish("\n".join([header, "", *lines]), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
