"""Small-batch (M = 1..8) linear layers: cuBLAS after a separate norm / SiLU·mul vs the fused GEMV
(kernels/fused_gemv.py), per Llama-3.1-8B, Qwen2.5-0.5B, gpt-oss and Qwen3-30B-A3B (attention only)
projection shape (gpt-oss's with their biases; CUDA; not a test).

    python -m pdserve.bench.gemv [--models llama-3.1-8b qwen2.5-0.5b gpt-oss qwen3-30b-a3b] [--rows 1 2 4 8] \
        [--out gemv.md]
    python -m pdserve.bench.gemv --step [--models ...] [--table gemv.md] [--out gemv_step.md]

Per shape and M, each variant runs as the engine runs it: inside a CUDA graph (no launch gaps),
`calls` launches per replay on rotating copies of the weight (together >= 128 MB, so L2 never
holds the weight of the next call), timed by triton's do_bench on the replay; µs is per call.
Variants:
- unfused: what the engine runs without the GEMV path: Triton rms_norm (with the residual add)
  then F.linear (cuBLAS) for qkv / gate_up; Triton silu_and_mul then F.linear for down; F.linear
  for o_proj;
- cuBLAS alone: F.linear on the ready activation (the matrix product's own share);
- fused default: fused_gemv with choose_config's pick (what the engine would launch today);
- fused best: the fastest of a small config sweep (BLOCK_N x BLOCK_K x SPLIT_K, the norm's
  two-pass variant, narrow strips with the prologue as its own launch first: "apart", and narrow
  strips over K slices the strip's last program sums: "one-launch").
"% bw" is the fewest bytes the variant's op must move (weight once, activations in, output out)
over its time, as a share of the same run's device-to-device copy bandwidth. "chosen" is the
faster of unfused and fused best; the closing dict is those choices in the form of
kernels/fused_gemv.MEASURED's entry for this card (paste it there to make the engine use them).
Each row is printed (and the file rewritten) as soon as it is measured, M = 1 for every shape
first: a timed-out run keeps the rows it has.

--step: the whole bs=1 decode step instead (bench/profile_decode.py's model: random bf16 weights
in the real configuration, context 128, forward + lm_head + argmax captured as one CUDA graph),
with the GEMV path off and on, against the step's roofline (weights + KV bytes over the same-run
copy bandwidth). `--table gemv.md` (a sweep's output) adds a third column: the path on with that
sweep's MEASURED entries over the shipped ones, so a new table is judged in the step beside the
old one in the same process, before anyone pastes it.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

DT = torch.bfloat16
EPS = 1e-5
DEVICE = "cuda"  # the CPU smoke test (tests/kernels/test_gemv_bench.py) runs it interpreted on "cpu"
L2_DEFEAT_BYTES = 128 << 20


@dataclass(frozen=True)
class Shape:
    model: str
    layer: str
    prologue: str  # fused_gemv prologue: the element-wise stage before this projection
    n: int
    k: int
    bias: bool = False  # the projection adds a bias (cuBLAS's epilogue; the fused kernel's own)


def model_shapes(name: str) -> list[Shape]:
    if name == "gpt-oss":  # 20b and 120b share these; the experts are the MoE op's (bench/moe.py)
        hidden, q, kv, experts = 2880, 64 * 64, 8 * 64, 128
        return [
            Shape(name, "qkv_proj", "rms_norm", q + 2 * kv, hidden, bias=True),
            Shape(name, "o_proj", "none", hidden, q, bias=True),
            Shape(name, "router", "none", experts, hidden, bias=True),
        ]
    if name == "qwen3-30b-a3b":  # its attention; the experts are the MoE op's, the router moe_gate's
        hidden, q, kv = 2048, 32 * 128, 4 * 128
        return [Shape(name, "qkv_proj", "rms_norm", q + 2 * kv, hidden), Shape(name, "o_proj", "none", hidden, q)]
    hidden, heads, kv_heads, head_dim, inter = {
        "llama-3.1-8b": (4096, 32, 8, 128, 14336),
        "qwen2.5-0.5b": (896, 14, 2, 64, 4864),
    }[name]
    q, kv = heads * head_dim, kv_heads * head_dim
    return [
        Shape(name, "qkv_proj", "rms_norm", q + 2 * kv, hidden),
        Shape(name, "o_proj", "none", hidden, q),
        Shape(name, "gate_up_proj", "rms_norm", 2 * inter, hidden),
        Shape(name, "down_proj", "silu_mul", hidden, inter),
    ]


def sweep_configs(quick: bool):
    from dataclasses import replace

    from pdserve.kernels.fused_gemv import GemvConfig

    if quick:
        grid = [(32, 256, 1), (64, 128, 1), (16, 256, 1), (64, 256, 1), (32, 256, 2), (32, 256, 4),
                (64, 256, 4), (16, 512, 1)]
    else:
        grid = [(bn, bk, s) for bn in (16, 32, 64, 128) for bk in (128, 256, 512) for s in (1, 2, 4, 8)]
    # Narrow strips with long K tiles (M = 1 only: tl.dot needs 16 columns): many small programs keep
    # more loads in flight per SM than 16-64-row strips (tools/gpu/pdl_chain.py measured 2 x 1024
    # beating cuBLAS along a whole bs=1 GEMV chain on an H200).
    narrow = [(2, 1024, 1), (4, 1024, 1), (2, 512, 1), (4, 512, 1), (8, 512, 1), (8, 1024, 1)]
    configs = [GemvConfig(block_n=bn, block_k=bk, split_k=s) for bn, bk, s in grid + narrow]
    # The same narrow strips after the prologue's own launch (norm or SiLU·mul shapes only): their
    # programs then skip the per-column prologue work they would each redo for their few rows.
    configs += [GemvConfig(block_n=bn, block_k=bk, split_k=s, separate_prologue=True) for bn, bk, s in narrow]
    # Narrow strips over K slices summed by each strip's last program (one launch, no reduce
    # kernel): a layer with few output rows and a long K (a small model's down_proj) gets more
    # programs, each with fewer K tiles to wait for in turn; fused and with the prologue apart.
    split_narrow = [(bn, bk, s) for bn in (2, 4, 8) for bk in (512, 1024) for s in (2, 4)]
    configs += [GemvConfig(block_n=bn, block_k=bk, split_k=s, reduce_in_kernel=True, separate_prologue=apart)
                for apart in (False, True) for bn, bk, s in split_narrow]
    # Each also with its first weight tile loaded before the PDL wait (overlapping the kernel before;
    # fp8_gemv's EARLY_W took every best tile on an H100).
    configs += [replace(c, early_weights=True) for c in configs]
    # The norm's two-pass variant (read x once more for rstd first; only "rms_norm" shapes try it).
    return configs + [GemvConfig(32, 256, 1, one_pass_norm=False), GemvConfig(32, 256, 4, one_pass_norm=False)]


def graph_ms(fn) -> float:
    """ms per replay of `fn` captured as one CUDA graph (profile_decode's capture)."""
    from triton.testing import do_bench

    from pdserve.bench.profile_decode import capture

    graph = capture(fn)
    return do_bench(graph.replay, warmup=25, rep=200, return_mode="median")


def graph_time_us(make_call, calls: int, rep: int = 30) -> float:
    """µs per call of `calls` launches captured in one CUDA graph (compiled and warmed first)."""
    from triton.testing import do_bench

    fns = [make_call(i) for i in range(calls)]
    for f in fns:  # compile + allocator warm-up outside capture
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    ms = do_bench(g.replay, warmup=5, rep=rep, return_mode="median")
    return ms * 1e3 / calls


class ShapeBench:
    """One shape's tensors: rotating weight copies, activations for M rows."""

    def __init__(self, s: Shape, m: int):
        self.s, self.m = s, m
        wbytes = s.n * s.k * DT.itemsize
        self.copies = max(1, min(64, -(-L2_DEFEAT_BYTES // wbytes)))
        self.calls = max(self.copies, 8)
        self.w = [torch.randn(s.n, s.k, device=DEVICE, dtype=DT) / s.k**0.5 for _ in range(self.copies)]
        xk = 2 * s.k if s.prologue == "silu_mul" else s.k
        self.x = torch.randn(m, xk, device=DEVICE, dtype=DT)
        self.res = torch.randn(m, s.k, device=DEVICE, dtype=DT)
        self.g = torch.ones(s.k, device=DEVICE, dtype=DT)
        self.h = torch.randn(m, s.k, device=DEVICE, dtype=DT)  # the ready activation for cuBLAS alone
        self.b = torch.randn(s.n, device=DEVICE, dtype=DT) if s.bias else None

    def weight(self, i: int) -> torch.Tensor:
        return self.w[i % self.copies]

    def bytes_moved(self, with_prologue: bool) -> int:
        s, m, it = self.s, self.m, DT.itemsize
        act = self.x.numel() * it
        if with_prologue and s.prologue == "rms_norm":
            act += self.res.numel() * it * 2  # residual in, x + residual out
        if not with_prologue:
            act = self.h.numel() * it
        return s.n * s.k * it + act + m * s.n * it + (s.n * it if s.bias else 0)

    def unfused(self, i: int):
        from pdserve.kernels.rms_norm import rms_norm
        from pdserve.kernels.silu_and_mul import silu_and_mul

        w, p = self.weight(i), self.s.prologue
        if p == "rms_norm":
            return lambda: F.linear(rms_norm(self.x, self.g, EPS, self.res)[0], w, self.b)
        if p == "silu_mul":
            return lambda: F.linear(silu_and_mul(self.x), w, self.b)
        return lambda: F.linear(self.x, w, self.b)

    def cublas(self, i: int):
        w = self.weight(i)
        return lambda: F.linear(self.h, w, self.b)

    def fused(self, cfg):
        from pdserve.kernels.fused_gemv import fused_gemv

        p = self.s.prologue
        kw = dict(norm_weight=self.g, eps=EPS, residual=self.res) if p == "rms_norm" else {}

        def make(i: int):
            w = self.weight(i)
            return lambda: fused_gemv(self.x, w, p, config=cfg, bias=self.b, **kw)
        return make


def check_fused(b: ShapeBench) -> float:
    """Relative error of the fused output against the unfused one (a wrong kernel is not a fast one)."""
    from pdserve.kernels.fused_gemv import fused_gemv

    p = b.s.prologue
    kw = dict(norm_weight=b.g, eps=EPS, residual=b.res) if p == "rms_norm" else {}
    got = fused_gemv(b.x, b.w[0], p, bias=b.b, **kw)[0].double()
    want = b.unfused(0)().double()
    return ((got - want).norm() / want.norm()).item()


def bench_shape(s: Shape, m: int, configs, bw: float) -> tuple[str, tuple | None]:
    from pdserve.kernels.fused_gemv import choose_config

    b = ShapeBench(s, m)
    pct = lambda us, full: f"{100 * b.bytes_moved(full) / (us * 1e-6) / bw:.0f}%"  # noqa: E731
    unfused = graph_time_us(b.unfused, b.calls)
    cublas = graph_time_us(b.cublas, b.calls)
    default_cfg = choose_config(s.prologue, m, s.n, s.k, torch.device(DEVICE))
    default = graph_time_us(b.fused(default_cfg), b.calls)
    best, best_cfg = default, default_cfg
    for cfg in configs:
        if cfg == default_cfg or (not cfg.one_pass_norm and s.prologue != "rms_norm"):
            continue
        if cfg.separate_prologue and s.prologue == "none":
            continue
        if m > 1 and cfg.block_n < 16:  # the tensor-core path's minimum tile
            continue
        try:
            us = graph_time_us(b.fused(cfg), b.calls)
        except Exception as e:  # a config the card cannot run (shared memory): skip it, say so
            print(f"  {s.layer} M={m} {cfg}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
            continue
        if us < best:
            best, best_cfg = us, cfg
    err = check_fused(b)
    cfg_s = f"{best_cfg.block_n}/{best_cfg.block_k}/{best_cfg.split_k}" + (
        "" if best_cfg.one_pass_norm else " two-pass") + (" apart" if best_cfg.separate_prologue else "") + (
        " one-launch" if best_cfg.reduce_in_kernel and best_cfg.split_k > 1 else "") + (
        " early-w" if best_cfg.early_weights else "")
    chosen = f"fused {cfg_s}" if best < unfused else "unfused"
    row = (f"| {s.model} | {s.layer} | {s.n}×{s.k} | {m} | {unfused:.1f} ({pct(unfused, True)}) | "
           f"{cublas:.1f} ({pct(cublas, False)}) | {default:.1f} ({pct(default, True)}) | "
           f"{best:.1f} ({pct(best, True)}) | {cfg_s} | {unfused / best:.2f}× | {chosen} | {err:.1e} |")
    key = (s.prologue, s.n, s.k, m)
    return row, (key, best_cfg) if best < unfused else (key, None)


def set_gemv(model, on: bool) -> None:
    """The GEMV path on or off on a built model (the flags models/llama.py sets from the backend)."""
    for layer in model.layers:
        layer.gemv_qkv = layer.gemv_mlp = layer.self_attn.gemv_o = on


def swept_table(path: str) -> dict:
    """The MEASURED entries a sweep's markdown (this bench's --out) closes with."""
    from pdserve.kernels.fused_gemv import GemvConfig

    text = open(path).read()
    start = text.find("```python\n", text.find("MEASURED for kernels/fused_gemv.py"))
    if start < 0:
        raise SystemExit(f"bench/gemv.py: no MEASURED block in {path}")
    code = text[start + len("```python\n"):text.index("```", start + 3)]
    scope: dict = {"MEASURED": {}, "GemvConfig": GemvConfig}
    exec(code, scope)  # our own bench's output: literal tuples and GemvConfig calls
    (entries,) = scope["MEASURED"].values()
    return entries


def use_swept_table(path: str, device: torch.device) -> int:
    """Lay a sweep's entries over this card's shipped MEASURED table, for this process (bench/engine.py
    and bench/moe.py's --gemv-table: a new table judged in the engine before anyone pastes it).
    Returns how many entries it laid."""
    from pdserve.kernels.fused_gemv import MEASURED, card_name

    entries = swept_table(path)
    MEASURED[card_name(device)] = {**MEASURED.get(card_name(device), {}), **entries}
    return len(entries)


def bench_step(models: list[str], bw: float, tiny: bool = False, table: dict | None = None) -> list[str]:
    """bs=1 decode step ms, GEMV path off / on (/ on with `table` over the shipped entries), per
    model (one row each, printed as measured). `tiny`: the models' structure at test sizes (the
    CPU smoke test)."""
    from pdserve.bench.model_shapes import MODELS
    from pdserve.bench.profile_decode import BLOCK, build, decode_inputs, model_config, step_fn
    from pdserve.kernels.fused_gemv import MEASURED, card_name

    card = card_name(torch.device(DEVICE))
    had_card, shipped = card in MEASURED, dict(MEASURED.get(card, {}))
    runs = [("off", False, shipped), ("on", True, shipped)] + ([("swept", True, {**shipped, **table})] if table else [])

    rows = []
    for name in models:
        try:
            spec = MODELS[name]
            cfg = model_config(spec, tiny=tiny)
            model, backend, kv = build(cfg, torch.device(DEVICE), DT)
            ids, positions, meta = decode_inputs(128, torch.device(DEVICE))
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            if model.lm_head is not None:
                weights -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
            roof_ms = 1e3 * (weights + kv.block_bytes // BLOCK * 128) / bw
            ms, logits = {}, {}
            try:
                with torch.inference_mode():
                    for label, on, entries in runs:
                        MEASURED[card] = entries
                        set_gemv(model, on)
                        logits[label] = model.compute_logits(model(ids, positions, meta)).double()
                        ms[label] = graph_ms(step_fn(model, ids, positions, meta))
            finally:
                MEASURED[card] = shipped
                if not had_card:
                    del MEASURED[card]
            diff = max(((logits[label] - logits["off"]).norm() / logits["off"].norm()).item() for label in ms)
            cells = [f"{ms[label]:.3f} ({100 * roof_ms / ms[label]:.0f}%)" for label in ms]
            row = (f"| {spec.name} | " + " | ".join(cells)
                   + f" | {ms['off'] / min(ms.values()):.2f}× | {roof_ms:.3f} | {diff:.1e} |")
            del model, backend, kv
            torch.cuda.empty_cache()
        except Exception as e:  # one model failing must not lose the other
            row = f"| {name} | failed: {type(e).__name__}: {str(e)[:150]} |" + " |" * (len(runs) + 2)
        print(row, flush=True)
        rows.append(row)
    return rows


def copy_bandwidth() -> float:
    from pdserve.bench.kernels import copy_bandwidth as bw

    return bw()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["llama-3.1-8b", "qwen2.5-0.5b"])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--full-sweep", action="store_true",
                    help="the whole BLOCK_N x BLOCK_K x SPLIT_K grid instead of its quick subset (slow: compiles)")
    ap.add_argument("--step", action="store_true", help="time the whole bs=1 decode step, GEMV path off / on")
    ap.add_argument("--table", help="with --step: a sweep's markdown; its MEASURED entries run as a third column")
    ap.add_argument("--out", help="also write the markdown here (rewritten after every shape)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gemv.py: needs a CUDA GPU (none visible)")
    import triton

    bw = copy_bandwidth()
    if args.step:
        table = swept_table(args.table) if args.table else None
        head = [f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · "
                f"{datetime.date.today().isoformat()} · bf16 random weights · bs=1 decode at context 128, one CUDA "
                f"graph per step · same-run copy bandwidth {bw / 1e9:.0f} GB/s", "",
                "| model | GEMV path off: ms (% of roofline) | on: ms (% of roofline) | "
                + ("on, swept table: ms (% of roofline) | " if table else "")
                + "best vs off | roofline ms | logits rel. diff vs off (largest) |",
                "| --- | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if table else "")]
        from pdserve.bench.report import publish

        publish("\n".join(head + bench_step(args.models, bw, table=table)), args.out)
        return
    configs = sweep_configs(not args.full_sweep)
    lines = [
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · "
        f"{datetime.date.today().isoformat()} · bf16 · same-run copy bandwidth {bw / 1e9:.0f} GB/s · "
        f"{len(configs)} configs swept · µs per call inside a CUDA graph, weights rotated past L2",
        "",
        "| model | layer | N×K | M | unfused µs (% bw) | cuBLAS alone µs (% bw) | fused default µs (% bw) | "
        "fused best µs (% bw) | best BLOCK_N/BLOCK_K/SPLIT_K | unfused / best | chosen | fused vs unfused rel. err |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: |",
    ]
    measured: dict = {}
    from pdserve.kernels.fused_gemv import card_name

    card = card_name(torch.device(DEVICE))

    def flush(final: bool = False) -> None:
        # The MEASURED dict goes into the file after every row too: a timed-out run keeps it.
        text = "\n".join(lines)
        if measured:
            table = ",\n".join(f"    ({p!r}, {n}, {k}, {m}): GemvConfig({c.block_n}, {c.block_k}, {c.split_k}"
                               f"{'' if c.one_pass_norm else ', one_pass_norm=False'}"
                               f"{', separate_prologue=True' if c.separate_prologue else ''}"
                               f"{', reduce_in_kernel=True' if c.reduce_in_kernel else ''}"
                               f"{', early_weights=True' if c.early_weights else ''})"
                               for (p, n, k, m), c in measured.items() if c is not None)
            lost = ",\n".join(f"    ({p!r}, {n}, {k}, {m}): None" for (p, n, k, m), c in measured.items() if c is None)
            text += ("\n\nMEASURED for kernels/fused_gemv.py (a config where the fused GEMV won; None where the "
                     "unfused path did):\n\n```python\n"
                     f"MEASURED[{card!r}] = {{\n{table}{',' if table and lost else ''}\n{lost}\n}}\n```")
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        if final:
            print(text)

    # M outermost: a run cut short by its time limit loses the largest batches, not a model.
    for m in args.rows:
        for model in args.models:
            for s in model_shapes(model):
                try:
                    row, (key, cfg) = bench_shape(s, m, configs, bw)
                except Exception as e:  # one shape failing must not lose the others
                    row, key, cfg = f"| {s.model} | {s.layer} | {s.n}×{s.k} | {m} | failed: {type(e).__name__}: " \
                                    f"{str(e)[:150]} |", None, None
                lines.append(row)
                if key is not None:
                    measured[key] = cfg
                print(row, flush=True)
                flush()
                torch.cuda.empty_cache()
    flush(final=True)


if __name__ == "__main__":
    main()
