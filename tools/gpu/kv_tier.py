"""The host KV tier on one GPU (issue 51's "Measure"), with --load-format dummy: Llama-3.1-8B's
shapes, random weights, no weight file written. tools/gpu/kv_tier.sh runs the subcommands:

  config  a config-only folder of the model's shapes and a word tokenizer covering its vocabulary
          (--tiny: a 2-layer llama for the CPU dry run)
  copy    restore bandwidth: the tier's own block copies (executor/host_kv_store.py, a block per
          copy, scattered slots and blocks) against one pinned host->device copy of the same bytes,
          in the same process; and the stores against one device->host copy
  serve   one worker (`pdserve worker`), then `pdserve bench serve --multi-turn N M`: N conversations x
          M turns, each turn the whole history plus a new message; staggered by default (conversations
          start at --conversation-rate per second, --think-time seconds between a turn's end and the
          next turn: chat traffic, where the requests running at once fit the device cache and the
          conversations do not; --conversation-rate 0: every conversation at once). The device KV
          cache is sized to a quarter of the working set (every conversation's KV at its last turn)
          or less (--device-share); with --tier the host tier holds all of it (x1.25). One row per
          run: TTFT p50/p90, throughput, ITL p50/p90 (with the tier: while its stores run), TTFT per
          turn, the servers' counters (device and tier hits, bytes stored and restored)
  peer    a prefix pulled from a peer vs recomputed (--prefixes, e.g. 2048,8192,32768 tokens): two
          aggregated workers on one card with the KV transport, the puller told its link is fast
          (--kv-prefix-pull-bandwidth: it always pulls). Per length: the time to the first token of a
          prompt whose prefix the peer pinned (a one-token prefill of it, as the router asks), and of
          the same length recomputed; the crossover (the length from which the pull wins) and the
          worker's own estimates (its prefill tokens/s, the link bytes/s its pulls measured)
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
    if pin:
        row.update(overlap(store, restores, device, args.iters))
    _append(args.rows, row)
    log(f"{n} blocks of {block_bytes / 2**20:.2f} MiB: restore {gbs['restore']:.1f} GB/s vs one pinned H2D copy "
        f"{gbs['h2d_one_copy']:.1f} GB/s ({100 * row['restore_share']:.0f}%); store {gbs['store']:.1f} GB/s vs "
        f"D2H {gbs['d2h_one_copy']:.1f} GB/s ({100 * row['store_share']:.0f}%)")
    return 0


def overlap(store, restores, device, iters: int) -> dict:
    """The restores beside a stand-in forward (bf16 GEMMs on the compute stream, about as long as
    the copies): wall time of both when the forward waits for the copies (wait=True: the step's
    critical path) and when it does not (wait=False: the tier's side stream overlaps it)."""
    import dataclasses

    import torch

    a = torch.randn(4096, 4096, dtype=torch.bfloat16, device=device)

    def gemms(k: int):
        for _ in range(k):
            a @ a

    def timed(fn) -> float:
        times = []
        for _ in range(iters + 1):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    one = timed(lambda: gemms(1))
    copies = timed(lambda: store.apply(restores) or store.settle())
    k = max(1, round(copies / one))  # a forward about as long as the copies
    forward = timed(lambda: gemms(k))
    waited = [dataclasses.replace(op, wait=True) for op in restores]
    behind = [dataclasses.replace(op, wait=False) for op in restores]
    serial = timed(lambda: (store.apply(waited), gemms(k)))
    overlapped = timed(lambda: (store.apply(behind), gemms(k), store.settle()))
    hidden = (forward + copies - overlapped) / min(forward, copies)
    log(f"restores {1e3 * copies:.1f} ms beside a {1e3 * forward:.1f} ms stand-in forward: waited for "
        f"{1e3 * serial:.1f} ms, overlapped {1e3 * overlapped:.1f} ms ({100 * hidden:.0f}% of the shorter hidden)")
    return {"overlap_forward_ms": 1e3 * forward, "overlap_copies_ms": 1e3 * copies, "overlap_serial_ms": 1e3 * serial,
            "overlap_overlapped_ms": 1e3 * overlapped, "overlap_hidden_share": hidden}


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


def stagger_flags(args) -> list[str]:
    """`pdserve bench serve`'s staggered multi-turn flags (none: every conversation at once)."""
    if not args.conversation_rate:
        return []
    return ["--conversation-rate", str(args.conversation_rate), "--think-time", str(args.think_time)]


def cmd_serve(args) -> int:
    from pdserve.bench import serve

    if args.conversation_rate < 0 or args.think_time < 0:
        raise SystemExit("serve: --conversation-rate and --think-time must be >= 0")
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
           "conversation_rate": args.conversation_rate or None, "think_time_s": args.think_time,
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
                           "--label", label, "--metrics-url", url, "--out", str(work), *stagger_flags(args)])
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
        rate = any_serve.get("conversation_rate")
        how = (f"conversations starting at {rate:g}/s, {any_serve['think_time_s']:g} s mean think time between "
               f"turns (`--conversation-rate {rate:g} --think-time {any_serve['think_time_s']:g}`)"
               if rate else "every conversation at once")
        lines += [f"Multi-turn: {any_serve['conversations']} conversations x {any_serve['turns']} turns, each turn "
                  f"the whole history plus {any_serve['message_len']} new tokens, {any_serve['output_len']} out "
                  f"(`pdserve bench serve --multi-turn`, {how}). Working set "
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
        if "overlap_hidden_share" in c:
            lines += ["", f"Overlap: the same restores ({c['overlap_copies_ms']:.1f} ms) beside a stand-in forward "
                          f"(bf16 GEMMs, {c['overlap_forward_ms']:.1f} ms): {c['overlap_serial_ms']:.1f} ms when the "
                          f"forward waits for them (TierCopy.wait), {c['overlap_overlapped_ms']:.1f} ms when it "
                          f"does not ({100 * c['overlap_hidden_share']:.0f}% of the shorter one hidden)."]
    lines += peer_lines([r for r in rows if r["kind"] == "peer"])
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


# -- peer ---------------------------------------------------------------------------------------

PEER_SECRET = "kv-tier-peer-measurement-secret"


def _post(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def _metric(m: dict[str, float], name: str, **labels) -> float:
    """A series' value: the sample of `name` whose labels include `labels` (0 when absent)."""
    for key, v in m.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{val}"' in rest for k, val in labels.items()):
            return v
    return 0.0


def _start_worker(args, port: int, kv_port: int, gbps: float | None, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pdserve.cli.main", "worker", "--model", args.checkpoint, "--served-model-name",
           "llama", "--host", "127.0.0.1", "--port", str(port), "--device", args.device, "--load-format", "dummy",
           "--max-model-len", str(max(args.prefixes) + args.suffix + 16), "--kv-cache-memory",
           str(int(args.kv_gib * GIB)), "--kv-transfer", args.transport, "--kv-port", str(kv_port),
           "--kv-peer-allow", "127.0.0.1", "--shutdown-grace", "0"]
    if args.device == "cpu":
        cmd += ["--dtype", "float32", "--block-size", "4"]
    if gbps is not None:
        cmd += ["--kv-prefix-pull-bandwidth", str(gbps)]
    cmd += args.worker_args.split()
    with open(log_path, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "PDSERVE_KV_SECRET": PEER_SECRET})


def cmd_peer(args) -> int:
    """Two workers on one card: `peer` computes and pins prefixes, `puller` (its link said fast:
    it always pulls) pulls them, or recomputes the same lengths (no pin offered)."""
    import random

    if not args.prefixes or min(args.prefixes) < 1 or args.suffix < 1 or args.reps < 1:
        raise SystemExit("peer: --prefixes, --suffix and --reps must be positive")
    per_token = kv_bytes_per_token(args.checkpoint, 2 if args.device != "cpu" else 4)
    vocab = json.loads((Path(args.checkpoint) / "config.json").read_text())["vocab_size"]
    work = Path(args.work) / "peer"
    work.mkdir(parents=True, exist_ok=True)

    def cut(signum, frame):
        raise TimeoutError("cut at the step's time limit")

    signal.signal(signal.SIGTERM, cut)
    ports = [_free_port() for _ in range(4)]
    urls = [f"http://127.0.0.1:{ports[0]}", f"http://127.0.0.1:{ports[1]}"]
    procs = [_start_worker(args, ports[0], ports[2], None, work / "peer.log"),
             _start_worker(args, ports[1], ports[3], 1000.0, work / "puller.log")]
    peer, puller = urls
    rng = random.Random(51)
    status = 0
    try:
        deadline = time.monotonic() + args.ready_timeout
        for url, name, proc in zip(urls, ("peer", "puller"), procs):
            while not _ready(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not get ready:\n" + (work / f"{name}.log").read_text()[-3000:])
                time.sleep(0.5)
        log(f"peer and puller up ({args.transport}); prefixes {args.prefixes}, {args.suffix} more tokens each")

        def fresh(n: int) -> list[int]:  # ids no earlier prompt shares: nothing cached anywhere
            return [rng.randrange(10, vocab - 10) for _ in range(n)]

        def first_token(url: str, ids: list[int], kv: dict | None = None) -> float:
            body = {"model": "llama", "prompt": ids, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
            if kv:
                body["kv_transfer_params"] = kv
            t0 = time.perf_counter()
            _post(url + "/v1/completions", body, args.request_timeout)
            return time.perf_counter() - t0

        first_token(puller, fresh(64))  # warm-up: first-use costs out of the measured ones
        first_token(peer, fresh(64))
        for n in args.prefixes:
            row = {"kind": "peer", "transport": args.transport, "prefix_tokens": n, "suffix_tokens": args.suffix,
                   "kv_bytes": n * per_token, "recompute_s": [], "pull_s": [], "pin_s": []}
            for _ in range(args.reps):
                row["recompute_s"].append(first_token(puller, fresh(n + args.suffix)))
                ids = fresh(n + args.suffix)
                t0 = time.perf_counter()
                pin = _post(peer + "/v1/completions", {"model": "llama", "prompt": ids[:n], "max_tokens": 1,
                                                      "kv_transfer_params": {"do_remote_decode": True}},
                            args.request_timeout)["kv_transfer_params"]
                row["pin_s"].append(time.perf_counter() - t0)
                before = _metrics(puller)
                row["pull_s"].append(first_token(puller, ids, {"prefix_from": pin}))
                after = _metrics(puller)
                pulled = (_metric(after, "pdserve_kv_prefix_pulled_tokens_total", outcome="landed")
                          - _metric(before, "pdserve_kv_prefix_pulled_tokens_total", outcome="landed"))
                row.setdefault("pulled_tokens", []).append(pulled)
            m = _metrics(puller)
            row["prefill_tokens_per_s_estimate"] = _metric(m, "pdserve_kv_prefix_pull_prefill_tokens_per_second")
            row["recompute_ms"] = 1e3 * statistics.median(row["recompute_s"])
            row["pull_ms"] = 1e3 * statistics.median(row["pull_s"])
            row["pull_gbs"] = n * per_token / (row["pull_ms"] / 1e3) / 1e9  # the pull and the suffix's compute
            _append(args.rows, row)
            log(f"prefix {n}: recompute {row['recompute_ms']:.0f} ms, pull {row['pull_ms']:.0f} ms "
                f"({row['pull_gbs']:.2f} GB/s incl. the suffix), pulled {row['pulled_tokens']} tokens, "
                f"pin {1e3 * statistics.median(row['pin_s']):.0f} ms")
    except (Exception, SystemExit) as e:
        err = f"{type(e).__name__}: {str(e)[-600:]}"
        _append(args.rows, {"kind": "peer", "transport": args.transport, "error": err})
        traceback.print_exc()
        status = 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return status


def crossover(points: list[tuple[int, float, float]]) -> str:
    """From (prefix tokens, recompute ms, pull ms) sorted by length: where the pull starts to win,
    interpolated linearly between the two measured lengths around the sign change."""
    if not points:
        return "no lengths measured"
    wins = [pull < rec for _, rec, pull in points]
    if all(wins):
        return f"the pull wins at every measured length (from {points[0][0]} tokens)"
    if not any(wins):
        return f"recompute wins at every measured length (up to {points[-1][0]} tokens)"
    for (n0, r0, p0), (n1, r1, p1) in zip(points, points[1:]):
        d0, d1 = p0 - r0, p1 - r1
        if (d0 < 0) != (d1 < 0):
            x = n0 + (n1 - n0) * d0 / (d0 - d1)
            who = "the pull" if d1 < 0 else "recompute"
            return f"{who} wins from about {x:.0f} tokens (between {n0} and {n1}, linear between them)"
    return "no single crossover (the winner changes more than once)"


def peer_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = ["", "Prefix from a peer vs recomputed (two workers on one card; time to the first token of a prompt "
             "of the prefix plus a few tokens, median; the pull's time includes the suffix's compute):", "",
             "| transport | prefix tokens | KV MiB | recompute ms | pull ms | pull GB/s | tokens pulled | "
             "prefill tok/s (estimate) |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    by_transport: dict[str, list[tuple[int, float, float]]] = {}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['transport']} | error: {r['error'][:160]} |" + " |" * 6)
            continue
        lines.append(f"| {r['transport']} | {r['prefix_tokens']} | {r['kv_bytes'] / 2**20:.0f} | "
                     f"{r['recompute_ms']:.0f} | {r['pull_ms']:.0f} | {r['pull_gbs']:.2f} | "
                     f"{statistics.median(r['pulled_tokens']):.0f} | {r['prefill_tokens_per_s_estimate']:.0f} |")
        by_transport.setdefault(r["transport"], []).append((r["prefix_tokens"], r["recompute_ms"], r["pull_ms"]))
    for transport, points in by_transport.items():
        lines += ["", f"Crossover ({transport}): {crossover(sorted(points))}."]
    ok = [r for r in rows if "error" not in r and r.get("prefill_tokens_per_s_estimate")]
    if ok:
        # The worker's rule (kv/prefix_cost.py): pull when bytes / link < tokens / prefill, i.e.
        # when the link beats bytes-per-token x prefill tokens/s, whatever the length.
        r = ok[-1]
        need = r["kv_bytes"] / r["prefix_tokens"] * r["prefill_tokens_per_s_estimate"] / 1e9
        best = max(x["pull_gbs"] for x in ok)
        lines += ["", f"The worker's rule pulls when its link estimate beats {need:.2f} GB/s (KV bytes per token x "
                      f"its prefill estimate, {r['prefill_tokens_per_s_estimate']:.0f} tokens/s); the pulls here "
                      f"ran at up to {best:.2f} GB/s (the suffix's compute included): left to its own estimates it "
                      f"would {'pull' if best > need else 'recompute'}."]
    return lines


def _lengths(value: str) -> list[int]:
    try:
        out = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"token counts separated by commas, got {value!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"positive token counts, got {value!r}")
    return out


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
    c.add_argument("--conversation-rate", type=float, default=0.75,
                   help="conversations started per second (0: every conversation at once)")
    c.add_argument("--think-time", type=float, default=4.0, help="mean seconds between a turn's end and the next")
    c = sub.add_parser("peer")
    c.add_argument("--checkpoint", required=True)
    c.add_argument("--rows", required=True)
    c.add_argument("--work", required=True)
    c.add_argument("--device", default="cuda")
    c.add_argument("--transport", default="tcp", choices=("tcp", "nixl"))
    c.add_argument("--prefixes", type=_lengths, default=[2048, 8192, 32768],
                   help="prefix lengths in tokens, comma-separated")
    c.add_argument("--suffix", type=int, default=32, help="prompt tokens after the prefix")
    c.add_argument("--reps", type=int, default=2)
    c.add_argument("--kv-gib", type=float, default=12.0, help="each worker's device KV cache")
    c.add_argument("--request-timeout", type=float, default=120)
    c.add_argument("--ready-timeout", type=float, default=240)
    c.add_argument("--worker-args", default="")
    c = sub.add_parser("report")
    c.add_argument("--rows", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--png", default=None)
    c.add_argument("--title", default="one H200, Llama-3.1-8B shapes")
    args = p.parse_args(argv)
    return {"config": cmd_config, "copy": cmd_copy, "serve": cmd_serve, "peer": cmd_peer,
            "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
