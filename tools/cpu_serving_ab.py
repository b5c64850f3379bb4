"""A/B of CPU serving: two `pdserve worker`s (two source trees) side by side, runs alternating.

    python tools/cpu_serving_ab.py --base /work/main --change . --out /tmp/ab [--rounds 2]

Each tree's own `.venv/bin/pdserve worker --device cpu --dtype bfloat16` serves the default model
(SmolLM2-135M-Instruct); both start once, one after the other (each ready on /health), then every
workload runs `pdserve bench serve` (256-token prompts, 128 out, completions, `ignore_eos`)
against base, change, base, change, ... For each run it records, besides the client's ITL /
TTFT / output tok/s, the worker's CPU time (user + sys of the process and its children, psutil)
per output token: the number least moved by other work on a shared machine. Prints a markdown
table and writes every run's JSON under --out. `--starts N` only times N alternating starts, each
worker alone.

`--vllm VENV` adds a third side: vLLM's OpenAI server from that virtual environment (a benchmark
peer installed apart from pdserve, e.g. PyPI's CPU build), serving the same checkpoint in bf16 under
the same name; its runs alternate with the other two and its rows are read against the change's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

import psutil

from pdserve.worker.models.default_model import cache_dir

WORKLOADS = {  # name: (concurrency, requests per run)
    "1 stream": (1, 8),
    "8 concurrent": (8, 16),
    "32 concurrent": (32, 64),
}


def cpu_seconds(pid: int) -> float:
    p = psutil.Process(pid)
    procs = [p, *p.children(recursive=True)]
    total = 0.0
    for q in procs:
        try:
            t = q.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def wait_ready(port: int, proc: subprocess.Popen, limit: float = 300.0) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"worker on :{port} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"worker on :{port} not ready in {limit}s")


def peak_rss(pid: int) -> int:
    """VmHWM (peak resident bytes) summed over the process and its children (vLLM runs its engine
    in a child process)."""
    total = 0
    p = psutil.Process(pid)
    for q in [p, *p.children(recursive=True)]:
        try:
            with open(f"/proc/{q.pid}/status") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
        except (OSError, StopIteration):
            pass
    return total


VLLM_MEMORY = "0.12"  # vLLM's CPU backend takes this share of host memory (weights + KV); --vllm-memory


def command(tree: str, port: int) -> list[str]:
    if tree.startswith("vllm:"):
        venv = tree[len("vllm:"):]
        return [os.path.join(venv, "bin/python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
                str(cache_dir()), "--served-model-name", "SmolLM2-135M-Instruct", "--dtype", "bfloat16",
                "--gpu-memory-utilization", VLLM_MEMORY, "--port", str(port)]
    return [os.path.join(tree, ".venv/bin/pdserve"), "worker", "--device", "cpu", "--dtype", "bfloat16",
            "--port", str(port)]


def start(tree: str, port: int, log: str, env: dict) -> tuple[subprocess.Popen, float]:
    t0 = time.monotonic()
    proc = subprocess.Popen(
        command(tree, port),
        cwd=tree if not tree.startswith("vllm:") else "/",
        env=env,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )
    wait_ready(port, proc, 900.0 if tree.startswith("vllm:") else 300.0)
    return proc, time.monotonic() - t0


def bench(client: str, port: int, conc: int, n: int, seed: int, out: str, label: str) -> dict:
    subprocess.run(
        [
            os.path.join(client, ".venv/bin/pdserve"),
            "bench",
            "serve",
            "--base-url",
            f"http://127.0.0.1:{port}",
            "--model",
            "SmolLM2-135M-Instruct",
            "--tokenizer",
            str(cache_dir()),
            "--input-len",
            "256",
            "--output-len",
            "128",
            "--num-requests",
            str(n),
            "--concurrency",
            str(conc),
            "--seed",
            str(seed),
            "--out",
            out,
            "--label",
            label,
            "--no-plots",
            "--no-progress",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    with open(os.path.join(out, f"{label}_rate-inf.json")) as f:
        return json.load(f)["summary"]


def main() -> int:
    global VLLM_MEMORY
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--change", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--starts", type=int, default=0, help="only time N alternating starts of each worker")
    ap.add_argument("--base-env", default="", help="KEY=VALUE,... set for the base worker only")
    ap.add_argument("--vllm", default="", help="a virtual environment with vLLM: serve from it as a third side")
    ap.add_argument("--vllm-memory", default=VLLM_MEMORY,
                    help="vLLM's --gpu-memory-utilization: on CPU its share of host memory, all reserved at start")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    trees = {"base": os.path.abspath(args.base), "change": os.path.abspath(args.change)}
    ports = {"base": 18131, "change": 18132, "vllm": 18133}
    VLLM_MEMORY = args.vllm_memory
    if args.vllm:
        trees["vllm"] = "vllm:" + os.path.abspath(args.vllm)
    envs = {k: dict(os.environ) for k in trees}
    for kv in filter(None, args.base_env.split(",")):
        key, _, value = kv.partition("=")
        envs["base"][key] = value
    if args.starts:  # start-to-ready only: each tree's worker started alone, alternating, then stopped
        times = {k: [] for k in trees}
        for _ in range(args.starts):
            for k in trees:
                proc, secs = start(trees[k], ports[k], os.path.join(args.out, f"{k}-start.log"), envs[k])
                times[k].append(round(secs, 2))
                proc.terminate()
                proc.wait(30)
        print(f"start to ready (s): {times}")
        return 0
    procs, starts = {}, {}
    try:
        for k in trees:
            procs[k], starts[k] = start(trees[k], ports[k], os.path.join(args.out, f"{k}.log"), envs[k])
        rows = []
        for w in args.workloads:
            conc, n = WORKLOADS[w]
            for r in range(args.rounds):
                for k in trees:
                    load0, c0 = os.getloadavg()[0], cpu_seconds(procs[k].pid)
                    s = bench(trees["change"], ports[k], conc, n, 100 * r + conc, args.out, f"{k}-{conc}-{r}")
                    cpu = cpu_seconds(procs[k].pid) - c0
                    row = dict(
                        workload=w,
                        tree=k,
                        round=r,
                        load=load0,
                        itl_p50_ms=1e3 * s["itl_s"]["p50"],
                        ttft_p50_ms=1e3 * s["ttft_s"]["p50"],
                        tok_s=s["output_throughput"],
                        cpu_ms_per_tok=1e3 * cpu / max(1, s["total_output_tokens"]),
                        failed=s["failed"],
                    )
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        rss = {k: peak_rss(p.pid) for k, p in procs.items()}
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(30)
    print(f"\nstart to ready: {starts}; peak RSS (VmHWM, process tree): {rss}")
    peer = " vllm | change / vllm |" if args.vllm else ""
    print(f"\n| workload | metric | base | change | change / base |{peer}\n| --- | --- | ---: | ---: | ---: |"
          + (" ---: | ---: |" if args.vllm else ""))
    for w in args.workloads:
        for m in ("itl_p50_ms", "ttft_p50_ms", "tok_s", "cpu_ms_per_tok"):
            vals = {k: [r[m] for r in rows if r["workload"] == w and r["tree"] == k] for k in trees}
            med = {k: statistics.median(v) for k, v in vals.items()}
            each = {k: ", ".join(f"{x:.1f}" for x in v) for k, v in vals.items()}
            line = (f"| {w} | {m} | {med['base']:.1f} ({each['base']}) | {med['change']:.1f} ({each['change']}) | "
                    f"{med['change'] / med['base']:.2f}x |")
            if args.vllm:
                line += f" {med['vllm']:.1f} ({each['vllm']}) | {med['change'] / med['vllm']:.2f}x |"
            print(line)
    json.dump(dict(rows=rows, starts=starts, rss=rss), open(os.path.join(args.out, "ab.json"), "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
