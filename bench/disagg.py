"""Disaggregation benchmark (not a test): aggregated vs prefill/decode serving under Poisson load.

    python -m pdserve.bench.disagg --out DIR [--seconds 15] [--budget-s 520] [--smoke]

On one random-weight Llama-3.1-8B-shaped checkpoint (bf16; a whitespace word tokenizer with one
word per vocabulary id, so random prompts have exact lengths and every generated id prints),
it starts with `pdserve up` (a) two aggregated workers behind the router (`--prefill 0
--decode 2`, one GPU each) and (b) one prefill and one decode worker (NIXL between the GPUs),
and sweeps Poisson rates with `pdserve bench serve` for 3000 in / 200 out and 8192 in / 256 out.
Per point: throughput, TTFT and ITL p50/p99, goodput (per request, SLO TTFT <= 2 s and every gap
<= 25 ms); a setup's goodput is the highest rate whose TTFT p99 <= 2 s and ITL p99 <= 25 ms.
For (b) the servers' /metrics split the request: the prefill worker's TTFT (queue + prefill),
the KV pull (bytes, ms, GB/s), the router's handoff. Writes DIR/results.md, DIR/summary.json,
plots per workload and DIR/runs.tar.gz (every run's JSON and the stack logs).
`--smoke`: a tiny model on CPU with TCP transfer, to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from pdserve.bench import disagg_report
from pdserve.bench.model_shapes import MODELS
from pdserve.cli.stack import free_port

SLO_MS = {"ttft": 2000.0, "itl": 25.0}
LLAMA_8B = MODELS["llama-3.1-8b"].hf
TINY = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False)
# (input, output, rates): chosen around the rough first measurement (6 req/s at 3000/200 was near
# one H100's prefill capacity); the lowest rate gives the low-load TTFT comparison.
WORKLOADS = {"3000-200": (3000, 200, (1, 3, 5, 7)), "8192-256": (8192, 256, (0.5, 1.5, 2.5))}
SMOKE_WORKLOADS = {"3000-200": (60, 8, (2, 4)), "8192-256": (120, 8, (1,))}
# P/D first: it has more moving parts, so a broken stack shows before half the budget is spent.
SETUPS = (("pd", 1, 1), ("agg", 0, 2))


def make_checkpoint(path: str, smoke: bool, config_only: bool = False) -> None:
    """Random weights (the GPU makes them in seconds) and a word tokenizer covering every id;
    `config_only`: no weights, for workers started with --load-format dummy (nothing written)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    spec = TINY if smoke else LLAMA_8B
    cfg = LlamaConfig(**spec, bos_token_id=1, eos_token_id=2)
    if config_only:  # a model's save_pretrained names the architecture; the config alone must too
        cfg.architectures = ["LlamaForCausalLM"]
        cfg.save_pretrained(path)
        save_word_tokenizer(path, cfg.vocab_size)
        return
    torch.manual_seed(0)
    with torch.device("cpu" if smoke else "cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32 if smoke else torch.bfloat16)
    model.save_pretrained(path)
    save_word_tokenizer(path, cfg.vocab_size)


def save_word_tokenizer(path: str, vocab_size: int) -> None:
    """A word tokenizer covering every id below `vocab_size` ("w<id>" words): random prompts of
    exact lengths (bench/serve.py), for a checkpoint or a config-only folder (--load-format dummy)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    # Special tokens must not be prefixes of words: added tokens match inside words, so a BOS
    # named "w1" would split "w1000" into two tokens and random prompts would miss their length.
    special = ["<unk>", "<s>", "</s>"]
    vocab = {w: i for i, w in enumerate(special)} | {f"w{i}": i for i in range(len(special), vocab_size)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        path
    )


class UpStack:
    """`pdserve up` as a child process; `children` maps name -> URL once it is ready."""

    def __init__(self, ckpt: str, prefill: int, decode: int, log_dir: Path, smoke: bool, *,
                 transport: str | None = None, max_model_len: int | None = None, worker_args: str = "",
                 router_args: str = "", gpu_sharing: str | None = None):
        """transport: nixl | tcp (default: tcp for --smoke, else what `pdserve up` picks); the
        extra worker/router flags go to every worker / the router (bench/handoff.py's overlap)."""
        self.port = free_port()
        self.log_dir = log_dir
        max_len = max_model_len or (2048 if smoke else 8704)
        base = f"--max-model-len {max_len}" + (" --kv-cache-memory 268435456" if smoke else "")
        base += " --kv-peer-allow 127.0.0.1"  # all workers on loopback; the default allows no peer
        self.cmd = [sys.executable, "-m", "pdserve.cli.main", "up", "--model", ckpt, "--served-model-name", "llama",
                    "--prefill", str(prefill), "--decode", str(decode), "--host", "127.0.0.1",
                    "--port", str(self.port), "--device", "cpu" if smoke else "cuda", "--log-dir", str(log_dir),
                    f"--worker-args={base} {worker_args}".rstrip(), "--ready-timeout", "400"]
        if router_args:
            self.cmd.append(f"--router-args={router_args}")
        if gpu_sharing:  # workers sharing a card: MPS or time slices (cli/mps.py)
            self.cmd += ["--gpu-sharing", gpu_sharing]
        transport = transport or ("tcp" if smoke else None)
        if transport:
            self.cmd += ["--kv-transfer", transport]
        self.out = log_dir / "up.log"
        self.proc: subprocess.Popen | None = None
        self.children: dict[str, str] = {}

    def start(self, timeout_s: float = 420.0) -> "UpStack":
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.out, "wb") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         process_group=0)  # not a session: cli/launcher.py says why
        deadline = time.monotonic() + timeout_s
        while "pdserve up: ready in" not in (text := self.out.read_text(errors="replace")):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pdserve up did not get ready:\n{text[-4000:]}")
            time.sleep(0.5)
        self.children = {n: u for n, _, u in re.findall(r"started (\S+)\s+pid (\d+)\s+(http://\S+)", text)}
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def sweep(stack: UpStack, setup: str, workload: str, spec: tuple, ckpt: str, run_dir: Path, seconds: float,
          deadline: float) -> list[dict]:
    from pdserve.bench import serve

    in_len, out_len, rates = spec
    records = []
    urls = [u for n, u in stack.children.items()]
    for i, rate in enumerate(rates):
        left = deadline - time.monotonic()
        if left < seconds + 20:
            print(f"[disagg] budget: skipping {setup} {workload} rate {rate} ({left:.0f}s left)", flush=True)
            continue
        argv = ["--base-url", stack.children["router"], "--model", "llama", "--tokenizer", ckpt,
                "--input-len", str(in_len), "--output-len", str(out_len), "--request-rate", str(rate),
                "--duration", str(seconds), "--seed", str(1000 * i + in_len), "--label", setup,
                "--goodput", f"ttft:{SLO_MS['ttft']:g}", f"itl:{SLO_MS['itl']:g}", "--no-progress", "--no-plots",
                "--request-timeout", "120", "--out", str(run_dir / f"{setup}_{workload}")]
        argv += [a for u in urls for a in ("--metrics-url", u)]
        if i == 0:
            argv += ["--warmup-requests", "4"]  # kernels specialise on the first prompts of a length
        t = time.monotonic()
        serve.main(argv)
        path = run_dir / f"{setup}_{workload}" / f"{setup}_rate-{serve.rate_name(rate)}.json"
        run = json.loads(path.read_text())
        run["workload"], run["setup"], run["send_seconds"] = workload, setup, seconds
        run["roles"] = {u: n for n, u in stack.children.items()}
        records.append(run)
        print(f"[disagg] {setup} {workload} rate {rate}: {time.monotonic() - t:.0f}s", flush=True)
    return records


def pack_runs(work: Path, out: Path) -> None:
    """Every run's JSON and every stack's logs into out/runs.tar.gz; the work folder removed."""
    with tarfile.open(out / "runs.tar.gz", "w:gz") as tar:
        for sub in ("runs", "logs"):
            if (work / sub).exists():
                tar.add(work / sub, arcname=sub)
    shutil.rmtree(work, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench disagg", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, metavar="DIR")
    p.add_argument("--seconds", type=float, default=15.0, help="sending time per rate")
    p.add_argument("--budget-s", type=float, default=520.0, help="skip rates that would end past this")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (checks the script)")
    p.add_argument("--checkpoint", metavar="DIR", help="reuse this checkpoint (made by --make-checkpoint DIR)")
    p.add_argument("--make-checkpoint", metavar="DIR", help="only write the random checkpoint to DIR")
    p.add_argument("--config-only", action="store_true", help="with --make-checkpoint: config and tokenizer, no "
                   "weights (the workers then need --load-format dummy)")
    args = p.parse_args(argv)
    if args.make_checkpoint:
        make_checkpoint(args.make_checkpoint, args.smoke, args.config_only)
        return 0
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = scratch_dir("pdserve-disagg-")
    ckpt = args.checkpoint or str(work / "ckpt")
    if not args.checkpoint:
        # In a child process, so this process never holds a CUDA context the workers' memory sizing sees.
        flags = ["--smoke"] if args.smoke else []
        subprocess.run([sys.executable, "-m", "pdserve.bench.disagg", "--out", str(out), "--make-checkpoint", ckpt,
                        *flags], check=True)
        print(f"[disagg] checkpoint in {ckpt}: {time.monotonic() - t0:.0f}s", flush=True)
    workloads = SMOKE_WORKLOADS if args.smoke else WORKLOADS
    runs: list[dict] = []
    try:
        for k, (setup, prefill, decode) in enumerate(SETUPS):
            t = time.monotonic()
            # Each setup gets an equal share of what is left, its own start included.
            share = t + (deadline - t) / (len(SETUPS) - k)
            stack = UpStack(ckpt, prefill, decode, work / "logs" / setup, args.smoke)
            try:
                stack.start()
                print(f"[disagg] {setup} ready in {time.monotonic() - t:.0f}s: {stack.children}", flush=True)
                for name, spec in workloads.items():
                    runs += sweep(stack, setup, name, spec, ckpt, work / "runs", args.seconds, share)
                    disagg_report.write(runs, out, SLO_MS, args.smoke)
            finally:
                stack.stop()
    finally:
        disagg_report.write(runs, out, SLO_MS, args.smoke, plots=True)
        pack_runs(work, out)
    return finish(out, "disagg", t0)


def scratch_dir(prefix: str) -> Path:
    """A fresh folder for the checkpoint and the stacks' logs: in /dev/shm where it has room (an
    8B checkpoint is written and loaded from memory), else the default temp folder."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and shutil.disk_usage(shm).free > 40e9 else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def finish(out: Path, tag: str, t0: float) -> int:
    """A harness's last words: its results.md on stdout (what a device call's reply shows), the
    total time."""
    print((out / "results.md").read_text())
    print(f"[{tag}] total {time.monotonic() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
