"""Per-kernel profile of one batch-1 decode step: this version's fused kernels against v4's.

    python -m pdserve.bench.profile_decode [--models qwen2.5-0.5b llama-3.1-8b] [--context 128] [--out FILE]
    python -m pdserve.bench.profile_decode --count     # CPU: kernel launches per layer, no GPU

GPU: for each model (random bf16 weights in the real configuration, built in memory: no
checkpoint, no engine, no server) it builds the Llama-family model over the Triton backend and
a KV cache holding one sequence of `--context` tokens, and captures one decode step (forward,
lm_head, argmax) as a CUDA graph twice: "fused" (qkv bias, rotary, KV write, attention and its
split merge in one launch) and "v4" (rotary, KV write, split attention and the merge as four
launches, the bias added by torch). Both graphs are timed in the same run,
beside the copy bandwidth of that run, and profiled with torch.profiler: one table per model
and path of every kernel's calls and GPU time per step, and the launches per layer.

--count runs the same models' structure at tiny sizes under TRITON_INTERPRET=1 on CPU and counts
launches per layer: Triton kernels (through each kernel's launch path) and matrix products
(aten::mm/addmm in the CPU profile). It needs no GPU and checks the structure, not the speed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import types
from collections import defaultdict

import torch

from pdserve.bench.report import publish

BLOCK = 16
MAX_MODEL_LEN = 2048  # the engine bench's: sets the decode block-table width (and the split count)


def model_config(spec, tiny: bool):
    from pdserve.worker.config.model import ModelConfig

    fields = dict(spec.hf)
    if tiny:  # the structure (bias, tied head, GQA, rope) at sizes the interpreter runs in seconds
        fields.update(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[spec.arch]
    return ModelConfig.from_hf(types.SimpleNamespace(architectures=[arch], **fields))


def build(cfg, device: torch.device, dtype: torch.dtype):
    """Model with random weights over a Triton backend and a KV cache of one max-length sequence."""
    from pdserve.worker.attention.kv_cache import KVCache
    from pdserve.worker.attention.triton_backend import TritonAttentionBackend
    from pdserve.worker.models.llama import LlamaForCausalLM

    backend = TritonAttentionBackend()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend, MAX_MODEL_LEN)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.init_rope(MAX_MODEL_LEN)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    model.eval()
    kv = KVCache(cfg, MAX_MODEL_LEN // BLOCK, BLOCK, dtype, device)
    backend.bind(kv)
    return model, backend, kv


def decode_inputs(context: int, device: torch.device):
    """A decode step of one sequence whose `context`-th token is new, as DecodeGraphs lays it out."""
    from pdserve.worker.attention.backend import AttentionMetadata

    width = MAX_MODEL_LEN // BLOCK
    table = torch.arange(width, dtype=torch.int32, device=device)[None, :]
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([context - 1], dtype=torch.int64, device=device), num_decode_tokens=1,
        decode_block_tables=table, decode_context_lens=torch.tensor([context], **i32),
        prefill_block_tables=table[:0], prefill_cu_seqlens_q=torch.zeros(1, **i32),
        prefill_context_lens=torch.zeros(0, **i32))
    ids = torch.tensor([7], dtype=torch.int64, device=device)
    positions = torch.tensor([context - 1], dtype=torch.int64, device=device)
    return ids, positions, meta


def set_path(model, backend, fused: bool) -> None:
    """fused: this version's decode layer; not fused: v4's launches (same weights, same cache)."""
    for layer in model.layers:
        attn = layer.self_attn
        attn.fused_epilogue = fused
        attn.norm_in_epilogue = fused and model.cfg.qk_norm
        attn.bias_in_epilogue = fused and model.cfg.qkv_bias
    backend.fuse_decode_merge = backend.fuse_decode_rotary = fused


def step_fn(model, ids, positions, meta):
    def step():
        h = model(ids, positions, meta)
        return model.compute_logits(h).argmax(-1)
    return step


# -- CPU: launch counts -------------------------------------------------------------------------

def count_launches(spec) -> list[tuple[str, float, float]]:
    """[(path, Triton launches per layer, matrix products per layer)] at tiny sizes on CPU."""
    import importlib

    from triton.runtime.jit import KernelInterface

    cfg = model_config(spec, tiny=True)
    model, backend, _ = build(cfg, torch.device("cpu"), torch.float32)
    ids, positions, meta = decode_inputs(40, torch.device("cpu"))
    launches: dict[str, int] = defaultdict(int)
    restore = []
    for mod_name in ("kv_cache_write", "paged_decode_attention", "paged_prefill_attention", "rms_norm", "rotary",
                     "rotary_kv_write", "silu_and_mul"):
        for name, k in vars(importlib.import_module(f"pdserve.kernels.{mod_name}")).items():
            if isinstance(k, KernelInterface) and "run" not in vars(k):
                def run(*a, _k=k, _name=name, _run=k.run, **kw):
                    launches[_name] += 1
                    return _run(*a, **kw)
                k.run = run
                restore.append(k)
    rows = []
    try:
        for fused in (False, True):
            set_path(model, backend, fused)
            launches.clear()
            with (
                torch.inference_mode(),
                torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
            ):
                step_fn(model, ids, positions, meta)()
            mm = sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm"))
            # Outside the layers: the final norm (Triton) and lm_head (one matrix product).
            triton_layer = (sum(launches.values()) - 1) / cfg.num_layers
            rows.append(("fused" if fused else "v4", triton_layer, (mm - 1) / cfg.num_layers, dict(launches)))
    finally:
        for k in restore:
            del k.run
    return rows


# -- GPU: timing and per-kernel table ----------------------------------------------------------

def capture(fn) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compiles the Triton variants, allocates the decode counters: never inside capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def kernel_table(graph, replays: int, num_layers: int) -> tuple[list[tuple[str, float, float]], float, float]:
    """[(kernel, calls per step, µs per step)], total µs per step, launches per layer."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        us = us if us is not None else getattr(e, "self_cuda_time_total", 0.0)
        if us > 0 and e.count:
            rows.append((e.key, e.count / replays, us / replays))
    rows.sort(key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    # A kernel called k*L (+ a few) times per step runs k times per layer; the embedding lookup,
    # final norm, lm_head and argmax add at most one call each to a name.
    per_layer = sum(int(calls // num_layers) for _, calls, _ in rows)
    return rows, total, per_layer


def short(name: str, width: int = 72) -> str:
    name = name.replace("void ", "")
    return name if len(name) <= width else name[: width - 1] + "…"


def profile_model(spec, context: int, bw: float) -> tuple[list[str], list[str]]:
    """-> (one summary row per path, the per-kernel tables)."""
    from triton.testing import do_bench

    cfg = model_config(spec, tiny=False)
    device = torch.device("cuda")
    model, backend, kv = build(cfg, device, torch.bfloat16)
    ids, positions, meta = decode_inputs(context, device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:  # untied: a decode step reads one embedding row, not the table
        weights -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    kv_bytes = kv.block_bytes // BLOCK * context
    roof_ms = 1e3 * (weights + kv_bytes) / bw
    summary, lines = [], []
    with torch.inference_mode():
        for fused in (False, True):
            set_path(model, backend, fused)
            graph = capture(step_fn(model, ids, positions, meta))
            ms = do_bench(graph.replay, warmup=25, rep=300, return_mode="median")
            rows, total_us, per_layer = kernel_table(graph, 20, cfg.num_layers)
            path = "fused" if fused else "v4 (unfused)"
            launches = sum(r[1] for r in rows)
            summary.append(f"| {spec.name} | {path} | {ms:.3f} | {100 * roof_ms / ms:.0f}% | {launches:.0f} | "
                           f"{per_layer} | {total_us / 1e3:.3f} |")
            lines += [
                f"### {spec.name}, bs=1 decode at context {context}, {path}: graph replay {ms:.3f} ms "
                f"(roofline {roof_ms:.3f} ms = {100 * roof_ms / ms:.0f}%), {launches:.0f} kernels per step, "
                f"{per_layer} per layer",
                "",
                "| kernel | calls/step | µs/step | % of GPU time | µs/call |",
                "| --- | ---: | ---: | ---: | ---: |",
            ]
            lines += [f"| `{short(k)}` | {c:.0f} | {us:.1f} | {100 * us / total_us:.1f}% | {us / c:.2f} |"
                      for k, c, us in rows]
            lines.append("")
            del graph
    print("\n".join(summary), flush=True)
    del model, backend, kv
    torch.cuda.empty_cache()
    return summary, lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench profile-decode", description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "llama-3.1-8b"])
    ap.add_argument("--context", type=int, default=128, help="tokens in the sequence's KV cache (default 128)")
    ap.add_argument("--out", help="also write the markdown tables to this file")
    ap.add_argument("--count", action="store_true", help="CPU only: launches per layer under the Triton interpreter")
    args = ap.parse_args(argv)
    if args.count:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            print("profile-decode --count: triton was imported before TRITON_INTERPRET=1 could be set", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"
    from pdserve.bench.model_shapes import MODELS

    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        print(f"profile-decode: --models: unknown {unknown}; choose from {sorted(MODELS)}", file=sys.stderr)
        return 2
    if not 1 <= args.context <= MAX_MODEL_LEN:
        print(f"profile-decode: --context must be in [1, {MAX_MODEL_LEN}]", file=sys.stderr)
        return 2
    if args.count:
        lines = [
            "| model | path | Triton launches / layer | matrix products / layer | Triton launches per step, by kernel |",  # noqa: E501
            "| --- | --- | ---: | ---: | --- |",
        ]
        for key in args.models:
            for path, t, mm, by in count_launches(MODELS[key]):
                lines.append(f"| {MODELS[key].name} | {path} | {t:g} | {mm:g} | "
                             f"{', '.join(f'{k} {v}' for k, v in sorted(by.items()))} |")
        text = ("Launch counts at tiny sizes on CPU (TRITON_INTERPRET=1). On CUDA a biased matrix product at "
                "one token is one more kernel (torch copies the bias into the output, then GEMMs into it).\n\n"
                + "\n".join(lines))
    else:
        if not torch.cuda.is_available():
            print("profile-decode: needs a CUDA GPU; --count runs the launch count on CPU", file=sys.stderr)
            return 2
        import triton

        from pdserve.bench.kernels import copy_bandwidth

        bw = copy_bandwidth()
        header = (f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · "
                  f"{datetime.date.today()} · bf16 · copy bandwidth {bw / 1e9:.0f} GB/s (same run)")
        print(header, flush=True)
        summary, tables = [], []
        for key in args.models:
            rows, detail = profile_model(MODELS[key], args.context, bw)
            summary += rows
            tables += detail
        text = "\n".join([header, "", "| model | path | ms/step (graph) | of roofline | kernels/step | per layer | "
                          "GPU ms (kernel sum) |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |", *summary, "",
                          *tables])
    publish(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
