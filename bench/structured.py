"""Structured-output benchmark: what a grammar costs per token, for each grammar engine.

    python -m pdserve.bench.structured [--device cpu|cuda] [--tokenizer DIR] [--batch 1 8] [--out FILE]
    pdserve bench structured ...

Two tables, for json_schema / regex / choice and each installed engine (llguidance, xgrammar):

  mask   the grammar machinery alone, as the server runs it (worker/structured/structured_output.py):
         compile ms (cold; a cached spec costs nothing), host ms per row-token to fill the
         bitmask, device ms per step to unpack it and mask a [batch, vocab] logits tensor, and
         ms per row-token to advance the matcher. Logits are random; the sampled token is the
         masked argmax, so the walk follows the grammar to its end.
  e2e    the engine end to end on two models: "tiny" (2 layers, random weights) and
         SmolLM2-135M (its real weights when --tokenizer holds them, else random weights in its
         configuration). `batch` requests decode greedily under the grammar; then the same
         prompts run without it for exactly as many output tokens each (ignore_eos), so both
         runs do the same model work. ms/token = wall time / output tokens (median of --repeats).

The vocabulary is SmolLM2's (49,152 tokens): --tokenizer is a directory with tokenizer.json
(and config.json); by default the default model's converted cache. Needs torch, transformers
and a grammar engine's wheel; it never imports the server (fastapi, pydantic).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pdserve.bench.report import markdown_table
from pdserve.worker.request.sampling_params import StructuredOutputSpec
from pdserve.worker.structured.structured_output import BACKENDS, StructuredOutputs

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 10}},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string", "maxLength": 16},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}
SPECS = {
    "json_schema": StructuredOutputSpec("json", json.dumps(SCHEMA, separators=(",", ":"))),
    "regex": StructuredOutputSpec("regex", r"([a-z]{2,8} ){3,6}[0-9]{3}-[0-9]{4}"),
    "choice": StructuredOutputSpec("choice", ("positive", "negative", "neutral", "mixed feelings")),
}
SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
               rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.2, bos_token_id=1,
            eos_token_id=2, tie_word_embeddings=False)
PROMPT = "Describe a person as JSON: name, age, tags and address."


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def installed_backends(wanted: list[str]) -> list[str]:
    out = []
    for b in wanted:
        try:
            __import__(b)
            out.append(b)
        except ImportError:
            print(f"({b} is not installed: skipped)", flush=True)
    return out


# ---- the mask machinery alone ----------------------------------------------------------------------

def bench_mask(tokenizer, vocab: int, eos: tuple[int, ...], backend: str, name: str, spec: StructuredOutputSpec,
               batch: int, device: str, max_steps: int = 96) -> dict:
    from pdserve.worker.structured.structured_output import apply_bitmask, fill_bitmask

    so = StructuredOutputs(tokenizer, vocab, eos, backend)
    so.compile(StructuredOutputSpec("regex", "warm"))  # the tokenizer view is built once per worker: not counted
    t0 = time.perf_counter()
    so.compile(spec)
    compile_ms = (time.perf_counter() - t0) * 1e3

    class Row:  # what the sampler's mask reads of a request
        def __init__(self):
            self.grammar, self.output_token_ids = so.matcher(spec), []

    warm = [Row() for _ in range(batch)]
    apply_bitmask(torch.zeros(batch, vocab, device=device), fill_bitmask(warm))  # first launches: not counted
    rows = [Row() for _ in range(batch)]
    g = torch.Generator(device=device).manual_seed(0)
    fill_s = apply_s = 0.0
    row_tokens = steps = 0
    while steps < max_steps:
        live = [r for r in rows if not (r.grammar.terminated or r.grammar.failed)]
        if not live:
            break
        logits = torch.randn(len(live), vocab, device=device, generator=g)
        sync(device)
        t0 = time.perf_counter()
        bitmask = fill_bitmask(live)  # host: advance each matcher by its last token, fill its row
        t1 = time.perf_counter()
        apply_bitmask(logits, bitmask)  # device: copy, unpack, mask
        tokens = logits.argmax(-1).tolist()  # the sampler's read-back (it happens with or without a grammar)
        sync(device)
        t2 = time.perf_counter()
        for r, t in zip(live, tokens):
            r.output_token_ids.append(t)
        fill_s += t1 - t0
        apply_s += t2 - t1
        row_tokens += len(live)
        steps += 1
    return {"engine": backend, "spec": name, "batch": batch, "compile_ms": compile_ms, "steps": steps,
            "fill_ms_tok": fill_s / row_tokens * 1e3, "apply_ms_step": apply_s / steps * 1e3}


# ---- end to end --------------------------------------------------------------------------------------

def make_checkpoint(out: Path, tokenizer_dir: Path, which: str, device: str) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(**(TINY | {"vocab_size": len(tok)} if which == "tiny" else SMOLLM2))
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.startswith("cuda") and which != "tiny" else torch.float32
    AutoModelForCausalLM.from_config(cfg, dtype=dtype).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def bench_e2e(model_dir: Path, model_name: str, backends: list[str], batches: list[int], device: str,
              repeats: int, max_tokens: int) -> list[dict]:
    from pdserve.worker.config.engine import EngineConfig
    from pdserve.worker.engine.llm_engine import LLMEngine
    from pdserve.worker.request.sampling_params import SamplingParams

    cfg = EngineConfig(model=str(model_dir), device=device, max_model_len=1024, max_num_seqs=max(batches),
                       **({"kv_cache_memory": 256 << 20} if device == "cpu" else {"gpu_memory_utilization": 0.3}))
    rows = []
    engine = LLMEngine(cfg)
    for backend in backends:
        # One engine per model (one KV cache on the card); only the grammar engine changes.
        mc = engine.model_config
        engine.structured_outputs = StructuredOutputs(engine.tokenizer, mc.vocab_size, mc.eos_token_ids, backend)
        base = engine.tokenizer.encode(PROMPT)
        for batch in batches:
            prompts = [base + [100 + i] for i in range(batch)]  # distinct last tokens: no shared decode
            for name, spec in SPECS.items():
                # Greedy: the plain run then takes the engine's fast path (argmax, no sampler), so
                # "with" pays for the whole detour a grammar forces.
                grammar = [SamplingParams(max_tokens=max_tokens, temperature=0, structured=spec) for _ in range(batch)]
                engine.generate(prompts, grammar)  # warm: compile (cached after), kernels, graphs
                lengths = [len(o) for o in engine.generate(prompts, grammar)]
                plain = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths]
                engine.generate(prompts, plain)

                def timed(params):
                    sync(device)
                    t0 = time.perf_counter()
                    engine.generate(prompts, params)
                    sync(device)
                    return time.perf_counter() - t0

                with_s, without_s = [], []
                for _ in range(repeats):  # interleaved: drift on a shared machine hits both alike
                    with_s.append(timed(grammar))
                    without_s.append(timed(plain))
                n = sum(lengths)
                w, wo = statistics.median(with_s) / n * 1e3, statistics.median(without_s) / n * 1e3
                rows.append({"model": model_name, "engine": backend, "spec": name, "batch": batch, "tokens": n,
                             "without_ms_tok": wo, "with_ms_tok": w, "overhead_ms_tok": w - wo})
                print(f"  e2e {model_name} {backend} {name} batch {batch}: {wo:.3f} -> {w:.3f} ms/token "
                      f"({n} tokens)", flush=True)
    engine.shutdown()
    del engine
    gc.collect()  # the next model's engine sizes its KV cache from what is free on the card
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


# ---- tables ------------------------------------------------------------------------------------------

def mask_table(rows: list[dict]) -> str:
    lines = ["| engine | spec | batch | compile ms (cold) | advance+fill ms/row-token (host) | copy+unpack+mask+argmax "
             "ms/step (device) | steps |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['spec']} | {r['batch']} | {r['compile_ms']:.2f} | {r['fill_ms_tok']:.3f} "
                     f"| {r['apply_ms_step']:.3f} | {r['steps']} |")
    return "\n".join(lines)


def e2e_table(rows: list[dict]) -> str:
    return markdown_table(
        ["model", "engine", "spec", "batch", "output tokens", "ms/token without", "ms/token with", "overhead ms/token"],
        [[r["model"], r["engine"], r["spec"], f"{r['batch']}", f"{r['tokens']}", f"{r['without_ms_tok']:.3f}",
          f"{r['with_ms_tok']:.3f}", f"{r['overhead_ms_tok']:+.3f}"] for r in rows],
        right={3, 4, 5, 6, 7})


def default_tokenizer_dir() -> Path:
    from pdserve.worker.models.default_model import ensure_default_model

    return ensure_default_model()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench structured", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="directory with SmolLM2's tokenizer.json (+ its weights: e2e runs the real model)")
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m"], choices=["tiny", "smollm2-135m"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--no-e2e", action="store_true", help="only the mask table")
    ap.add_argument("--out", type=Path, default=None, help="also write the tables (markdown) here")
    args = ap.parse_args(argv)
    if any(b < 1 for b in args.batch):
        ap.error("--batch: values must be at least 1")
    if args.repeats < 1 or args.max_tokens < 1:
        ap.error("--repeats and --max-tokens must be at least 1")
    from importlib import metadata

    from transformers import AutoTokenizer

    tok_dir = args.tokenizer or default_tokenizer_dir()
    if not (tok_dir / "tokenizer.json").is_file():
        ap.error(f"--tokenizer: {tok_dir} has no tokenizer.json")
    backends = installed_backends(args.backends)
    if not backends:
        ap.error("no grammar engine installed (pip install llguidance / xgrammar)")
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    vocab = SMOLLM2["vocab_size"]
    head = [f"# structured outputs: {args.device}"
            + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""),
            f"python {sys.version.split()[0]}, torch {torch.__version__}, "
            + ", ".join(f"{b} {metadata.version(b)}" for b in backends), ""]
    print("\n".join(head), flush=True)
    mask_rows = [bench_mask(tokenizer, vocab, (2,), b, name, spec, batch, args.device)
                 for b in backends for name, spec in SPECS.items() for batch in args.batch]
    print(mask_table(mask_rows), flush=True)
    e2e_rows: list[dict] = []
    if not args.no_e2e:
        real = any(tok_dir.glob("*.safetensors"))
        tmp = Path(tempfile.mkdtemp(prefix="pdserve-bench-structured-"))
        try:
            for which in args.models:
                if which == "smollm2-135m" and real:
                    model_dir, name = tok_dir, "SmolLM2-135M"
                else:
                    model_dir = make_checkpoint(tmp / which, tok_dir, which, args.device)
                    name = "tiny (random)" if which == "tiny" else "SmolLM2-135M shape (random)"
                e2e_rows += bench_e2e(model_dir, name, backends, args.batch, args.device, args.repeats,
                                      args.max_tokens)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        print(e2e_table(e2e_rows), flush=True)
    if args.out:
        args.out.write_text("\n".join(head) + "\n" + mask_table(mask_rows) + "\n\n"
                            + (e2e_table(e2e_rows) + "\n" if e2e_rows else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
