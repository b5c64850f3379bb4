"""P/D between tensor-parallel workers on GPUs (issue 18; a machine with 2 CUDA GPUs; not a test).

    python -m pdserve.bench.tp_pd [--transports tcp nixl] [--checkpoint DIR] [--out F]

Per transport, four real `pdserve worker` processes share two cards: prefill TP=2 and decode
TP=2 over cuda:0-1, prefill TP=1 on cuda:1, decode TP=1 on cuda:0 (each a share of its cards).
For each pair (2->2, 2->1, 1->2, 1->1) and prompts of several lengths, the P/D answer (the
prefill's first token + the decode's rest, greedy, `ignore_eos`) is compared with the decode
worker's own answer to the whole request, token by token: exact, or where it first differs.
The decode worker must really pull (bytes counted, no local-prefill fallback); the table gives
the bytes its rank 0 pulled and the mean pull time from its metrics, after a first pull of
the pair (timed apart: it pays one-time costs). Ids 0-2 are the
tokenizer's special tokens and have no text: both sides drop them alike.

bf16 on random weights: logits are flat (near-ties), so when the prefill ran at another TP size
than the reference (2->1, 1->2) its KV differs in reduction order and a late divergence is
rounding, not a bug. Same-size pairs (2->2, 1->1) do the same arithmetic as the single worker.
The CPU fp32 tests (tests/worker/test_tp_pd.py) assert exact equality for every pair.

`--smoke`: a tiny model on CPU (gloo), to check the script; its KV moves between processes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.bench.ports import free_ports

SECRET = "bench-tp-pd-secret"
PAIRS = [(2, 2), (2, 1), (1, 2), (1, 1)]  # (prefill TP, decode TP)
PROMPT_LENS = (17, 130, 600, 1500)
MAX_TOKENS = 32
# A Llama-3.2-1B-shaped body (8 KV heads, head dim 64) with a vocabulary every id of which the
# bench tokenizer can spell: enough to exercise the head mapping at realistic shapes, quick to load.
GPU_MODEL = dict(vocab_size=32768, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=8, rms_norm_eps=1e-5, max_position_embeddings=4096,
                 tie_word_embeddings=False, rope_theta=500000.0)
SMOKE_MODEL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False)


class Worker:
    """One `pdserve worker` process on loopback; its log goes to a file named in errors."""

    def __init__(self, name: str, ckpt: str, device: str, tp: int, role: str, transport: str, extra: list[str]):
        self.name, self.tp, self.role = name, tp, role
        self.port = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(tempfile.mkstemp(prefix=f"pdserve-tp-pd-{name}-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "pdserve.cli.main", "worker", "--model", ckpt, "--served-model-name", "x",
               "--host", "127.0.0.1", "--port", str(self.port), "--device", device, "--role", role,
               "--tensor-parallel-size", str(tp), "--kv-transfer", transport, "--kv-port", str(free_ports(tp)),
               "--kv-peer-allow", "127.0.0.1", "--no-enable-prefix-caching", *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     env={**os.environ, "PDSERVE_KV_SECRET": SECRET})

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited with {self.proc.returncode}; log {self.log}:\n"
                                   + self.log.read_text(errors="replace")[-3000:])
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise TimeoutError(f"worker {self.name} not ready after {timeout:.0f}s; log {self.log}")

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def ids_of(text: str) -> list[int]:
    """The bench tokenizer spells token id i as the word `t<i>` (decoded without separators)."""
    return [int(i) for i in re.findall(r"t(\d+)", text)]


def complete(w: Worker, prompt: list[int], **extra) -> dict:
    body = {"model": "x", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **extra}
    r = httpx.post(f"{w.url}/v1/completions", json=body, timeout=300)
    if r.status_code != 200:
        raise RuntimeError(f"{w.name}: HTTP {r.status_code}: {r.text[:500]}")
    return r.json()


def pd_tokens(p: Worker, d: Worker, prompt: list[int]) -> list[int]:
    first = complete(p, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    rest = complete(d, prompt, kv_transfer_params=first["kv_transfer_params"])
    return ids_of(first["choices"][0]["text"]) + ids_of(rest["choices"][0]["text"])


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def run_transport(transport: str, ckpt: str, args) -> list[dict]:
    gpu = not args.smoke
    share = ["--gpu-memory-utilization", "0.2"] if gpu else ["--kv-cache-memory", str(64 << 20)]
    extra = [*share, "--max-model-len", "2048", "--kv-pull-timeout", "60"]
    specs = {("prefill", 2): "cuda:0" if gpu else "cpu", ("decode", 2): "cuda:0" if gpu else "cpu",
             ("prefill", 1): "cuda:1" if gpu else "cpu", ("decode", 1): "cuda:0" if gpu else "cpu"}
    workers = {}
    t0 = time.perf_counter()
    try:
        # Started together: each sizes its KV cache as a share of its cards (0.2 x 3 workers a card
        # at most), so none can starve another that starts later.
        for (role, tp), device in specs.items():
            workers[role, tp] = Worker(f"{transport}-{role}-tp{tp}", ckpt, device, tp, role, transport, extra)
        for w in workers.values():
            w.wait_ready(args.ready_timeout)
        print(f"{transport}: 4 workers ready in {time.perf_counter() - t0:.0f}s", flush=True)
        rng = random.Random(11)
        vocab = (SMOKE_MODEL if args.smoke else GPU_MODEL)["vocab_size"]
        rows = []
        for ptp, dtp in PAIRS:
            p, d = workers["prefill", ptp], workers["decode", dtp]
            # A first pull of this pair, timed apart: it pays one-time costs (a NIXL peer's
            # handshake, a staging buffer's first registration) the steady state does not.
            secs_w = d.metric("pdserve_kv_transfer_seconds_sum")
            pd_tokens(p, d, [rng.randrange(3, vocab) for _ in range(200)])
            first_ms = 1e3 * (d.metric("pdserve_kv_transfer_seconds_sum") - secs_w)
            pulled0, secs0 = d.metric("pdserve_kv_transfer_bytes_total"), d.metric("pdserve_kv_transfer_seconds_sum")
            pulls0 = d.metric("pdserve_kv_transfer_seconds_count")
            fallbacks0 = d.metric("pdserve_kv_local_prefill_fallbacks_total")
            prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]
            got = [pd_tokens(p, d, q) for q in prompts]
            pulled = d.metric("pdserve_kv_transfer_bytes_total") - pulled0
            pulls = d.metric("pdserve_kv_transfer_seconds_count") - pulls0
            secs = d.metric("pdserve_kv_transfer_seconds_sum") - secs0
            # The reference after the P/D legs: its own prefix cache (off anyway) could not spare a pull.
            want = [ids_of(complete(d, q)["choices"][0]["text"]) for q in prompts]
            diffs = [first_difference(g, w) for g, w in zip(got, want)]
            rows.append({"transport": transport, "pair": f"{ptp} -> {dtp}", "exact": sum(x is None for x in diffs),
                         "n": len(prompts), "diffs": diffs, "bytes": pulled, "pulls": pulls,
                         "pull_ms": 1e3 * secs / pulls if pulls else float("nan"), "first_ms": first_ms,
                         "fallbacks": d.metric("pdserve_kv_local_prefill_fallbacks_total") - fallbacks0,
                         "tokens": [len(g) for g in got]})
            print(rows[-1], flush=True)
        return rows
    finally:
        for w in workers.values():
            w.stop()


def write_checkpoint(path: str | None, smoke: bool) -> str:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pdserve.bench.engine import save_tokenizer

    cfg = SMOKE_MODEL if smoke else GPU_MODEL
    path = path or tempfile.mkdtemp(prefix="pdserve-bench-tp-pd-")
    if not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        device = "cpu" if smoke else "cuda"
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(LlamaConfig(**cfg, bos_token_id=1, eos_token_id=2),
                                                     dtype=torch.float32 if smoke else torch.bfloat16)
        model.save_pretrained(path)
        save_tokenizer(path, cfg["vocab_size"])
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench tp-pd", description=__doc__.splitlines()[0])
    ap.add_argument("--transports", nargs="+", default=["tcp", "nixl"], choices=["tcp", "nixl"])
    ap.add_argument("--checkpoint", help="write the random checkpoint here (reused if it exists)")
    ap.add_argument("--ready-timeout", type=float, default=240, help="seconds for each worker to start")
    ap.add_argument("--out", help="also write the markdown table here")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU (gloo): checks the script only")
    args = ap.parse_args(argv)
    import torch

    if not args.smoke and torch.cuda.device_count() < 2:
        print("pdserve bench tp-pd: needs 2 CUDA GPUs; --smoke runs a CPU check", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    ckpt = write_checkpoint(args.checkpoint, args.smoke)
    print(f"checkpoint {ckpt} ready in {time.perf_counter() - t0:.0f}s", flush=True)
    rows = []
    for t in args.transports:
        try:
            rows += run_transport(t, ckpt, args)
        except Exception as e:  # noqa: BLE001 - one transport failing must not hide the other's rows
            print(f"{t}: failed: {e}", file=sys.stderr, flush=True)
            rows.append({"transport": t, "error": str(e).splitlines()[0][:200]})
    card = torch.cuda.get_device_name() if not args.smoke else "CPU (smoke run, gloo)"
    lines = [
        f"P/D between TP workers · Llama-shaped random weights "
        f"({'smoke' if args.smoke else '16 layers, 8 KV heads, head dim 64'}) · {card} x 2 · "
        f"torch {torch.__version__} · {datetime.date.today()} · {'fp32' if args.smoke else 'bf16'} · "
        f"greedy, {MAX_TOKENS} tokens, prompts of {', '.join(map(str, PROMPT_LENS))} tokens",
        "",
        "| transport | prefill TP -> decode TP | P/D = decode worker alone | first differing token "
        "(per prompt) | KV pulled by decode rank 0 | pulls | mean pull ms | the pair's first pull (200 tokens), ms | "
        "local-prefill fallbacks |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['transport']} | failed: {r['error']} | | | | | | | |")
            continue
        div = ", ".join("-" if x is None else str(x) for x in r["diffs"])
        lines.append(f"| {r['transport']} | {r['pair']} | {r['exact']}/{r['n']} | {div} | "
                     f"{r['bytes'] / 2**20:.1f} MiB | {r['pulls']:.0f} | {r['pull_ms']:.2f} | {r['first_ms']:.2f} | "
                     f"{r['fallbacks']:.0f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if rows and all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
