"""FP8 KV cache against the model-dtype (bf16) cache, same run, same card(s): what the halved
bytes buy (issue 26, item 3).

    python -m pdserve.bench.fp8_kv --out results.md           # a CUDA machine (tools/gpu/fp8_kv.sh)
    python -m pdserve.bench.fp8_kv --smoke                     # the same code path on CPU, tiny model

Llama-3.1-8B-shaped random bf16 weights, made by each engine on its device (--load-format dummy:
only config.json and a tokenizer are written). Then, for each KV
cache dtype (auto = bf16, then fp8), a pair of real engines:

  prefill  a child process, role prefill, --kv-transfer nixl (it also serves TCP reads); on the
           second GPU when there is one (a P/D pair on two cards), else on the same card
  decode   this process, role decode, pulling from it

and three measurements on that pair:

  KV bytes per token   from the decode engine's real cache (block bytes / block size), and the
                       tokens its KV memory holds (the same --gpu-memory-utilization for both)
  hand-off             a 3000-token prompt prefilled on the prefill engine (the plain hand-off:
                       the prefill ends, then the decode engine pulls every block; the streamed
                       hand-off hides most of this behind the prefill), pulled over NIXL and over
                       TCP (the same pin served by the same process; the params name the path):
                       the pull's wall time (KVConnector._pull, lease + READ + release) and
                       add_request -> second token (pull, admission, one decode step); median of
                       --handoffs distinct prompts after one warm-up
  decode at 8k         the decode engine serving plain requests (local prefill) of an 8192-token
                       prompt: bs=1 and bs=--batch, median decode-step time once every sequence
                       decodes (CUDA graphs), tokens/s

Every number names its card (env) and has its same-run baseline (the auto row). No assertions:
a table (markdown, --out) and a JSON next to it.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdserve.bench.ports import free_ports
from pdserve.bench.report import publish

PROMPT_HANDOFF = 3000
PROMPT_DECODE = 8192
DECODE_STEPS = 48
SECRET = "bench-fp8-kv-shared-secret-0123"


def write_checkpoint(path: str, smoke: bool, device: str) -> dict:
    """The real shape's config (bench/model_shapes.py's MODELS) and a word tokenizer, no weights:
    every engine makes the same random bf16 weights on its device (--load-format dummy, one seed),
    so nothing is written (`device` is unused: the weights are made where each engine runs)."""
    from transformers import LlamaConfig

    from pdserve.bench.engine import save_tokenizer
    from pdserve.bench.model_shapes import MODELS

    spec = MODELS["tiny-llama" if smoke else "llama-3.1-8b"]
    cfg = LlamaConfig(**spec.hf, bos_token_id=1, eos_token_id=2, architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(path)
    save_tokenizer(path)
    return {"model": spec.name, "vocab": cfg.vocab_size}


def engine_config(ckpt: str, role: str, device: str, kv_dtype: str, port: int, util: float, max_len: int,
                  batch: int, smoke: bool):
    from pdserve.worker.config.engine import EngineConfig

    return EngineConfig(model=ckpt, device=device, dtype="bfloat16", load_format="dummy", role=role,
                        kv_transfer="nixl", kv_port=port,
                        kv_cache_dtype=kv_dtype, gpu_memory_utilization=util,
                        kv_cache_memory=(256 << 20) if smoke else None, max_model_len=max_len,
                        max_num_seqs=max(batch, 2), max_num_batched_tokens=8192, kv_pin_ttl=600,
                        kv_pull_timeout=120, kv_peer_allow=("127.0.0.1",), kv_secret=SECRET,
                        enable_prefix_caching=False)


def prefill_process(cfg_kw: dict, conn) -> None:
    """The prefill engine: prefill each prompt sent for one token, answer its params; step in
    between so pins are served and released. "stop" ends it."""
    from pdserve.worker.engine.llm_engine import LLMEngine
    from pdserve.worker.request.sampling_params import SamplingParams

    engine = LLMEngine(engine_config(**cfg_kw))
    conn.send("ready")
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    while True:
        if conn.poll(0.01):
            order = conn.recv()
            if order == "stop":
                engine.shutdown()
                return
            rid, prompt = order
            engine.add_request(rid, prompt, one, {"do_remote_decode": True})
            params = None
            while params is None:
                params = next((o.kv_transfer_params for o in engine.step() if o.finished), None)
            conn.send(params)
        elif engine.has_work():
            engine.step()


class Pair:
    """A prefill engine (child process) and a decode engine (here) with one KV cache dtype."""

    def __init__(self, ckpt: str, kv_dtype: str, args, devices: tuple[str, str]):
        from pdserve.worker.engine.llm_engine import LLMEngine

        self.kv_dtype = kv_dtype
        port, decode_port = free_ports(), free_ports()
        common = dict(ckpt=ckpt, kv_dtype=kv_dtype, max_len=PROMPT_DECODE + 256 if not args.smoke else 1024,
                      batch=args.batch, smoke=args.smoke)
        share = devices[0] == devices[1]
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=prefill_process, daemon=True, args=(dict(
            common, role="prefill", device=devices[1], port=port, util=0.4 if share else 0.85), child))
        self.proc.start()
        while not self.conn.poll(1.0):  # the prefill engine sizes its cache before this one takes the rest
            if not self.proc.is_alive():
                raise RuntimeError(f"the prefill process exited with {self.proc.exitcode}")
        assert self.conn.recv() == "ready"
        self.engine = LLMEngine(engine_config(**common, role="decode", device=devices[0], port=decode_port,
                                              util=0.45 if share else 0.85))
        self.pulls: list[tuple[float, int]] = []
        conn = self.engine.kv_connector
        pull = conn._pull

        def timed(*a, **kw):  # the pull as the connector runs it (lease, READ, release), on its pool thread
            t = time.perf_counter()
            nbytes = pull(*a, **kw)
            self.pulls.append((time.perf_counter() - t, nbytes))
            return nbytes

        conn._pull = timed

    def close(self) -> None:
        self.conn.send("stop")
        self.proc.join(60)
        if self.proc.is_alive():
            self.proc.kill()
        self.engine.shutdown()

    def cache_facts(self) -> dict:
        cache = self.engine.kv_cache
        return {"kv_bytes_per_token": cache.block_bytes // cache.block_size, "blocks": cache.num_blocks,
                "tokens": cache.num_blocks * cache.block_size, "layout": str(cache.layout)}

    def handoff(self, prompt: list[int], transport: str, rid: str) -> dict:
        from pdserve.worker.request.sampling_params import SamplingParams

        self.conn.send((rid, prompt))
        from dataclasses import replace

        params = replace(self.conn.recv(), transport=transport)  # the same pin, read over NIXL or TCP
        before = len(self.pulls)
        t0 = time.perf_counter()
        self.engine.add_request(rid, prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), params)
        second = None
        while self.engine.has_work():
            for o in self.engine.step():
                if second is None and o.new_token_ids:
                    second = time.perf_counter() - t0
        assert len(self.pulls) == before + 1, "the decode engine did not pull (a local prefill instead?)"
        pull_s, nbytes = self.pulls[-1]
        return {"pull_s": pull_s, "bytes": nbytes, "to_second_token_s": second}

    def decode_rate(self, prompts: list[list[int]], steps: int) -> dict:
        """Median decode-step seconds once every sequence decodes, and tokens/s."""
        from pdserve.worker.request.sampling_params import SamplingParams

        e = self.engine
        for i, p in enumerate(prompts):
            e.add_request(f"dec-{len(prompts)}-{i}-{random.random()}", p,
                          SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
        times, decoding = [], False
        while e.has_work():
            t = time.perf_counter()
            outs = e.step()
            dt = time.perf_counter() - t
            # A step in which every sequence emitted its token and none prefilled is a decode step.
            if decoding and len(outs) == len(prompts):
                times.append(dt)
            decoding = decoding or (e.stats().num_waiting == 0 and len(outs) == len(prompts))
        ms = statistics.median(times[1:] or times) * 1e3
        return {"batch": len(prompts), "ms_step": ms, "tok_s": len(prompts) / ms * 1e3, "steps": len(times)}


def run(args) -> dict:
    device = "cpu" if args.smoke else "cuda"
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    devices = (device, device) if gpus < 2 else ("cuda:0", "cuda:1")
    if device == "cuda":  # GPU memory over NVLink (two cards) or within one card, as tools/gpu/perf.sh
        os.environ.setdefault("UCX_TLS", "cuda_ipc,cuda_copy,tcp")
    rng = random.Random(0)
    out: dict = {"devices": devices, "ucx_tls": os.environ.get("UCX_TLS", "UCX's default"),
                 "card": torch.cuda.get_device_name(0) if gpus else "cpu", "rows": {}}
    tmp = tempfile.mkdtemp(prefix="pdserve-fp8kv-")
    try:
        t0 = time.perf_counter()
        out["checkpoint"] = write_checkpoint(tmp, args.smoke, device)
        out["checkpoint"]["seconds"] = round(time.perf_counter() - t0, 1)
        vocab = out["checkpoint"]["vocab"]
        n_handoff = 200 if args.smoke else PROMPT_HANDOFF
        n_decode = 600 if args.smoke else PROMPT_DECODE
        steps = 8 if args.smoke else DECODE_STEPS

        def prompt(n):
            return [rng.randrange(3, vocab) for _ in range(n)]

        for kv_dtype in ("auto", "fp8"):
            t0 = time.perf_counter()
            pair = Pair(tmp, kv_dtype, args, devices)
            row: dict = {"start_s": round(time.perf_counter() - t0, 1), **pair.cache_facts()}
            try:
                for transport in ("nixl", "tcp"):
                    pair.handoff(prompt(n_handoff), transport, f"warm-{kv_dtype}-{transport}")
                    runs = [pair.handoff(prompt(n_handoff), transport, f"h-{kv_dtype}-{transport}-{i}")
                            for i in range(args.handoffs)]
                    row[transport] = {
                        "bytes": runs[0]["bytes"],
                        "pull_ms": statistics.median(r["pull_s"] for r in runs) * 1e3,
                        "to_second_token_ms": statistics.median(r["to_second_token_s"] for r in runs) * 1e3,
                    }
                    print(f"[fp8kv] {kv_dtype} {transport}: {row[transport]}", flush=True)
                row["decode"] = [pair.decode_rate([prompt(n_decode) for _ in range(b)], steps)
                                 for b in sorted({1, args.batch})]
                print(f"[fp8kv] {kv_dtype} decode: {row['decode']}", flush=True)
            finally:
                pair.close()
                del pair
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
            out["rows"][kv_dtype] = row
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def table(res: dict, smoke: bool) -> str:
    rows = res["rows"]
    base, fp8 = rows.get("auto"), rows.get("fp8")
    where = f"{res['card']} · prefill on {res['devices'][1]}, decode on {res['devices'][0]} · UCX_TLS={res['ucx_tls']}"
    lines = [
        f"FP8 KV cache vs bf16 KV ({res['checkpoint']['model']}, random bf16 weights{', SMOKE: CPU, tiny' if smoke else ''})",  # noqa: E501
        f"{where} · {time.strftime('%Y-%m-%d', time.gmtime())}",
        "",
        "| KV cache | layout | KV bytes/token | tokens in the decode cache | "
        f"hand-off {PROMPT_HANDOFF if not smoke else 200} tok: NIXL pull ms | NIXL → 2nd token ms | "
        "TCP pull ms | TCP → 2nd token ms | MB moved |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in rows.items():
        lines.append(f"| {name} | `{r['layout']}` | {r['kv_bytes_per_token']} | {r['tokens']} | "
                     f"{r['nixl']['pull_ms']:.1f} | {r['nixl']['to_second_token_ms']:.1f} | "
                     f"{r['tcp']['pull_ms']:.1f} | {r['tcp']['to_second_token_ms']:.1f} | "
                     f"{r['nixl']['bytes'] / 1e6:.1f} |")
    lines += ["", f"| KV cache | decode at {PROMPT_DECODE if not smoke else 600} context: batch | ms/step | tok/s | "
                  "vs bf16 KV |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, r in rows.items():
        for i, d in enumerate(r["decode"]):
            ratio = ""
            if base and name != "auto":
                ratio = f"{d['tok_s'] / base['decode'][i]['tok_s']:.2f}×"
            lines.append(f"| {name} | {d['batch']} | {d['ms_step']:.2f} | {d['tok_s']:.0f} | {ratio} |")
    if base and fp8:
        lines += ["", f"fp8 / bf16: bytes per token {fp8['kv_bytes_per_token'] / base['kv_bytes_per_token']:.2f}×, "
                      f"cache tokens {fp8['tokens'] / base['tokens']:.2f}×, NIXL pull "
                      f"{fp8['nixl']['pull_ms'] / base['nixl']['pull_ms']:.2f}×, TCP pull "
                      f"{fp8['tcp']['pull_ms'] / base['tcp']['pull_ms']:.2f}× (same run)."]
    lines += ["", f"Checkpoint written in {res['checkpoint']['seconds']} s; engine pairs started in "
                  + ", ".join(f"{k} {v['start_s']} s" for k, v in rows.items()) + "."]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench fp8-kv", description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the table (markdown) here, and the raw numbers beside it (.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU: checks the script, times nothing")
    ap.add_argument("--handoffs", type=int, default=5, help="measured hand-offs per transport and KV dtype")
    ap.add_argument("--batch", type=int, default=8, help="the larger decode batch at 8k context")
    args = ap.parse_args(argv)
    res = run(args)
    publish(table(res, args.smoke), args.out)
    if args.out:
        Path(args.out).with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
