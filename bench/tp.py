"""Tensor-parallel benchmark (a machine with 2-4 CUDA GPUs; not a test): one model at TP=1/2/4.

    python -m pdserve.bench.tp [--tp 1 2 4] [--model llama-3.1-8b] [--out docs/benchmarks-tp.md]

Random bf16 weights in the real model's configuration (made once on cuda:0, saved as
safetensors in a temp dir, as bench/engine.py does). Per TP size, one engine
(`tensor_parallel_size=N`, CUDA graphs on, default --gpu-memory-utilization per rank):
- bs=1 decode at input 128: median ms/step over 128 steps (every step ends on the sampled id);
- offline 1024-in/128-out over `--num-prompts` prompts: output tokens/s (the scenario once
  untimed first: Triton compiles per batch mix);
- the step's all-reduces alone: 2L + 1 all-reduces of [1, hidden] bf16 (one per row-parallel
  layer, one for the embedding), captured in one CUDA graph on N fresh NCCL ranks over the same
  cards and replayed: the communication a bs=1 decode step cannot avoid;
- bf16 agreement with TP=1: greedy tokens of 4 prompts x 32 tokens (exact match per prompt,
  first divergence), and the largest |logprob difference| over the top-5 of the first token.
- each size's bf16 error against transformers in fp32 on the same weights (the first generated
  token's top-5 logprobs, and whether it is fp32's argmax): TP=1's error is the bf16 yardstick.
Random weights give flat logits (near-ties), so a greedy divergence is bf16 reduction order when
TP=N's fp32 error matches TP=1's, not a bug; the CPU fp32 tests (tests/worker/test_tensor_parallel.py) assert
exact equality.

Each TP size is one engine start (load, KV sizing, graph capture): with a per-command time
limit, run one size per command with `--checkpoint DIR` (written once, reused) and `--out`.
Without TP=1 in the same run, the agreement column has no reference.

`--smoke`: a tiny model on CPU over gloo, to check the script; it times nothing meaningful.

Debugging a hang: every rank logs at INFO (rank 0 too), `--env NCCL_DEBUG=INFO` (repeatable)
sets variables before any process group exists (the ranks inherit them), and `--timeout S`
bounds the run: past S seconds every rank prints its Python stacks (SIGUSR1 to the other
ranks) and the bench exits with code 3 and a message, instead of waiting for the 10-minute
collective timeout or the device's time limit.
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

import torch

from pdserve.bench.report import publish

DECODE_INPUT = 128
OUT_TOKENS = 128
CHECK_PROMPTS, CHECK_TOKENS, CHECK_TOPK = 4, 32, 5
ALLREDUCE_ROWS = (1, 8, 64, 512)  # messages of [rows, hidden] in the all-reduce sweep: decode bs=1 .. a prefill chunk


def _allreduce_rank(rank: int, n: int, port: int, hidden: int, rows: list[int], count: int, device: str, iters: int,
                    method: str, out) -> None:
    """One rank of the all-reduce micro-benchmark: per message of [rows, hidden], `count`
    all-reduces as one step (one CUDA graph), through the worker's own communicator
    (parallel/communicator.py) forced to `method`."""
    import torch.distributed as dist

    from pdserve.worker.parallel import communicator
    from pdserve.worker.parallel.group import init_tensor_parallel, shutdown_tensor_parallel

    os.environ["PDSERVE_TP_ALL_REDUCE"] = method
    cuda = device == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    # As the worker does: set_device, process group, first barrier, then the communicator.
    init_tensor_parallel(rank, n, dev, port)
    comm = communicator._current
    dtype = torch.bfloat16 if cuda else torch.float32
    result = {}
    for m in rows:
        # Correctness on the way: small integers sum exactly in bf16, whatever the order.
        base = (torch.arange(m * hidden, device=dev) % 7).to(dtype).view(m, hidden)
        y = comm.all_reduce(base + rank)
        want = base * n + n * (n - 1) // 2
        if not torch.equal(y, want):
            raise AssertionError(f"{comm.method(y)} all-reduce of [{m}, {hidden}] over {n} ranks is wrong")
        x = torch.ones(m, hidden, dtype=dtype, device=dev)
        used = comm.method(x)

        def step():
            for _ in range(count):
                comm.all_reduce(x)

        for _ in range(3):
            step()
        how = "eager"
        if cuda:
            torch.cuda.synchronize()
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                run, how = graph.replay, "CUDA graph"
            except Exception as e:  # report eager timings rather than nothing
                print(f"all-reduce capture failed ({e}); timing eager launches", file=sys.stderr)
                run = step
            run()
            torch.cuda.synchronize()
            dist.barrier(device_ids=[dev.index])
            t0 = time.perf_counter()
            for _ in range(iters):
                run()
            torch.cuda.synchronize()
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
        result[m] = ((time.perf_counter() - t0) / iters, f"{used}, {how}")
        dist.barrier()
    if rank == 0:
        out.put(result)
    shutdown_tensor_parallel()  # bounded: NCCL's destroy hung this process on 2x H100


def allreduce_ms_per_step(n: int, hidden: int, layers: int, device: str, iters: int, method: str = "nccl",
                          rows: tuple[int, ...] = (1,)) -> dict[int, tuple[float, str]]:
    """{rows: (ms for the 2L+1 all-reduces of [rows, hidden], "method, how")}."""
    import queue

    import torch.distributed as dist
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, n, is_master=True, wait_for_workers=False)  # on a free port
    procs = [ctx.Process(target=_allreduce_rank,
                         args=(r, n, store.port, hidden, list(rows), 2 * layers + 1, device, iters, method, out))
             for r in range(n)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 300
    while True:  # a rank that died (e.g. the symmetric op failed) ends the wait at once
        try:
            result = out.get(timeout=2)
            break
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"all-reduce bench ({method}, TP={n}): " + (
                    f"rank exited with code {dead[0].exitcode}" if dead else "no result in 300 s"))
    for p in procs:
        p.join(60)
    return {m: (1e3 * sec, how) for m, (sec, how) in result.items()}


def write_checkpoint(spec, device: str, path: str | None = None) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from pdserve.bench.engine import save_tokenizer

    if path is not None and os.path.exists(os.path.join(path, "config.json")):
        return path  # made by an earlier run (--checkpoint)
    cfg = (LlamaConfig if spec.arch == "llama" else Qwen2Config)(**spec.hf, bos_token_id=1, eos_token_id=2)
    tmp = path or tempfile.mkdtemp(prefix="pdserve-bench-tp-")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    model.save_pretrained(tmp)
    save_tokenizer(tmp)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return tmp


def decode_ms(engine, prompt: list[int], steps: int) -> float:
    from pdserve.bench.engine import decode_step_seconds

    return 1e3 * statistics.median(decode_step_seconds(engine, prompt, steps))


def greedy_with_logprobs(engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[dict[int, float]]]:
    """Greedy tokens per prompt and the top-k logprobs of each prompt's first generated token."""
    from pdserve.worker.request.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=CHECK_TOKENS, temperature=0.0, ignore_eos=True, logprobs=CHECK_TOPK)
    tokens, firsts = {}, {}
    for i, p in enumerate(prompts):
        engine.add_request(f"c{i}", p, params)
    while engine.has_work():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.logprobs and o.request_id not in firsts:
                firsts[o.request_id] = dict(o.logprobs[0].top)
    ids = [f"c{i}" for i in range(len(prompts))]
    return [tokens[i] for i in ids], [firsts[i] for i in ids]


def run_tp(n: int, path: str, args, vocab: int) -> dict:
    from pdserve.worker.config.engine import EngineConfig
    from pdserve.worker.engine.llm_engine import LLMEngine
    from pdserve.worker.request.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model=path,
            device=args.device,
            dtype="bfloat16" if args.device == "cuda" else "float32",
            # No offline run: a small batch limit captures fewer decode graphs (a faster start).
            max_model_len=2048,
            max_num_seqs=256 if args.num_prompts else 8,
            max_num_batched_tokens=16384,
            enable_prefix_caching=False,
            tensor_parallel_size=n,
            enforce_eager=args.enforce_eager,
            async_scheduling=args.async_scheduling,
            kv_cache_memory=None if args.device == "cuda" else 1 << 26,
        )
    )
    start_s = time.perf_counter() - t0
    print(f"TP={n}: engine started in {start_s:.0f}s", flush=True)
    rng = random.Random(7)
    res = {"tp": n, "start_s": start_s, "kv_blocks": engine.block_manager.num_blocks,
           "graphs": engine.runner.graphs is not None}
    try:
        prompt = [rng.randrange(3, vocab) for _ in range(DECODE_INPUT)]
        decode_ms(engine, prompt, 8)  # warm-up
        print(f"TP={n}: first steps done (decode warm-up)", flush=True)
        res["decode_ms"] = decode_ms(engine, prompt, args.decode_steps)
        if args.profile:
            from pdserve.bench.engine import profile_decode

            name = f"tp{n}-{os.environ.get('PDSERVE_TP_ALL_REDUCE', 'nccl') if n > 1 else 'single'}.md"
            res["profile_gpu_ms"] = profile_decode(engine, prompt, os.path.join(args.profile, name), 32,
                                                   f"TP={n} bs=1 decode (rank 0)")
            print(f"TP={n}: profile {name}: GPU {res['profile_gpu_ms']:.3f} ms/step", flush=True)
        if args.num_prompts:
            prompts = [[rng.randrange(3, vocab) for _ in range(1024)] for _ in range(args.num_prompts)]
            params = SamplingParams(max_tokens=OUT_TOKENS, temperature=0.0, ignore_eos=True)
            engine.generate(prompts, params)  # warm-up: the same batch mix compiles the same kernels
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params)
            res["offline_tok_s"] = sum(len(o) for o in outs) / (time.perf_counter() - t0)
        check = [[rng.randrange(3, vocab) for _ in range(24 + 8 * i)] for i in range(CHECK_PROMPTS)]
        res["greedy"], res["top"] = greedy_with_logprobs(engine, check)
        res["check"] = check
    except BaseException:
        # Printed before shutdown: a shutdown that hangs must not hide why the run stopped.
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        raise
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return res


def fp32_reference(path: str, prompts: list[list[int]], device: str) -> list[torch.Tensor]:
    """Next-token logprobs of each prompt from transformers in fp32 on the same weights: the yardstick
    for every TP size's bf16 error (random weights' flat logits make bf16 greedy ties common)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 device_map="cuda:0" if device == "cuda" else None)
    out = []
    with torch.no_grad():
        for p in prompts:
            logits = model(torch.tensor([p], device=model.device)).logits[0, -1].float()
            out.append(torch.log_softmax(logits, -1).cpu())
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def fp32_error(r: dict, ref: list[torch.Tensor]) -> str:
    """max |logprob - fp32| over each prompt's engine top-k, and how often the first greedy token is
    fp32's argmax."""
    err = max(abs(lp - ref[i][t].item()) for i, top in enumerate(r["top"]) for t, lp in top.items())
    same = sum(g[0] == int(ref[i].argmax()) for i, g in enumerate(r["greedy"]))
    return f"{err:.3f}; first token = fp32 argmax {same}/{len(ref)}"


def agreement(ref: dict, other: dict) -> str:
    exact = sum(a == b for a, b in zip(ref["greedy"], other["greedy"]))
    firsts = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
              for a, b in zip(ref["greedy"], other["greedy"])]
    div = ", ".join("-" if f is None else str(f) for f in firsts)
    diffs = [abs(lp - o[t]) for r, o in zip(ref["top"], other["top"]) for t, lp in r.items() if t in o]
    top_same = sum(set(r) == set(o) for r, o in zip(ref["top"], other["top"]))
    return (f"{exact}/{len(firsts)} exact (first divergence: {div}); top-{CHECK_TOPK} sets equal {top_same}/"
            f"{len(firsts)}, max |dlogprob| {max(diffs, default=float('nan')):.3f}")


EXIT_TIMEOUT = 3


def arm_timeout(seconds: float) -> None:
    """Past `seconds`: every rank's stacks, then exit EXIT_TIMEOUT with a message. Two layers:
    a Python timer (can signal the other ranks, needs the GIL) and faulthandler's C thread
    (10 s later; dumps and exits even if the main thread holds the GIL inside a CUDA call)."""
    import faulthandler
    import multiprocessing
    import signal
    import threading

    def fire():
        ranks = multiprocessing.active_children()  # the TP ranks (and all-reduce bench ranks)
        print(f"pdserve bench tp: no result after {seconds:.0f}s (--timeout); stacks of rank 0 and of "
              f"pids {[p.pid for p in ranks]} follow, then exit {EXIT_TIMEOUT}", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        for p in ranks:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except OSError:
                pass
        time.sleep(3)  # their dumps reach stderr
        for p in ranks:
            p.kill()
        os._exit(EXIT_TIMEOUT)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(seconds + 10, exit=True)


def main(argv=None) -> int:
    import logging

    from pdserve.bench.model_shapes import MODELS

    ap = argparse.ArgumentParser(prog="pdserve bench tp", description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4], help="TP sizes (1 first: the reference)")
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS))
    ap.add_argument("--num-prompts", type=int, default=256, help="offline 1024/128 prompts (0: no offline run)")
    ap.add_argument("--all-reduce", nargs="+", default=["nccl"], choices=["auto", "nccl", "one_shot", "two_shot"],
                    help="the TP all-reduce (PDSERVE_TP_ALL_REDUCE) of each TP>1 engine and micro-benchmark; "
                         "several: one engine per method, compared in the same run")
    ap.add_argument("--no-fp32-check", action="store_true", help="skip the transformers fp32 reference")
    ap.add_argument("--decode-steps", type=int, default=128)
    ap.add_argument("--out", help="also write the markdown table here")
    ap.add_argument("--checkpoint", help="keep the random checkpoint here and reuse it on the next run "
                                         "(one TP size per command fits a short per-command time limit)")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="no decode CUDA graphs (if capturing the all-reduces fails on this machine)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="every engine with --async-scheduling (under TP rank 0 broadcasts the sampled ids)")
    ap.add_argument("--profile", metavar="DIR", help="also profile 32 bs=1 decode steps per engine (rank 0's "
                                                  "kernels): one markdown table per TP size and all-reduce in DIR")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU over gloo: checks the script only")
    ap.add_argument("--timeout", type=float, default=None, metavar="S",
                    help="give up after S seconds: print every rank's stacks and exit 3 (a hang then ends "
                         "with a message)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="set before any process group starts, inherited by every rank (repeatable), e.g. "
                         "--env NCCL_DEBUG=INFO --env TORCH_DISTRIBUTED_DEBUG=DETAIL")
    args = ap.parse_args(argv)
    for kv in args.env:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            ap.error(f"--env: expected KEY=VALUE, got {kv!r}")
        os.environ[key] = value
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [tp rank 0] %(name)s: %(message)s")
    if args.timeout is not None:
        if args.timeout <= 0:
            ap.error("--timeout: must be > 0 seconds")
        arm_timeout(args.timeout)
    args.device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.model, args.num_prompts, args.decode_steps = "tiny-llama", 4, 8
    elif not torch.cuda.is_available():
        print("pdserve bench tp: needs CUDA GPUs (none visible); --smoke runs a CPU check", file=sys.stderr)
        return 2
    sizes = sorted(set(args.tp))
    if not args.smoke and max(sizes) > torch.cuda.device_count():
        sizes = [n for n in sizes if n <= torch.cuda.device_count()]
        print(f"only {torch.cuda.device_count()} GPUs visible: TP sizes {sizes}", file=sys.stderr)
    spec = MODELS[args.model]
    t0 = time.perf_counter()
    path = write_checkpoint(spec, args.device, args.checkpoint)
    print(f"checkpoint {path} ready in {time.perf_counter() - t0:.0f}s", flush=True)
    results = []
    try:
        for n in sizes:
            for method in (["-"] if n == 1 else args.all_reduce):
                print(f"== TP={n} all-reduce {method}", flush=True)
                if n > 1:
                    os.environ["PDSERVE_TP_ALL_REDUCE"] = method  # the ranks inherit it
                r = run_tp(n, path, args, spec.hf["vocab_size"])
                r["all_reduce"] = method
                if n > 1:
                    sweep = allreduce_ms_per_step(n, spec.hf["hidden_size"], spec.hf["num_hidden_layers"],
                                                  args.device, 20 if args.smoke else 200, method, ALLREDUCE_ROWS)
                    r["allreduce_ms"], r["allreduce_how"] = sweep[1]
                    r["allreduce_sweep"] = {str(m): v for m, v in sweep.items()}
                results.append(r)
                # A row as soon as it exists: a run cut short by a time limit still leaves its numbers.
                print(f"RESULT TP={n} all-reduce={method} decode_ms={r.get('decode_ms')} "
                      f"offline_tok_s={r.get('offline_tok_s')} step_allreduce_ms={r.get('allreduce_ms')} "
                      f"sweep={r.get('allreduce_sweep')} start_s={r['start_s']:.0f}", flush=True)
        if not args.no_fp32_check:
            t0 = time.perf_counter()
            ref32 = fp32_reference(path, results[0]["check"], args.device) if results else []
            for r in results:
                r["vs_fp32"] = fp32_error(r, ref32)
            print(f"fp32 reference in {time.perf_counter() - t0:.0f}s", flush=True)
    finally:
        if args.checkpoint is None:
            shutil.rmtree(path, ignore_errors=True)
    if args.checkpoint is not None:
        # Runs of one TP size each add up: earlier sizes (and TP=1's reference outputs) are kept.
        import json

        saved = os.path.join(args.checkpoint, "bench_tp_results.json")
        old = json.load(open(saved)) if os.path.exists(saved) else []
        results = sorted(
            [r for r in old if r["tp"] not in sizes] + results, key=lambda r: (r["tp"], r.get("all_reduce", "-"))
        )
        with open(saved, "w") as f:
            json.dump(results, f)
        for r in results:
            r["top"] = [{int(t): lp for t, lp in top.items()} for top in r["top"]]  # json keys are strings
        sizes = [r["tp"] for r in results]
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (smoke run, gloo)"
    lines = [
        f"{spec.name} (random weights) · {name} x {max(sizes)} · torch {torch.__version__} · "
        f"{datetime.date.today()} · {'bf16' if args.device == 'cuda' else 'fp32'} · "
        f"{'eager' if args.enforce_eager else 'decode CUDA graphs'}"
        f"{' · async scheduling' if args.async_scheduling else ''}",
        "",
        "| TP | all-reduce | bs=1 decode in=128 ms/step (x TP=1) | all-reduces of that step alone (2L+1 at bs=1) ms "
        "| per all-reduce us | offline 1024/128 tok/s "
        f"({args.num_prompts} prompts) | KV blocks per rank | greedy vs TP=1 | first token's top-5 "
        "logprobs vs fp32 transformers: max abs error |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    ref = results[0] if results and results[0]["tp"] == 1 else None
    steps = 2 * spec.hf["num_hidden_layers"] + 1
    for r in results:
        ar = f"{r['allreduce_ms']:.3f} ({r['allreduce_how']})" if "allreduce_ms" in r else "-"
        per = f"{1e3 * r['allreduce_ms'] / steps:.1f}" if "allreduce_ms" in r else "-"
        agree = "(reference)" if r is ref else agreement(ref, r) if ref is not None else "- (no TP=1 run)"
        rel = f" ({r['decode_ms'] / ref['decode_ms']:.2f}x)" if ref is not None and r is not ref else ""
        tok = f"{r['offline_tok_s']:.0f}" if "offline_tok_s" in r else "-"
        lines.append(f"| {r['tp']} | {r.get('all_reduce', '-')} | {r['decode_ms']:.2f}{rel} | {ar} | {per} | {tok} | "
                     f"{r['kv_blocks']} | {agree} | {r.get('vs_fp32', '-')} |")
    swept = [r for r in results if "allreduce_sweep" in r]
    if swept:
        hidden = spec.hf["hidden_size"]
        lines += [
            "",
            f"All-reduce alone, us per all-reduce of [rows, {hidden}] "
            f"({'bf16' if args.device == 'cuda' else 'fp32'}; {steps} in one CUDA graph, replayed; "
            "the method each message took):",
            "",
            "| TP | all-reduce | "
            + " | ".join(
                f"{m} rows ({m * hidden * (2 if args.device == 'cuda' else 4) // 1024} KB)" for m in ALLREDUCE_ROWS
            )
            + " |",
            "| ---: | --- |" + " ---: |" * len(ALLREDUCE_ROWS),
        ]
        for r in swept:
            cells = []
            for m in ALLREDUCE_ROWS:
                ms, how = r["allreduce_sweep"][str(m)]
                cells.append(f"{1e3 * ms / steps:.1f} ({how.split(',')[0]})")
            lines.append(f"| {r['tp']} | {r['all_reduce']} | " + " | ".join(cells) + " |")
    lines += ["", "- engine start (load, KV sizing, graph capture): "
                  + ", ".join(f"TP={r['tp']} {r['start_s']:.0f}s" for r in results)]
    text = "\n".join(lines)
    publish(text, args.out)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
