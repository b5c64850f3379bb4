"""gpt-oss on one GPU (issue 46's "Measure"), with --load-format dummy: no weight file is written
or read, so gpt-oss-120b's ~65 GB fit a machine with a 64 GiB disk. tools/gpu/gpt_oss.sh runs the
subcommands one process each (a failed or killed one costs only its row):

  config    config.json as published (gpt-oss-120b, or -20b: 24 layers, 32 experts), MXFP4 experts
            (--format bf16: no quantization_config) + a word tokenizer covering the vocabulary
  engine    one engine on cuda:0: bs=1 decode ms/step (CUDA graphs where the model has them) against
            the active-parameter roofline (bytes of every layer's attention, router and top-k
            experts, and lm_head, in the checkpoint's formats / the same run's copy bandwidth);
            offline 1024-in/128-out output tok/s. Appends a JSON row to --rows. --profile FILE:
            the bs=1 steps' kernels by GPU time under torch.profiler, a markdown table.
  capacity  KV capacity at --prompt-len prompts in --kv-gib of KV memory: --requests such requests
            sent at once, stepped until the first one ends: how many were resident at once
            (prompt prefilled), and the KV tokens each held; once per window mode (window-aware
            release on, off) where this tree has the switch. Appends rows.
  pd        `pdserve up` on one card: one aggregated worker, then 1 prefill + 1 decode sharing the
            card, each loaded at --rate req/s of --input-len/--output-len for --seconds: TTFT,
            steady ITL and the first gap after the first token (p50/p99). Appends rows.
  report    the rows as a markdown table (--out) and JSON (--json).

--device cpu with `config --tiny` runs every subcommand on CPU (tiny shapes; times nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

# https://huggingface.co/openai/gpt-oss-120b/raw/main/config.json (layer_types: 18 x [sliding, full]);
# gpt-oss-20b's differs in num_hidden_layers (24) and num_local_experts (32) only.
PUBLISHED = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
    "initializer_range": 0.02, "intermediate_size": 2880, "max_position_embeddings": 131072, "model_type": "gpt_oss",
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_key_value_heads": 8, "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 201088,
}
SIZES = {"120b": dict(num_hidden_layers=36, num_local_experts=128), "20b": dict(num_hidden_layers=24,
                                                                             num_local_experts=32)}
TINY = dict(hidden_size=64, intermediate_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, experts_per_token=2, vocab_size=512,
            sliding_window=16, max_position_embeddings=4096, eos_token_id=2, pad_token_id=0)
MXFP4_BYTES = 0.5 + 1 / 32  # a 4-bit value and a shared 8-bit scale per 32
# Window-aware KV release on / off: the engine flag this tree has for it (vLLM's name), if any.
WINDOW_FLAGS = ("disable_hybrid_kv_cache_manager",)


def log(msg: str) -> None:
    print(f"[gpt-oss {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_config(size: str, fmt: str, tiny: bool) -> dict:
    cfg = {**PUBLISHED, **SIZES[size], **(TINY if tiny else {})}
    cfg["layer_types"] = ["sliding_attention", "full_attention"] * (cfg["num_hidden_layers"] // 2)
    if fmt == "bf16":
        del cfg["quantization_config"]
    return cfg


def cmd_config(args) -> int:
    from pdserve.bench.disagg import save_word_tokenizer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = make_config(args.size, args.format, args.tiny)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    eos = [200002, 199999, 200012] if not args.tiny else [cfg["eos_token_id"]]  # gpt-oss's: <|return|>, ..., <|call|>
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": cfg["pad_token_id"]}))
    save_word_tokenizer(str(out), cfg["vocab_size"])
    log(f"config {args.size} {args.format}{' tiny' if args.tiny else ''}: {out} (no weights)")
    return 0


def step_bytes(cfg: dict) -> dict:
    """Weight bytes a bs=1 decode step reads, by part, in the checkpoint's formats: per layer the
    attention (q/k/v/o + biases + sinks, bf16), the router (bf16) and top-k experts (MXFP4 blocks +
    scales, or bf16; biases bf16), then lm_head. The embedding row, norms and KV are left out."""
    h, hd, e, k, inter = (cfg["hidden_size"], cfg["head_dim"], cfg["num_local_experts"], cfg["num_experts_per_tok"],
                          cfg["intermediate_size"])
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    attn = 2 * (h * (q + 2 * kv) + (q + 2 * kv) + q * h + h + cfg["num_attention_heads"])
    router = 2 * (e * h + e)
    per_weight = MXFP4_BYTES if "quantization_config" in cfg else 2
    expert = per_weight * (2 * inter * h + h * inter) + 2 * (2 * inter + h)
    layers = cfg["num_hidden_layers"]
    parts = {"attention": layers * attn, "router": layers * router, "experts": layers * k * expert,
             "lm_head": 2 * cfg["vocab_size"] * h}
    parts["total"] = sum(parts.values())
    return parts


def _error(e: Exception) -> str:
    """An exception for a row: its type and the end of its message (a stack's start failure ends
    in the worker's own traceback)."""
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= 1200 else f"{type(e).__name__}: ...{text[-1200:]}"


def _note(row: dict) -> str:
    """A row's error as one table cell: its last line naming an error (a stack's worker's
    exception, not the stack's own last words), else its last line; without pipes."""
    lines = [line.strip() for line in row.get("error", "").splitlines() if line.strip()]
    named = [line for line in lines if "Error" in line or "error" in line]
    return ((named or lines or [""])[-1]).replace("|", "/")[:200]


def _append(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def _engine(args, **over):
    from pdserve.worker.config.engine import EngineConfig
    from pdserve.worker.engine.llm_engine import LLMEngine

    kw = dict(model=args.checkpoint, device=args.device, dtype="bfloat16" if args.device != "cpu" else "float32",
              load_format="dummy", max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)
    kw.update(over)
    return LLMEngine(EngineConfig(**kw))


def _expert_format(eng) -> str:
    """What the loaded model keeps its experts in (a tree that dequantizes MXFP4 at load says bf16)."""
    try:
        model = eng.runner.model
        seen = {(n.rsplit(".", 1)[-1], str(p.dtype)) for n, p in model.named_parameters() if ".experts." in n
                or "w13" in n or "w2" in n}
        seen |= {(n.rsplit(".", 1)[-1], str(b.dtype)) for n, b in model.named_buffers() if "w13" in n or "w2" in n}
        return ", ".join(f"{n} {d.removeprefix('torch.')}" for n, d in sorted(seen)) or "unknown"
    except Exception as e:  # the row still has its times
        return f"unknown ({type(e).__name__})"


def _copy_bandwidth(device: str) -> float:
    if device == "cpu":
        return math.nan
    from pdserve.bench.kernels import copy_bandwidth

    return copy_bandwidth()


def cmd_engine(args) -> int:
    import torch

    from pdserve.bench.engine import decode_step_seconds
    from pdserve.worker.request.sampling_params import SamplingParams

    row = {"kind": "engine", "name": args.name, "device": args.device}
    try:
        cfg = json.loads((Path(args.checkpoint) / "config.json").read_text())
        row.update(layers=cfg["num_hidden_layers"], experts=cfg["num_local_experts"],
                   format="mxfp4" if "quantization_config" in cfg else "bf16")
        bw = _copy_bandwidth(args.device)
        row["copy_gbs"] = bw / 1e9
        row["card"] = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
        from pdserve.bench.engine import SWITCH
        from pdserve.worker.attention.triton_backend import TritonAttentionBackend

        # Read when the model is built: None, the engine's default, takes the measured shapes.
        TritonAttentionBackend.fused_gemv = SWITCH[args.fused_gemv]
        row["fused_gemv"] = args.fused_gemv
        if args.router_linear:  # every step's router as F.linear + the routing kernel, as before moe_gate
            from pdserve.worker.models import moe

            moe.FUSED_GATE = False
        row["router"] = "F.linear + moe_route" if args.router_linear else "moe_gate up to 16 tokens"
        t0 = time.perf_counter()
        eng = _engine(args)
        row["start_s"] = time.perf_counter() - t0
        row["graphs"] = eng.runner.graphs is not None
        row["expert_format"] = _expert_format(eng)
        log(f"{args.name}: started in {row['start_s']:.0f}s, experts as {row['expert_format']}")
        rng = random.Random(7)
        try:
            prompt = [rng.randrange(3, cfg["vocab_size"]) for _ in range(128)]
            decode_step_seconds(eng, prompt, 8)  # warm-up (graphs, autotuning)
            row["decode_ms"] = 1e3 * statistics.median(decode_step_seconds(eng, prompt, args.decode_steps))
            parts = step_bytes(cfg)
            row["step_gb"] = {k: v / 1e9 for k, v in parts.items()}
            row["roofline_ms"] = 1e3 * parts["total"] / bw
            row["roofline_pct"] = 100 * row["roofline_ms"] / row["decode_ms"]
            log(f"{args.name}: bs=1 {row['decode_ms']:.2f} ms/step, roofline {row['roofline_ms']:.2f} ms")
            if args.profile:  # the same bs=1 steps' kernels by GPU time (bench/engine.py's table)
                from pdserve.bench.engine import profile_decode

                row["gpu_ms"] = profile_decode(eng, prompt, args.profile, title=f"{args.name} bs=1 decode")
                log(f"{args.name}: profile in {args.profile}, GPU kernels {row['gpu_ms']:.2f} ms/step")
            if args.num_prompts:
                prompts = [[rng.randrange(3, cfg["vocab_size"]) for _ in range(args.input_len)]
                           for _ in range(args.num_prompts)]
                eng.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # compiles
                params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
                t1 = time.perf_counter()
                outs = eng.generate(prompts, params)
                row["offline_s"] = time.perf_counter() - t1
                row["offline_tok_s"] = sum(len(o) for o in outs) / row["offline_s"]
                row["offline"] = f"{args.num_prompts} x {args.input_len}/{args.output_len}"
                log(f"{args.name}: offline {row['offline_tok_s']:.0f} output tok/s")
        finally:
            eng.shutdown()
    except Exception as e:
        row["error"] = _error(e)
        traceback.print_exc()
    _append(args.rows, row)
    return 0 if "error" not in row else 1


def _window_modes() -> list[tuple[str, dict]]:
    """(label, EngineConfig overrides) per window mode this tree can run."""
    from pdserve.worker.config.engine import EngineConfig

    names = {f.name for f in dataclasses.fields(EngineConfig)}
    flag = next((f for f in WINDOW_FLAGS if f in names), None)
    if flag is None:
        return [("every layer keeps all blocks (this tree has no window-aware release)", {})]
    return [("window-aware release on", {flag: False}), ("release off (--" + flag.replace("_", "-") + ")",
                                                        {flag: True})]


def cmd_capacity(args) -> int:
    from pdserve.worker.request.sampling_params import SamplingParams

    cfg = json.loads((Path(args.checkpoint) / "config.json").read_text())
    status = 0
    for label, over in _window_modes():
        row = {"kind": "capacity", "name": args.name, "mode": label, "prompt_len": args.prompt_len,
               "kv_gib": args.kv_gib}
        try:
            t0 = time.perf_counter()
            eng = _engine(args, kv_cache_memory=int(args.kv_gib * (1 << 30)), max_num_seqs=args.requests,
                          max_model_len=args.prompt_len + 64, enforce_eager=True, **over)
            try:
                total = eng.stats().num_total_blocks
                row["total_blocks"], row["block_size"] = total, eng.config.block_size
                rng = random.Random(11)
                params = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
                for i in range(args.requests):
                    eng.add_request(f"cap{i}", [rng.randrange(3, cfg["vocab_size"]) for _ in range(args.prompt_len)],
                                    params)
                peak, peak_used, steps, deadline = 0, 0, 0, time.monotonic() + args.timeout
                # Until the first request ends: the first cohort is as many as ever fit at once.
                done = False
                while eng.has_work() and not done and time.monotonic() < deadline:
                    done = any(o.finished for o in eng.step())
                    steps += 1
                    s = eng.stats()
                    resident = sum(1 for r in eng.scheduler.running if r.num_computed_tokens >= args.prompt_len)
                    if resident > peak or (resident == peak and total - s.num_free_blocks > peak_used):
                        peak, peak_used = resident, total - s.num_free_blocks
                s = eng.stats()
                row.update(resident_peak=peak, used_blocks_at_peak=peak_used, preemptions=s.num_preemptions,
                           steps=steps, first_finished=done, seconds=time.perf_counter() - t0,
                           kv_tokens=total * eng.config.block_size)
                if peak:
                    row["tokens_per_request"] = peak_used * eng.config.block_size / peak
                log(f"{args.name} capacity ({label}): {peak} x {args.prompt_len}-token requests resident, "
                    f"{total} blocks, {s.num_preemptions} preemptions")
            finally:
                eng.shutdown()
        except Exception as e:
            row["error"] = _error(e)
            traceback.print_exc()
            status = 1
        _append(args.rows, row)
    return status


def _pct(values: list[float], p: float) -> float:
    from pdserve.bench.handoff_report import pct

    return pct(values, p)


def cmd_pd(args) -> int:
    from pdserve.bench import serve
    from pdserve.bench.disagg import UpStack

    status = 0
    transport = args.transport
    if transport == "auto":
        try:
            import nixl_cu13  # noqa: F401

            transport = "nixl"
        except ImportError:
            transport = "tcp"
    smoke = args.device == "cpu"
    for name, prefill, decode in (("aggregated, 1 worker", 0, 1), (f"1P1D on one card ({transport})", 1, 1)):
        row = {"kind": "pd", "name": args.name, "stack": name, "rate": args.rate, "input_len": args.input_len,
               "output_len": args.output_len}
        work = Path(args.work) / ("agg" if not prefill else "pd")
        stack = None
        try:
            t0 = time.perf_counter()
            stack = UpStack(args.checkpoint, prefill, decode, work / "logs", smoke,
                            transport=transport if prefill else None,
                            max_model_len=args.input_len + args.output_len + 64,
                            worker_args=f"--load-format dummy {args.worker_args}".strip()).start(args.ready_timeout)
            row["start_s"] = time.perf_counter() - t0
            log(f"{args.name} {name}: up in {row['start_s']:.0f}s")
            argv = ["--base-url", stack.children["router"], "--model", "llama", "--tokenizer", args.checkpoint,
                    "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--request-rate",
                    str(args.rate), "--duration", str(args.seconds), "--seed", "46", "--label", "run",
                    "--no-progress", "--no-plots", "--request-timeout", "120", "--warmup-requests", "2",
                    "--out", str(work / "runs")]
            serve.main(argv)
            run = json.loads((work / "runs" / f"run_rate-{serve.rate_name(args.rate)}.json").read_text())
            ok = [q for q in run["requests"] if q["error"] is None]
            firsts = [q["itls"][0] * 1e3 for q in ok if q["itls"]]
            steady = [g * 1e3 for q in ok for g in q["itls"][1:]]
            ttft = [q["ttft"] * 1e3 for q in ok]
            row.update(sent=run["summary"]["num_requests"], failed=run["summary"]["failed"],
                       ttft_p50_ms=_pct(ttft, 50), ttft_p99_ms=_pct(ttft, 99), itl_p50_ms=_pct(steady, 50),
                       itl_p99_ms=_pct(steady, 99), first_gap_p50_ms=_pct(firsts, 50),
                       first_gap_p99_ms=_pct(firsts, 99))
            log(f"{args.name} {name}: TTFT p50 {row['ttft_p50_ms']:.0f} ms, ITL p50 {row['itl_p50_ms']:.1f} ms, "
                f"first gap p50 {row['first_gap_p50_ms']:.1f} ms")
        except Exception as e:
            row["error"] = _error(e)
            traceback.print_exc()
            status = 1
        finally:
            if stack is not None:
                stack.stop()
        _append(args.rows, row)
    return status


def _f(v, fmt: str = ".2f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _table(rows: list[dict], header: str, align: str, cells) -> list[str]:
    """A markdown table of `rows` (none: no table), each row's cells then its error's note."""
    if not rows:
        return []
    return [header, align] + ["| " + " | ".join([*cells(r), _note(r)]) + " |" for r in rows] + [""]


def cmd_report(args) -> int:
    rows = [json.loads(line) for line in open(args.rows)] if os.path.exists(args.rows) else []
    steps = [json.loads(line) for line in open(args.steps)] if args.steps and os.path.exists(args.steps) else []
    card = next((r["card"] for r in rows if r.get("card")), "unknown card")
    lines = [f"# gpt-oss on one GPU ({card}, {time.strftime('%Y-%m-%d', time.gmtime())})", "",
             "Random weights of the published configs' shapes and formats (`--load-format dummy`); "
             "roofline = bytes of every layer's attention, router and top-4 experts plus lm_head "
             "(MXFP4 experts: 4.25 bits a weight) / the same run's device copy bandwidth.", ""]
    lines += _table(
        [r for r in rows if r["kind"] == "engine"],
        "| model | format | experts held as | bs=1 ms/step | roofline ms | % of roofline | offline output tok/s "
        "| start s | copy GB/s | note |", "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
        lambda r: [r["name"], r.get("format", "-"), r.get("expert_format", "-"), _f(r.get("decode_ms")),
                   _f(r.get("roofline_ms")), _f(r.get("roofline_pct"), ".0f"),
                   f"{r['offline_tok_s']:.0f} ({r['offline']})" if "offline_tok_s" in r else "-",
                   _f(r.get("start_s"), ".0f"), _f(r.get("copy_gbs"), ".0f")])
    lines += _table(
        [r for r in rows if r["kind"] == "pd"],
        "| model | stack | load | TTFT p50 / p99 ms | ITL p50 / p99 ms | first gap p50 / p99 ms | requests | note |",
        "|---|---|---|---:|---:|---:|---:|---|",
        lambda r: [r["name"], r["stack"], f"{r['rate']:g} req/s, {r['input_len']}/{r['output_len']}",
                   *(f"{_f(r.get(k + '_p50_ms'), fmt)} / {_f(r.get(k + '_p99_ms'), fmt)}"
                     for k, fmt in (("ttft", ".0f"), ("itl", ".1f"), ("first_gap", ".1f"))),
                   f"{r.get('sent', '-')} ({r.get('failed', '-')} failed)"])
    lines += _table(
        [r for r in rows if r["kind"] == "capacity"],
        "| model | KV mode | prompt | KV memory | blocks | requests resident at once | KV tokens each | preemptions "
        "| note |", "|---|---|---:|---:|---:|---:|---:|---:|---|",
        lambda r: [r["name"], r["mode"], str(r["prompt_len"]), f"{r['kv_gib']:g} GiB", str(r.get("total_blocks", "-")),
                   str(r.get("resident_peak", "-")), _f(r.get("tokens_per_request"), ".0f"),
                   str(r.get("preemptions", "-"))])
    if steps:
        lines += ["| step | rc | seconds |", "|---|---:|---:|"] + [f"| {s['step']} | {s['rc']} | {s['seconds']} |"
                                                               for s in steps]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"card": card, "rows": rows, "steps": steps}, indent=1))
    return 0


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="a folder `config` wrote")
    p.add_argument("--name", required=True)
    p.add_argument("--rows", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="tools/gpu/gpt_oss.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("config")
    c.add_argument("--size", choices=sorted(SIZES), default="120b")
    c.add_argument("--format", choices=("mxfp4", "bf16"), default="mxfp4")
    c.add_argument("--tiny", action="store_true", help="tiny shapes (CPU check of the plumbing)")
    c.add_argument("--out", required=True)
    e = sub.add_parser("engine")
    _engine_args(e)
    e.add_argument("--decode-steps", type=int, default=64)
    e.add_argument("--num-prompts", type=int, default=64)
    e.add_argument("--input-len", type=int, default=1024)
    e.add_argument("--output-len", type=int, default=128)
    e.add_argument("--profile", metavar="FILE", help="also profile bs=1 decode steps; the kernel table goes here")
    e.add_argument("--fused-gemv", choices=["default", "on", "off"], default="default",
                   help="the Triton backend's small-batch GEMV path (kernels/fused_gemv.py): the engine's default "
                        "(the shapes measured to win on this card), every shape, or none")
    e.add_argument("--router-linear", action="store_true",
                   help="the router as F.linear + moe_route at every size (moe_gate.py's baseline)")
    k = sub.add_parser("capacity")
    _engine_args(k)
    k.add_argument("--prompt-len", type=int, default=32768)
    k.add_argument("--kv-gib", type=float, default=8.0, help="KV memory (--kv-cache-memory): few requests fill it")
    k.add_argument("--requests", type=int, default=16, help="requests sent at once (more than fit)")
    k.add_argument("--decode-tokens", type=int, default=8)
    k.add_argument("--timeout", type=float, default=100.0, help="seconds of stepping per mode")
    p = sub.add_parser("pd")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--rows", required=True)
    p.add_argument("--work", required=True, help="logs and run JSONs")
    p.add_argument("--device", default="cuda")
    p.add_argument("--transport", default="auto", choices=("auto", "nixl", "tcp"))
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--input-len", type=int, default=3000)
    p.add_argument("--output-len", type=int, default=200)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--ready-timeout", type=float, default=240.0)
    p.add_argument("--worker-args", default="")
    r = sub.add_parser("report")
    r.add_argument("--rows", required=True)
    r.add_argument("--steps", help="the shell's step log (JSON lines: step, rc, seconds)")
    r.add_argument("--out")
    r.add_argument("--json")
    args = ap.parse_args(argv)
    return {"config": cmd_config, "engine": cmd_engine, "capacity": cmd_capacity, "pd": cmd_pd,
            "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
