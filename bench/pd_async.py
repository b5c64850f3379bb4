"""P/D under --async-scheduling against synchronous P/D and an aggregated engine (same run, same card).

    python -m pdserve.bench.pd_async [--model llama-3.1-8b] [--prompt 3000] [--output 64] [--requests 5]
                                     [--chunk 512] [--split tail] [--out FILE]
    python -m pdserve.bench.pd_async --smoke      # CPU, tiny model: checks the script, times nothing real

Four modes, each in a process of its own (an engine's device memory is not all returned at
shutdown): an aggregated engine (no KV transfer) synchronous and with --async-scheduling, and a
prefill + a decode engine synchronous and with the flag on both. The P/D pair runs on cuda:0 and
cuda:1 when two GPUs are visible (else both on one card, half its memory each), NIXL between
them (TCP without the nixl extra), the streamed hand-off (--kv-stream-chunk-tokens --chunk,
--kv-stream-split --split). Every engine is stepped by a thread of its own, as the server's
async layer does. Requests run one at a time (one warm-up first), greedy, random prompt tokens:

- TTFT: the request's arrival to its first token (P/D: the prefill engine's final output);
- first gap (P/D): that first token to the decode engine's first token of its own;
- ITL: the median gap between the later tokens.

The row of each mode says whether its tokens equal the synchronous aggregated engine's. This
isolates what async scheduling changes in the engines (the launch gap between a prefill's
chunks, the host time between decode steps); the HTTP stack is measured by bench/handoff.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from pdserve.bench.ports import free_ports
from pdserve.bench.report import publish

MODES = ("agg-sync", "pd-sync", "pd-async", "agg-async")  # the reference first; what matters most next



class Stepper:
    """Steps one engine on its own thread; every output is queued with its wall time."""

    def __init__(self, engine):
        self.engine, self.outputs, self._stop = engine, queue.Queue(), threading.Event()
        self._error = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        e = self.engine
        try:
            while not self._stop.is_set():
                if e.has_work() or e.has_pins:
                    for o in e.step():
                        self.outputs.put((time.perf_counter(), o))
                else:
                    time.sleep(0.0002)
        except BaseException as exc:  # surfaced by next()
            self._error = exc

    def next(self, timeout: float = 300.0):
        deadline = time.monotonic() + timeout
        while True:
            if self._error is not None:
                raise RuntimeError("engine step failed") from self._error
            try:
                return self.outputs.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError("no engine output") from None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


def _config(args, ckpt: str, device: str, role: str, asyn: bool, share: float):
    from pdserve.worker.config.engine import EngineConfig

    kw = dict(model=ckpt, device=device, role=role, async_scheduling=asyn,
              max_model_len=args.prompt + args.output + 64, max_num_batched_tokens=args.budget)
    if device == "cpu":
        kw.update(kv_cache_memory=64 << 20)
    else:
        kw.update(gpu_memory_utilization=share)
    if role != "both":
        from pdserve.worker.kv.nixl_transport import nixl_available

        kw.update(kv_transfer="nixl" if nixl_available() and device != "cpu" else "tcp", kv_port=free_ports(),
                  kv_peer_allow=("127.0.0.1",), kv_secret="bench-pd-async-secret",
                  kv_stream_chunk_tokens=args.chunk, kv_stream_split=args.split)
    return EngineConfig(**kw)


def _tokens_until_done(stepper: Stepper, rid: str, times: list[float], tokens: list[int]) -> None:
    while True:
        t, o = stepper.next()
        if o.request_id != rid:
            continue
        for tok in o.new_token_ids:
            times.append(t)
            tokens.append(tok)
        if o.finished:
            return


def run_mode(args, ckpt: str, mode: str) -> dict:
    from pdserve.worker.engine.llm_engine import LLMEngine
    from pdserve.worker.request.sampling_params import SamplingParams

    device = "cpu" if args.smoke else "cuda"
    asyn = mode.endswith("async")
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 30000 if not args.smoke else 400) for _ in range(args.prompt)]
               for _ in range(args.requests + 1)]
    rows = []
    if mode.startswith("agg"):
        engine = LLMEngine(_config(args, ckpt, "cuda:0" if device == "cuda" else device, "both", asyn, 0.85))
        on = engine.async_scheduling
        s = Stepper(engine)
        try:
            for i, prompt in enumerate(prompts):
                t0 = time.perf_counter()
                engine.add_request(f"r{i}", prompt, params)
                times, tokens = [], []
                _tokens_until_done(s, f"r{i}", times, tokens)
                rows.append({"ttft": times[0] - t0, "gaps": [b - a for a, b in zip(times, times[1:])],
                             "tokens": tokens})
        finally:
            s.stop()
            engine.shutdown()
    else:
        two = device == "cuda" and torch.cuda.device_count() >= 2
        p_dev, d_dev = ("cuda:0", "cuda:1") if two else (("cuda:0", "cuda:0") if device == "cuda" else ("cpu", "cpu"))
        share = 0.85 if two else 0.42
        p = LLMEngine(_config(args, ckpt, p_dev, "prefill", asyn, share))
        d = LLMEngine(_config(args, ckpt, d_dev, "decode", asyn, share))
        on = p.async_scheduling and d.async_scheduling
        sp, sd = Stepper(p), Stepper(d)
        try:
            for i, prompt in enumerate(prompts):
                t0 = time.perf_counter()
                p.add_request(f"p{i}", prompt, params, {"do_remote_decode": True, "stream_kv": True})
                first, t_first, announced = None, None, False
                while first is None:
                    t, o = sp.next()
                    if o.request_id != f"p{i}":
                        continue
                    if o.kv_transfer_params and not announced and not o.finished:
                        announced = True  # the streamed params, before the first chunk ran: open the decode
                        d.add_request(f"d{i}", prompt, params, o.kv_transfer_params)
                    if o.finished:
                        first, t_first = o.new_token_ids[0], t
                assert announced, "the prefill engine announced no streamed hand-off"
                times, tokens = [], []
                _tokens_until_done(sd, f"d{i}", times, tokens)
                rows.append({"ttft": t_first - t0, "first_gap": times[0] - t_first,
                             "gaps": [b - a for a, b in zip(times, times[1:])], "tokens": [first] + tokens,
                             "transport": p.kv_connector.transport})
        finally:
            sp.stop()
            sd.stop()
            p.shutdown()
            d.shutdown()
    rows = rows[1:]  # the warm-up
    out = {"mode": mode, "on": on, "ttft_ms": [1e3 * r["ttft"] for r in rows],
           "itl_ms": 1e3 * statistics.median(g for r in rows for g in r["gaps"]),
           "tokens": [r["tokens"] for r in rows]}
    if "first_gap" in rows[0]:
        out["first_gap_ms"] = [1e3 * r["first_gap"] for r in rows]
        out["transport"] = rows[0]["transport"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench pd-async", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--prompt", type=int, default=3000, help="prompt tokens (default 3000)")
    ap.add_argument("--output", type=int, default=64, help="output tokens (default 64)")
    ap.add_argument("--requests", type=int, default=5, help="timed requests per mode, after one warm-up")
    ap.add_argument("--chunk", type=int, default=512, help="--kv-stream-chunk-tokens (default 512)")
    ap.add_argument("--split", default="tail", choices=("tail", "even"), help="--kv-stream-split (default tail)")
    ap.add_argument("--budget", type=int, default=8704, help="--max-num-batched-tokens (default 8704)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"subset of {','.join(MODES)}")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script")
    ap.add_argument("--out", help="also write the markdown table to this file")
    ap.add_argument("--checkpoint", help="write the random checkpoint here, or reuse it (kept afterwards)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one mode, print its JSON
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.model, args.prompt, args.output, args.requests, args.chunk, args.budget = "tiny-llama", 96, 8, 2, 32, 256
    if args.one:
        print("RESULT " + json.dumps(run_mode(args, args.ckpt, args.one)), flush=True)
        return 0
    from pdserve.bench.model_shapes import MODELS
    from pdserve.bench.tp import write_checkpoint

    modes = args.modes.split(",")
    if args.model not in MODELS or any(m not in MODES for m in modes):
        print(f"pd-async: --model one of {sorted(MODELS)}, --modes of {MODES}", file=sys.stderr)
        return 2
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("pd-async: needs a CUDA GPU (none visible); --smoke runs the CPU check", file=sys.stderr)
        return 2
    card = (f"{torch.cuda.get_device_name()} x{min(2, torch.cuda.device_count())}" if device == "cuda"
            else "CPU (smoke: no overlap to gain)")
    spec = MODELS[args.model]
    header = (f"{card} · torch {torch.__version__} · {datetime.date.today()} · {spec.name} "
              f"{'bf16' if device == 'cuda' else 'fp32'} · {args.prompt} in / {args.output} out, greedy, one at a "
              f"time, {args.requests} requests per mode · streamed hand-off, chunk {args.chunk} ({args.split}) · "
              f"budget {args.budget}")
    print(header, flush=True)
    ckpt = write_checkpoint(spec, device, args.checkpoint)
    lines = ["| mode | flag on | TTFT p50 ms (min-max) | first gap p50 ms | ITL p50 ms | same tokens as agg-sync |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    ref = None

    def run_one(mode: str) -> tuple[subprocess.CompletedProcess, float]:
        cmd = [sys.executable, "-m", "pdserve.bench.pd_async", *(argv if argv is not None else sys.argv[1:]),
               "--one", mode, "--ckpt", ckpt]
        # Side by side (the smoke run), each computes on one thread: torch's default of one per
        # core would put several threads per core, each op's barrier waiting on a preempted one.
        env = {**os.environ, "OMP_NUM_THREADS": "1"} if args.smoke else None
        t = time.monotonic()
        return subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env), time.monotonic() - t

    # A real run times one mode at a time (they would share the card). The smoke run times nothing
    # and its processes are mostly start-up (imports, engine build): side by side they overlap.
    try:
        with ThreadPoolExecutor(len(modes) if args.smoke else 1) as pool:
            for mode, (proc, took) in zip(modes, pool.map(run_one, modes)):
                res = next((json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")),
                           None)
                if res is None:
                    lines.append(f"| {mode} | failed (rc {proc.returncode}) | | | | |")
                    print(lines[-1], "\n", proc.stderr[-3000:], flush=True)
                    continue
                ref = res["tokens"] if ref is None and mode == "agg-sync" else ref
                same = "" if ref is None or mode == "agg-sync" else "yes" if res["tokens"] == ref else "**NO**"
                ttft = res["ttft_ms"]
                gap = f"{statistics.median(res['first_gap_ms']):.1f}" if "first_gap_ms" in res else ""
                name = mode + (f" ({res['transport']})" if "transport" in res else "")
                lines.append(f"| {name} | {'yes' if res['on'] else 'no'} | {statistics.median(ttft):.1f} "
                             f"({min(ttft):.1f}-{max(ttft):.1f}) | {gap} | {res['itl_ms']:.2f} | {same} |")
                print(lines[-1], f"  [{took:.0f}s]", flush=True)
    finally:
        if not args.checkpoint:
            shutil.rmtree(ckpt, ignore_errors=True)
    publish("\n".join([header, "", *lines]), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
