"""LoRA adapters on one GPU (issue 48's table; not a test): the base model vs the same weights
serving rank-16 adapters on every projection, same run, same card.

    pdserve bench lora [--out lora.md] [--cpu | --smoke] [--kernels | --kernels-only]   (tools/gpu/lora.sh)

Llama-3.1-8B-shaped random bf16 weights (--load-format dummy: made on the card, nothing written)
and N random PEFT adapters (rank 16, lora_alpha 32, q/k/v/o/gate/up/down of every layer) written
by peft's own save_pretrained, over a model built on the meta device (the base weights are never
materialized: only the adapters' A and B are made). Then the engines, one after the other:

- no LoRA: the base alone (no --enable-lora): the baseline;
- LoRA: --enable-lora --max-loras N --max-lora-rank 16 with every adapter loaded, its requests
  spread round-robin over 0 (the base model through the LoRA layers' slot -1), 1, 4 and N of them;
- LoRA, shrinks in line (GPU; --inline-adapters, default 4): the same with every BGMV shrink on
  the compute stream (PDSERVE_LORA_FORK_SHRINK=0), where the engine's default forks each onto a
  second stream beside its base GEMM (worker/lora/layer.py FORK_SHRINK).

Each: decode ms/step (median of --decode-steps steps once every request decodes; CUDA graphs)
at batch 1, 8 and 64 (batch 1 runs one adapter whatever the spread); the prefill of one
--prefill-tokens prompt (ms; median of 3; the adapter the spread's first); offline output tok/s
of --num-prompts prompts of --offline-input / --offline-output tokens. Ratios are against the
no-LoRA row of the same run. Issue 48's target: <= 1.25x the base's step at batch 8 with 4 adapters.
`--kernels` adds the BGMV kernels' own tables (bench/lora_kernels.py: a decode step's LoRA
launches in a CUDA graph, unfused vs packed, the shrink's K_PER_SPLIT swept, and beside the base
GEMMs); `--kernels-only` runs just them. `--cpu` runs the same table on the CPU engine (the torch
references) with a tiny Llama (2 layers, hidden 64); `--smoke` is --cpu with every size cut down,
to check the script (its times mean nothing).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import torch

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# What the steps are timed with: wall time, or with --cpu-time the process's CPU time (one torch
# thread), which a machine shared with other jobs inflates far less than the wall clock.
CLOCK = time.perf_counter


def write_base(path: str, tiny: bool) -> dict:
    """The real shape's config and a word tokenizer, no weights (--load-format dummy)."""
    from transformers import LlamaConfig

    from pdserve.bench.engine import save_tokenizer
    from pdserve.bench.model_shapes import MODELS

    spec = MODELS["tiny-llama" if tiny else "llama-3.1-8b"]
    cfg = LlamaConfig(**spec.hf, bos_token_id=1, eos_token_id=2, architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(path)
    save_tokenizer(path)
    return {"model": spec.name, "cfg": cfg}


def write_adapters(cfg, out: str, n: int, rank: int) -> list[str]:
    """N PEFT adapters of `cfg`'s model, random A and B, saved by peft. The base is built on the
    meta device (no memory, no time); each adapter's matrices are made for real before saving."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise SystemExit("pdserve bench lora writes its adapters with peft: pip install peft") from None
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LINEARS, lora_dropout=0.0,
                                            init_lora_weights=False))
    paths = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        for name, module in model.named_modules():
            for side in ("lora_A", "lora_B"):
                layer = getattr(module, side, None)
                if isinstance(layer, torch.nn.ModuleDict) and "default" in layer:
                    w = layer["default"].weight
                    # Small values: a dummy base's activations stay finite under the adapter.
                    data = torch.randn(w.shape, generator=g, dtype=torch.float32).mul_(0.01).to(torch.bfloat16)
                    layer["default"].weight = torch.nn.Parameter(data, requires_grad=False)
        path = os.path.join(out, f"lora{i}")
        model.save_pretrained(path)
        paths.append(path)
    return paths


def start_engine(path: str, device: str, adapters: list[str], rank: int, max_num_seqs: int, max_model_len: int):
    from pdserve.worker.config.engine import EngineConfig
    from pdserve.worker.engine.llm_engine import LLMEngine

    lora = dict(enable_lora=True, max_loras=len(adapters), max_lora_rank=rank,
                lora_modules=tuple(f"lora{i}={p}" for i, p in enumerate(adapters))) if adapters else {}
    return LLMEngine(EngineConfig(model=path, device=device, dtype="bfloat16" if device == "cuda" else "float32",
                                  load_format="dummy", max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=16384, enable_prefix_caching=False,
                                  kv_cache_memory=None if device == "cuda" else 1 << 26, **lora))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def spread(n_adapters: int, count: int) -> list[str | None]:
    """Each request's adapter: round-robin over the first n (None: the base model)."""
    return [f"lora{i % n_adapters}" if n_adapters else None for i in range(count)]


def decode_ms(engine, prompts: list[list[int]], loras: list[str | None], steps: int) -> float:
    """Median wall ms of the steps in which every request decodes (after the last prefill, before
    the first request ends)."""
    from pdserve.worker.request.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    tag = random.random()
    for i, (p, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(f"d{tag}-{i}", p, params, lora_name=lora)
    started, times = set(), []
    while engine.has_work():
        decoding = len(started) == len(prompts)
        t0 = CLOCK()
        outs = engine.step()
        dt = CLOCK() - t0
        started |= {o.request_id for o in outs if o.new_token_ids}
        if decoding and not any(o.finished for o in outs):
            times.append(dt)
    return 1e3 * statistics.median(times[:steps])


def prefill_ms(engine, prompt: list[int], lora: str | None, device: str) -> float:
    from pdserve.worker.request.sampling_params import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    runs = []
    for i in range(4):  # the first compiles; the median of the other three
        sync(device)
        t0 = CLOCK()
        engine.generate([prompt], one, [lora])
        sync(device)
        runs.append(CLOCK() - t0)
    return 1e3 * statistics.median(runs[1:])


def offline_tok_s(engine, prompts: list[list[int]], loras: list[str | None], out_tokens: int, device: str) -> float:
    from pdserve.worker.request.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(prompts, params, loras)  # warm-up: the same batch mix compiles the same kernels
    sync(device)
    t0 = CLOCK()
    outs = engine.generate(prompts, params, loras)
    return sum(len(o) for o in outs) / (CLOCK() - t0)


def measure(engine, label: str, n_adapters: int, args, rng: random.Random) -> dict:
    vocab = engine.model_config.vocab_size
    row = {"engine": label, "adapters": n_adapters}
    for b in args.batches:
        prompts = [[rng.randrange(3, vocab) for _ in range(args.decode_input)] for _ in range(b)]
        decode_ms(engine, prompts, spread(n_adapters, b), 4)  # warm-up
        row[f"bs{b}_ms"] = decode_ms(engine, prompts, spread(n_adapters, b), args.decode_steps)
        print(f"{label}, {n_adapters} adapters: bs={b} decode {row[f'bs{b}_ms']:.3f} ms/step", flush=True)
    prompt = [rng.randrange(3, vocab) for _ in range(args.prefill_tokens)]
    row["prefill_ms"] = prefill_ms(engine, prompt, spread(n_adapters, 1)[0], args.device)
    print(f"{label}, {n_adapters} adapters: prefill {args.prefill_tokens} tokens {row['prefill_ms']:.1f} ms",
          flush=True)
    if args.num_prompts:
        prompts = [[rng.randrange(3, vocab) for _ in range(args.offline_input)] for _ in range(args.num_prompts)]
        row["offline_tok_s"] = offline_tok_s(engine, prompts, spread(n_adapters, args.num_prompts),
                                             args.offline_output, args.device)
        print(f"{label}, {n_adapters} adapters: offline {row['offline_tok_s']:.0f} tok/s", flush=True)
    return row


def best_of(runs: list[dict]) -> dict:
    """One row from repeated measurements: each time's least, each throughput's most."""
    row = dict(runs[0])
    for key, value in row.items():
        if key.endswith("_ms"):
            row[key] = min(r[key] for r in runs)
        elif key.endswith("_tok_s"):
            row[key] = max(r[key] for r in runs)
    return row


def table(rows: list[dict], args, meta: dict) -> list[str]:
    base = rows[0]
    cols = [f"bs{b}_ms" for b in args.batches] + ["prefill_ms", "offline_tok_s"]
    heads = [f"bs={b} ms/step" for b in args.batches] + [f"prefill {args.prefill_tokens} ms", "offline tok/s"]
    lines = [f"# LoRA: {meta['model']}, rank {args.rank} on all 7 projections, {meta['device']}",
             "", f"{meta['date']}; `pdserve bench lora {' '.join(meta['argv'])}`. "
             f"Decode: median of {args.decode_steps} steps, {args.decode_input}-token prompts; offline: "
             f"{args.num_prompts} x {args.offline_input}/{args.offline_output} tokens"
             f"{f'; each cell the best of {args.repeat} runs' if args.repeat > 1 else ''}"
             f"{'; times are the process CPU time on one torch thread (--cpu-time)' if args.cpu_time else ''}"
             ". Ratios: against the "
             "no-LoRA engine of the same run (step time: higher is slower; throughput: lower is slower).", "",
             "| engine | adapters in use | " + " | ".join(heads) + " |",
             "| --- | ---: | " + " | ".join("---:" for _ in heads) + " |"]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            if v is None:
                cells.append("")
                continue
            text = f"{v:.0f}" if c == "offline_tok_s" else f"{v:.2f}"
            if r is not base and base.get(c):
                text += f" ({v / base[c]:.2f}x)"
            cells.append(text)
        lines.append(f"| {r['engine']} | {r['adapters']} | " + " | ".join(cells) + " |")
    for engine in ("LoRA", "LoRA, shrinks in line"):
        target = next((r for r in rows if r["engine"] == engine and r["adapters"] == 4), None)
        if target is not None and "bs8_ms" in target and base.get("bs8_ms"):
            ratio = target["bs8_ms"] / base["bs8_ms"]
            lines += ["", f"Issue 48's target, batch 8 with 4 adapters <= 1.25x the base step ({engine}): "
                          f"{ratio:.2f}x ({'met' if ratio <= 1.25 else 'missed'})."]
    return lines


def write_out(path: str | None, text: str, rows: dict | None) -> None:
    """The table (markdown) at `path`, the rows as JSON beside it."""
    if not path:
        return
    with open(path, "w") as f:
        f.write(text)
    if rows is not None:
        with open(os.path.splitext(path)[0] + ".json", "w") as f:
            json.dump(rows, f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench lora", description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the table (markdown) here; the rows as JSON beside it (.json)")
    ap.add_argument("--cpu", action="store_true", help="the CPU engine with a tiny Llama (the table small)")
    ap.add_argument("--smoke", action="store_true", help="--cpu with every size cut down: checks the script")
    ap.add_argument("--workdir", help="where the config and adapters go (default: a temporary folder, removed)")
    ap.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 4, 8], help="adapters in use per LoRA row")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--decode-input", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--offline-input", type=int, default=1024)
    ap.add_argument("--offline-output", type=int, default=128)
    ap.add_argument("--inline-adapters", type=int, nargs="*", default=[4],
                    help="on a GPU, a third engine's rows at these spreads: LoRA with every shrink on the compute "
                         "stream (PDSERVE_LORA_FORK_SHRINK=0; the default forks each beside its base GEMM); "
                         "none: no third engine")
    ap.add_argument("--cpu-time", action="store_true",
                    help="with --cpu: time the process's CPU time on one torch thread, not the wall clock")
    ap.add_argument("--repeat", type=int, default=1,
                    help="measure each row this many times and keep each cell's best (a shared, noisy machine)")
    ap.add_argument("--kernels", action="store_true",
                    help="also time the BGMV kernels alone at Llama-8B's projections (bench/lora_kernels.py; GPU)")
    ap.add_argument("--kernels-only", action="store_true", help="only that kernel table, no engine")
    args = ap.parse_args(argv)
    args.cpu = args.cpu or args.smoke
    if args.cpu_time:
        if not args.cpu:
            ap.error("--cpu-time: needs --cpu (a GPU's work is not the process's CPU time)")
        global CLOCK
        CLOCK = time.process_time
        torch.set_num_threads(1)
    args.device = "cpu" if args.cpu else "cuda"
    if args.smoke:
        args.batches, args.decode_steps, args.prefill_tokens = [1, 4], 4, 64
        args.num_prompts, args.offline_input, args.offline_output = 4, 32, 8
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA GPU: run with --cpu (or --smoke) on the CPU", file=sys.stderr)
        return 2
    kernel_lines = []
    if (args.kernels or args.kernels_only) and not args.cpu:
        from pdserve.bench.lora_kernels import run as kernel_table

        kernel_lines = kernel_table()
        gc.collect()
        torch.cuda.empty_cache()
        if args.kernels_only:
            write_out(args.out, "\n".join(kernel_lines) + "\n", None)
            return 0
    work = args.workdir or tempfile.mkdtemp(prefix="pdserve-lora-")
    try:
        base = write_base(os.path.join(work, "base"), args.cpu)
        t0 = time.perf_counter()
        adapters = write_adapters(base["cfg"], os.path.join(work, "adapters"), max(args.adapters), args.rank)
        print(f"{len(adapters)} adapters written by peft in {time.perf_counter() - t0:.0f}s", flush=True)
        max_len = max(args.prefill_tokens, args.offline_input + args.offline_output, args.decode_input
                      + args.decode_steps + 16) + 16
        max_seqs = max(max(args.batches), args.num_prompts, 2)
        rows = []
        engines = [("no LoRA", [], args.adapters), ("LoRA", adapters, args.adapters)]
        if args.device == "cuda" and args.inline_adapters:
            engines.append(("LoRA, shrinks in line", adapters, args.inline_adapters))
        for label, loaded, spreads in engines:
            rng = random.Random(7)  # the same prompts for every engine
            from pdserve.worker.lora import layer

            layer.FORK_SHRINK = label != "LoRA, shrinks in line"  # read when the engine makes its LoRAContext
            engine = start_engine(os.path.join(work, "base"), args.device, loaded, args.rank, max_seqs, max_len)
            try:
                for n in ([0] if not loaded else spreads):
                    runs = []
                    for _ in range(max(1, args.repeat)):
                        runs.append(measure(engine, label, n, args, rng))
                        rng = random.Random(7)
                    rows.append(best_of(runs))
            finally:
                engine.shutdown()
                del engine
                gc.collect()
                if args.device == "cuda":
                    torch.cuda.empty_cache()
        device = torch.cuda.get_device_name(0) if args.device == "cuda" else \
            f"CPU ({os.cpu_count()} cores{', --smoke' if args.smoke else ''})"
        meta = {"model": base["model"], "device": device, "argv": sys.argv[1:] if argv is None else argv,
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
        text = "\n".join(table(rows, args, meta) + kernel_lines) + "\n"
        print(text)
        write_out(args.out, text, {"meta": meta, "rows": rows})
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
