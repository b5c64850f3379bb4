"""The host KV tier on one GPU (issue 51's "Measure"), with --load-format dummy: Llama-3.1-8B's
shapes, random weights, no weight file written. tools/gpu/kv_tier.sh runs the subcommands:

  config  a config-only folder of the model's shapes and a word tokenizer covering its vocabulary
          (--tiny: a 2-layer llama for the CPU dry run)
  copy    restore bandwidth: the tier's own block copies (executor/host_kv_store.py, a block per
          copy, scattered slots and blocks) against one pinned host->device copy of the same bytes,
          in the same process; and the stores against one device->host copy
  serve   one worker (`pdserve worker`), then `pdserve bench serve --multi-turn N M`: N conversations x
          M turns, each turn the whole history plus a new message. The device KV cache is sized to a
          quarter of the working set (every conversation's KV at its last turn) or less
          (--device-share); with --tier the host tier holds all of it (x1.25). One row per run: TTFT
          p50/p90, throughput, ITL p50/p90, TTFT per turn, the servers' counters (device and tier hits,
          bytes stored and restored)
  report  the rows as a markdown table and the TTFT-per-turn figure (PNG, with and without the tier)

Rows go to a JSON-lines file (--rows), one per run, so a step cut at its time limit loses only its own.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
import urllib.request
from pathlib import Path

GIB = 2**30


def log(msg: str) -> None:
    print(f"[kv-tier {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _append(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def _pct(values: list[float], p: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


# -- config -------------------------------------------------------------------------------------

def cmd_config(args) -> int:
    from pdserve.bench.disagg import make_checkpoint

    make_checkpoint(args.out, smoke=args.tiny, config_only=True)
    log(f"config {'tiny llama' if args.tiny else 'Llama-3.1-8B shapes'}: {args.out} (no weights)")
    return 0


def kv_bytes_per_token(checkpoint: str, dtype_bytes: int) -> int:
    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * dtype_bytes


# -- copy ---------------------------------------------------------------------------------------

def cmd_copy(args) -> int:
    """Blocks of Llama-3.1-8B's KV (32 layers x K,V x 16 tokens x 8 heads x 128, bf16: 2 MiB each)."""
    import torch

    from pdserve.worker.engine.host_tier_index import TierCopy
    from pdserve.worker.executor.host_kv_store import HostKVStore

    device = torch.device(args.device)
    shape = (32, 2, 16, 8, 128) if not args.tiny else (2, 2, 4, 2, 16)
    block_bytes = math.prod(shape) * 2
    n = max(args.blocks, 8)
    cache = torch.zeros((n * 2, *shape), dtype=torch.bfloat16, device=device)  # twice: scattered destinations
    store = HostKVStore(cache, n, n * block_bytes / GIB)
    g = torch.Generator().manual_seed(0)
    blocks = torch.randperm(n * 2, generator=g)[:n].tolist()
    slots = torch.randperm(n, generator=g).tolist()
    restores = [TierCopy(False, b, s) for b, s in zip(blocks, slots)]
    stores = [TierCopy(True, b, s) for b, s in zip(blocks, slots)]
    pin = device.type == "cuda"
    host = torch.empty(n * block_bytes // 2, dtype=torch.bfloat16, pin_memory=pin)
    dev = torch.empty_like(host, device=device)

    def sync():
        if pin:
            torch.cuda.synchronize(device)

    def timed(fn) -> float:
        times = []
        for _ in range(args.iters + 1):  # the first is a warm-up
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    total = n * block_bytes
    rows = {
        "restore": timed(lambda: store.apply(restores)),
        "h2d_one_copy": timed(lambda: dev.copy_(host, non_blocking=pin)),
        "store": timed(lambda: store.apply(stores)),
        "d2h_one_copy": timed(lambda: host.copy_(dev, non_blocking=pin)),
    }
    gbs = {k: total / v / 1e9 for k, v in rows.items()}
    row = {"kind": "copy", "device": str(device), "blocks": n, "block_bytes": block_bytes, "bytes": total,
           **{f"{k}_gbs": v for k, v in gbs.items()},
           "restore_share": gbs["restore"] / gbs["h2d_one_copy"], "store_share": gbs["store"] / gbs["d2h_one_copy"]}
    _append(args.rows, row)
    log(f"{n} blocks of {block_bytes / 2**20:.2f} MiB: restore {gbs['restore']:.1f} GB/s vs one pinned H2D copy "
        f"{gbs['h2d_one_copy']:.1f} GB/s ({100 * row['restore_share']:.0f}%); store {gbs['store']:.1f} GB/s vs "
        f"D2H {gbs['d2h_one_copy']:.1f} GB/s ({100 * row['store_share']:.0f}%)")
    return 0


# -- serve --------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def workload(args, per_token: int) -> dict:
    """Tokens and bytes of the working set: every conversation's whole history at its last turn."""
    last_prompt = args.turns * args.message_len + (args.turns - 1) * args.output_len
    tokens = args.conversations * (last_prompt + args.output_len)
    ws = tokens * per_token
    device = int(ws * args.device_share)
    return {"working_set_tokens": tokens, "working_set_gib": ws / GIB, "device_kv_bytes": device,
            "tier_gib": ws * 1.25 / GIB, "last_prompt": last_prompt}


def cmd_serve(args) -> int:
    from pdserve.bench import serve

    per_token = kv_bytes_per_token(args.checkpoint, 2 if args.device != "cpu" else 4)
    w = workload(args, per_token)
    label = "tier" if args.tier else "device-only"
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pdserve.cli.main", "worker", "--model", args.checkpoint, "--served-model-name",
           "llama", "--host", "127.0.0.1", "--port", str(port), "--device", args.device, "--load-format", "dummy",
           "--max-model-len", str(w["last_prompt"] + args.output_len + 64),
           "--kv-cache-memory", str(w["device_kv_bytes"])]
    if args.device == "cpu":
        cmd += ["--dtype", "float32", "--block-size", "4"]
    if args.tier:
        cmd += ["--kv-offloading-size", f"{w['tier_gib']:.3f}"]
    cmd += args.worker_args.split()
    work = Path(args.work) / label
    work.mkdir(parents=True, exist_ok=True)
    row = {"kind": "serve", "label": label, "conversations": args.conversations, "turns": args.turns,
           "message_len": args.message_len, "output_len": args.output_len, "device_share": args.device_share,
           "kv_bytes_per_token": per_token, **w}
    tier = f", tier {w['tier_gib']:.2f} GiB" if args.tier else ""
    log(f"{label}: working set {w['working_set_tokens']} tokens ({w['working_set_gib']:.2f} GiB), device KV "
        f"{w['device_kv_bytes'] / GIB:.2f} GiB{tier}")
    def cut(signum, frame):  # the step's time limit (timeout sends SIGTERM): record, stop the worker
        raise TimeoutError("cut at the step's time limit")

    signal.signal(signal.SIGTERM, cut)
    t0 = time.perf_counter()
    with open(work / "worker.log", "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    status = 0
    try:
        deadline = time.monotonic() + args.ready_timeout
        while not _ready(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("worker did not get ready:\n" + (work / "worker.log").read_text()[-3000:])
            time.sleep(0.5)
        row["start_s"] = time.perf_counter() - t0
        log(f"{label}: worker up in {row['start_s']:.0f}s")
        base = ["--base-url", url, "--model", "llama", "--tokenizer", args.checkpoint, "--no-progress",
                "--no-plots", "--request-timeout", str(args.request_timeout)]
        # Warm-up (graphs, allocator): a few single-turn requests the conversations never hit.
        serve.main(base + ["--input-len", "64", "--output-len", "8", "--num-requests", "4", "--seed", "999",
                           "--label", "warmup"])
        serve.main(base + ["--multi-turn", str(args.conversations), str(args.turns), "--input-len",
                           str(args.message_len), "--output-len", str(args.output_len), "--seed", "51",
                           "--label", label, "--metrics-url", url, "--out", str(work)])
        run = json.loads((work / f"{label}_rate-inf.json").read_text())
        reqs = run["requests"]
        ok = [q for q in reqs if q["error"] is None]
        ttft = [q["ttft"] * 1e3 for q in ok]
        itl = [g * 1e3 for q in ok for g in q["itls"]]
        per_turn = []
        for t in range(args.turns):  # the specs are turn-major and sent in order
            turn = [q["ttft"] * 1e3 for q in reqs[t * args.conversations:(t + 1) * args.conversations]
                    if q["error"] is None]
            per_turn.append({"turn": t, "ttft_p50_ms": _pct(turn, 50), "ttft_p90_ms": _pct(turn, 90)})
        s, m = run["summary"], run["server_metrics"].get(url, {})
        row.update(sent=s["num_requests"], failed=s["failed"], duration_s=s["duration_s"],
                   ttft_p50_ms=_pct(ttft, 50), ttft_p90_ms=_pct(ttft, 90), itl_p50_ms=_pct(itl, 50),
                   itl_p90_ms=_pct(itl, 90), request_throughput=s["request_throughput"],
                   output_throughput=s["output_throughput"], total_token_throughput=s["total_token_throughput"],
                   per_turn=per_turn,
                   prompt_tokens=m.get("vllm:prompt_tokens_total", math.nan),
                   device_hit_tokens=m.get("vllm:prefix_cache_hits_total", 0.0),
                   tier_hit_tokens=m.get("vllm:external_prefix_cache_hits_total", 0.0),
                   stored_bytes=m.get('pdserve_kv_offload_bytes_total{direction="store"}', 0.0),
                   restored_bytes=m.get('pdserve_kv_offload_bytes_total{direction="restore"}', 0.0),
                   preemptions=m.get("vllm:num_preemptions_total", 0.0))
        log(f"{label}: TTFT p50 {row['ttft_p50_ms']:.0f} ms p90 {row['ttft_p90_ms']:.0f} ms, ITL p50 "
            f"{row['itl_p50_ms']:.1f} ms, {row['output_throughput']:.0f} out tok/s, hits device "
            f"{row['device_hit_tokens']:.0f} tier {row['tier_hit_tokens']:.0f} tokens, failed {row['failed']}")
        if row["failed"]:
            status = 1
    except (Exception, SystemExit) as e:  # SystemExit: the load generator refused its arguments
        row["error"] = f"{type(e).__name__}: {str(e)[-600:]}"
        traceback.print_exc()
        status = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the worker is stopped whatever comes now
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    _append(args.rows, row)
    return status


# -- report -------------------------------------------------------------------------------------

def _f(v, fmt: str = ".1f") -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def cmd_report(args) -> int:
    rows = [json.loads(line) for line in Path(args.rows).read_text().splitlines() if line.strip()]
    serves = {r["label"]: r for r in rows if r["kind"] == "serve"}
    copies = [r for r in rows if r["kind"] == "copy"]
    lines = [f"# Host KV tier, {args.title}", ""]
    any_serve = next(iter(serves.values()), None)
    if any_serve:
        lines += [f"Multi-turn: {any_serve['conversations']} conversations x {any_serve['turns']} turns, each turn "
                  f"the whole history plus {any_serve['message_len']} new tokens, {any_serve['output_len']} out "
                  f"(`pdserve bench serve --multi-turn`, every conversation at once). Working set "
                  f"{any_serve['working_set_tokens']} tokens = {any_serve['working_set_gib']:.2f} GiB of KV; device "
                  f"KV cache {any_serve['device_kv_bytes'] / GIB:.2f} GiB ({100 * any_serve['device_share']:.0f}%); "
                  f"the tier (`--kv-offloading-size`) {any_serve['tier_gib']:.2f} GiB.", "",
                  "| run | failed | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | ITL p90 ms | req/s | out tok/s | "
                  "total tok/s | device hit tokens | tier hit tokens | GiB stored | GiB restored | preemptions |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for label in ("device-only", "tier"):
            r = serves.get(label)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {label} | error: {r['error'][:120]} |" + " |" * 12)
                continue
            lines.append(f"| {label} | {r['failed']} | {_f(r['ttft_p50_ms'], '.0f')} | {_f(r['ttft_p90_ms'], '.0f')} | "
                         f"{_f(r['itl_p50_ms'], '.2f')} | {_f(r['itl_p90_ms'], '.2f')} | "
                         f"{_f(r['request_throughput'], '.2f')} | {_f(r['output_throughput'], '.0f')} | "
                         f"{_f(r['total_token_throughput'], '.0f')} | {r['device_hit_tokens']:.0f} | "
                         f"{r['tier_hit_tokens']:.0f} | {r['stored_bytes'] / GIB:.2f} | "
                         f"{r['restored_bytes'] / GIB:.2f} | {r['preemptions']:.0f} |")
        a, b = serves.get("device-only"), serves.get("tier")
        if a and b and "error" not in a and "error" not in b:
            lines += ["", f"With the tier: TTFT p90 {a['ttft_p90_ms'] / b['ttft_p90_ms']:.2f}x better "
                          f"(target >= 3x), p50 {a['ttft_p50_ms'] / b['ttft_p50_ms']:.2f}x; output throughput "
                          f"{b['output_throughput'] / a['output_throughput']:.2f}x; ITL p50 "
                          f"{b['itl_p50_ms'] / a['itl_p50_ms']:.2f}x, p90 {b['itl_p90_ms'] / a['itl_p90_ms']:.2f}x "
                          f"of the run without (stores running: target unchanged within noise)."]
    if any("per_turn" in r for r in serves.values()):
        labels = [label for label in ("device-only", "tier") if "per_turn" in serves.get(label, {})]
        lines += ["", "TTFT per turn (ms, p50 / p90):", "",
                  "| turn | " + " | ".join(labels) + " |", "| ---: |" + " ---: |" * len(labels)]
        for t in range(max(len(serves[label]["per_turn"]) for label in labels)):
            cells = [f"{_f(serves[label]['per_turn'][t]['ttft_p50_ms'], '.0f')} / "
                     f"{_f(serves[label]['per_turn'][t]['ttft_p90_ms'], '.0f')}" for label in labels]
            lines.append(f"| {t + 1} | " + " | ".join(cells) + " |")
    for c in copies:
        lines += ["", f"Tier copies ({c['device']}, {c['blocks']} blocks of {c['block_bytes'] / 2**20:.2f} MiB, "
                      f"scattered, one copy per block, `HostKVStore.apply`) against one copy of the same "
                      f"{c['bytes'] / GIB:.2f} GiB between pinned host memory and the device, same process:", "",
                  "| direction | tier GB/s | one copy GB/s | share |", "| --- | ---: | ---: | ---: |",
                  f"| restore (host -> device) | {c['restore_gbs']:.1f} | {c['h2d_one_copy_gbs']:.1f} | "
                  f"{100 * c['restore_share']:.0f}% (target >= 60%) |",
                  f"| store (device -> host) | {c['store_gbs']:.1f} | {c['d2h_one_copy_gbs']:.1f} | "
                  f"{100 * c['store_share']:.0f}% |"]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if args.png and serves:
        plot_turns(serves, args.png, args.title)
    return 0


def plot_turns(serves: dict, path: str, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        log(f"no {path}: matplotlib is not installed here (the report's rows draw it elsewhere: `report --png`)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, color in (("device-only", "tab:red"), ("tier", "tab:blue")):
        r = serves.get(label)
        if r is None or "per_turn" not in r:
            continue
        turns = [t["turn"] + 1 for t in r["per_turn"]]
        name = "without the tier" if label == "device-only" else "with --kv-offloading-size"
        ax.plot(turns, [t["ttft_p50_ms"] for t in r["per_turn"]], "-o", color=color, label=f"{name}, p50")
        ax.plot(turns, [t["ttft_p90_ms"] for t in r["per_turn"]], "--", color=color, alpha=0.7, label=f"{name}, p90")
    ax.set_xticks(turns)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title(f"TTFT per turn, multi-turn chat ({title})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("config")
    c.add_argument("--out", required=True)
    c.add_argument("--tiny", action="store_true")
    c = sub.add_parser("copy")
    c.add_argument("--rows", required=True)
    c.add_argument("--device", default="cuda")
    c.add_argument("--blocks", type=int, default=512, help="blocks per batch of copies (2 MiB each)")
    c.add_argument("--iters", type=int, default=5)
    c.add_argument("--tiny", action="store_true", help="tiny blocks (the CPU dry run)")
    c = sub.add_parser("serve")
    c.add_argument("--checkpoint", required=True)
    c.add_argument("--rows", required=True)
    c.add_argument("--work", required=True)
    c.add_argument("--tier", action="store_true", help="with --kv-offloading-size (the working set x1.25)")
    c.add_argument("--device", default="cuda")
    c.add_argument("--conversations", type=int, default=32)
    c.add_argument("--turns", type=int, default=6)
    c.add_argument("--message-len", type=int, default=1024)
    c.add_argument("--output-len", type=int, default=128)
    c.add_argument("--device-share", type=float, default=0.22, help="device KV cache / working set (<= 0.25)")
    c.add_argument("--request-timeout", type=float, default=300)
    c.add_argument("--ready-timeout", type=float, default=240)
    c.add_argument("--worker-args", default="")
    c = sub.add_parser("report")
    c.add_argument("--rows", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--png", default=None)
    c.add_argument("--title", default="one H200, Llama-3.1-8B shapes")
    args = p.parse_args(argv)
    return {"config": cmd_config, "copy": cmd_copy, "serve": cmd_serve, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
