"""Prefill attention: the Triton paged kernel against torch's FlashAttention over the gathered
contexts (worker/attention/flash_prefill.py, gather included), Llama-3.1-8B's heads (32 q, 8 kv,
d 128), bf16, one layer's call. Rows: batches of fresh prompts, and chunks after cached prefixes.

    python tools/gpu/flash_prefill.py [--out flash_prefill.md]     (tools/gpu/flash_prefill.sh)
"""

from __future__ import annotations

import argparse
import datetime
import inspect

import torch
from triton.testing import do_bench

from pdserve.kernels.paged_prefill_attention import paged_prefill_attention
from pdserve.worker.attention.flash_prefill import flash_inputs, flash_prefill_attention

HQ, HKV, D, BS = 32, 8, 128, 16
# (label, [(context after the step, chunk)] per row)
CASES = [
    ("16 fresh prompts of 1024", [(1024, 1024)] * 16),
    ("4 fresh prompts of 4096", [(4096, 4096)] * 4),
    ("1 fresh prompt of 16384", [(16384, 16384)]),
    ("a 16384 chunk after 16384 cached", [(32768, 16384)]),
    ("a 2048 chunk after 30720 cached", [(32768, 2048)]),
]


def case(rows, device):
    n_blocks = sum(-(-ctx // BS) for ctx, _ in rows)
    cache = torch.randn(n_blocks, 2, BS, HKV, D, dtype=torch.bfloat16, device=device)
    k_cache, v_cache = cache[:, 0], cache[:, 1]
    width = max(-(-ctx // BS) for ctx, _ in rows)
    tables, used, cu = [], 0, [0]
    for ctx, chunk in rows:
        n = -(-ctx // BS)
        tables.append(list(range(used, used + n)) + [0] * (width - n))
        used += n
        cu.append(cu[-1] + chunk)
    ctx = [c for c, _ in rows]
    q = torch.randn(cu[-1], HQ, D, dtype=torch.bfloat16, device=device)
    dev = lambda x, dt: torch.as_tensor(x, dtype=dt, device=device)  # noqa: E731
    return q, k_cache, v_cache, dev(tables, torch.int32), dev(cu, torch.int32), dev(ctx, torch.int32), \
        flash_inputs(tables, ctx, cu, BS, dev)


def time_case(label: str, rows, device, scale: float) -> str:
    q, kc, vc, bt, cu, lens, flash = case(rows, device)
    flops = sum(4 * HQ * D * (chunk * (ctx - chunk) + chunk * (chunk + 1) / 2) for ctx, chunk in rows)
    triton = lambda: paged_prefill_attention(q, kc, vc, bt, cu, lens, scale)  # noqa: E731
    t_tri = do_bench(triton, warmup=10, rep=100) * 1e3
    row = f"| {label} | {flops / 1e12:.2f} | {t_tri:.0f} | {flops / t_tri / 1e6:.0f} |"
    try:
        fa = lambda: flash_prefill_attention(q, kc, vc, cu, flash, scale)  # noqa: E731
        diff = (fa().float() - triton().float()).abs().max().item()
        t_fa = do_bench(fa, warmup=10, rep=100) * 1e3
        return row + f" {t_fa:.0f} | {flops / t_fa / 1e6:.0f} | {t_tri / t_fa:.2f}x | {diff:.3f} |"
    except Exception as e:  # a torch or card without it: the row says so
        return row + f" FAILED: {type(e).__name__}: {str(e)[:200]} | | | |"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    scale = D ** -0.5
    lines = [f"{torch.cuda.get_device_name(device)} · torch {torch.__version__} · {datetime.date.today()} · "
             f"bf16, {HQ} q / {HKV} KV heads, d {D}, block {BS} · µs per call (do_bench medians)", "",
             "| rows | causal TFLOP | Triton paged µs | TFLOP/s | flash, gather included, µs | TFLOP/s | "
             "vs Triton | max abs diff |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    try:  # which of its arguments this torch has (the paged `block_table` among them, or not)
        from torch.nn.attention.varlen import varlen_attn
        lines[1:1] = ["", f"`varlen_attn{inspect.signature(varlen_attn)}`"]
    except ImportError:
        lines.append("torch has no torch.nn.attention.varlen.varlen_attn here")
    for label, rows in CASES:
        lines.append(time_case(label, rows, device, scale))
        print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
