"""Kernel benchmark (CUDA machines; not a test): each Triton kernel against its torch reference
(and torch SDPA for attention), with the HBM copy bandwidth measured in the same run.

    python -m pdserve.bench.kernels [--out results.md]

Times are medians of triton.testing.do_bench (CUDA events, warm-up excluded). "bytes" is the
fewest bytes the op must move (each input read once, each output written once), so GB/s over
the copy bandwidth says how close a memory-bound kernel is to the card's limit. Decode KV caches
rotate over several layers so a small context cannot be served from L2.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
import triton
from triton.testing import do_bench

from pdserve.bench.report import publish
from pdserve.kernels.reference import (
    kv_cache_write_ref,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    rms_norm_ref,
    paged_decode_attention_rotary_ref,
    rotary_kv_write_ref,
    rotary_ref,
    silu_and_mul_ref,
)
from pdserve.kernels.kv_cache_write import kv_cache_write
from pdserve.kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_rotary
from pdserve.kernels.paged_prefill_attention import paged_prefill_attention
from pdserve.kernels.rms_norm import rms_norm
from pdserve.kernels.rotary import rotary
from pdserve.kernels.rotary_kv_write import rotary_kv_write
from pdserve.kernels.silu_and_mul import silu_and_mul

DT = torch.bfloat16
HQ, HKV, D, BS = 32, 8, 128, 16  # Llama-3.1-8B attention, 16-token blocks


@dataclass(frozen=True)
class Row:
    kernel: str
    shape: str
    impl: str
    us: float
    nbytes: int
    flops: int = 0


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(2**29, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def _time(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3  # us


def _paged(ctx: list[int], layers: int):
    """Engine-layout cache with `layers` layers; per-layer (k, v) views and random block tables."""
    nblk = [-(-c // BS) for c in ctx]
    num_blocks = sum(nblk)
    cache = torch.randn(num_blocks, layers, 2, BS, HKV, D, dtype=DT, device="cuda")
    perm = torch.randperm(num_blocks).tolist()
    rows, used = [], 0
    for n in nblk:
        rows.append(perm[used : used + n] + [perm[used]] * (max(nblk) - n))
        used += n
    bt = torch.tensor(rows, dtype=torch.int32, device="cuda")
    return [(cache[:, i, 0], cache[:, i, 1]) for i in range(layers)], bt


def bench_decode(batch: int, ctx_len: int) -> list[Row]:
    ctx = [ctx_len] * batch
    # Enough layers that the rotated caches exceed a 60 MB L2 several times over.
    kv_bytes = 2 * batch * ctx_len * HKV * D * DT.itemsize
    layers = max(2, min(64, math.ceil(240e6 / kv_bytes)))
    kvs, bt = _paged(ctx, layers)
    lens = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, dtype=DT, device="cuda")
    cyc = itertools.cycle(kvs)
    nbytes = kv_bytes + 2 * q.numel() * DT.itemsize
    shape = f"B={batch} ctx={ctx_len}"
    rows = [
        Row(
            "decode attn",
            shape,
            "triton",
            _time(lambda: paged_decode_attention(q, *next(cyc), bt, lens, D**-0.5)),
            nbytes,
        )
    ]
    sem = torch.zeros(batch * HKV, dtype=torch.int32, device="cuda")
    rows.append(Row("decode attn", shape, "triton, merge fused", _time(
        lambda: paged_decode_attention(q, *next(cyc), bt, lens, D**-0.5, semaphores=sem)), nbytes))
    # The whole decode attention of a layer from the projection's output: rotary, KV write, merge.
    k_new, v_new = torch.randn(2, batch, HKV, D, dtype=DT, device="cuda")
    pos = lens.long() - 1
    slots = torch.stack([bt[i, p // BS].long() * BS + p % BS for i, p in enumerate(pos.tolist())])
    cs = torch.randn(ctx_len, D, device="cuda")
    rows.append(Row("decode attn", shape, "triton, + rotary + KV write, merge fused", _time(
        lambda: paged_decode_attention_rotary(q, k_new, v_new, *next(cyc), bt, lens, pos, slots, cs, D**-0.5,
                                              semaphores=sem)), nbytes))
    # Qwen3's q/k RMSNorm: inside the same launch, against its two separate norm launches before it.
    qk_norm = (torch.rand(D, device="cuda").to(DT) + 0.5, torch.rand(D, device="cuda").to(DT) + 0.5, 1e-6)
    rows.append(Row("decode attn", shape, "triton, + q/k norm + rotary + KV write, merge fused", _time(
        lambda: paged_decode_attention_rotary(q, k_new, v_new, *next(cyc), bt, lens, pos, slots, cs, D**-0.5,
                                              semaphores=sem, qk_norm=qk_norm)), nbytes))

    def separate_norms():
        qn = rms_norm(q.view(-1, D), qk_norm[0], qk_norm[2])[0].view(q.shape)
        kn = rms_norm(k_new.view(-1, D), qk_norm[1], qk_norm[2])[0].view(k_new.shape)
        return paged_decode_attention_rotary(qn, kn, v_new, *next(cyc), bt, lens, pos, slots, cs, D**-0.5,
                                             semaphores=sem)
    rows.append(Row("decode attn", shape, "triton, 2 rms_norm launches, then + rotary + KV write, merge fused",
                    _time(separate_norms), nbytes))
    rows.append(Row("decode attn", shape, "torch ref, + rotary + KV write", _time(
        lambda: paged_decode_attention_rotary_ref(q, k_new, v_new, *next(cyc), bt, lens, pos, slots, cs, D**-0.5)),
        nbytes))
    rows.append(
        Row(
            "decode attn",
            shape,
            "torch ref",
            _time(lambda: paged_decode_attention_ref(q, *next(cyc), bt, lens, D**-0.5)),
            nbytes,
        )
    )
    # SDPA over the same K/V already gathered into contiguous [B, Hkv, L, D] (no paging at all).
    dense = [
        (
            k[bt.long()].flatten(1, 2).transpose(1, 2).contiguous(),
            v[bt.long()].flatten(1, 2).transpose(1, 2).contiguous(),
        )
        for k, v in kvs[:layers]
    ]
    dcyc = itertools.cycle(dense)
    q4 = q[:, :, None, :]

    def sdpa():
        k, v = next(dcyc)
        return F.scaled_dot_product_attention(q4, k, v, scale=D**-0.5, enable_gqa=True)

    rows.append(Row("decode attn", shape, "torch SDPA (contiguous KV)", _time(sdpa), nbytes))
    return rows


def bench_prefill(batch: int, n: int) -> list[Row]:
    kvs, bt = _paged([n] * batch, 1)
    k, v = kvs[0]
    lens = torch.tensor([n] * batch, dtype=torch.int32, device="cuda")
    cu = torch.arange(0, (batch + 1) * n, n, dtype=torch.int32, device="cuda")
    q = torch.randn(batch * n, HQ, D, dtype=DT, device="cuda")
    flops = batch * 4 * HQ * D * n * (n + 1) // 2  # causal QK^T and PV
    nbytes = 2 * q.numel() * DT.itemsize + 2 * batch * n * HKV * D * DT.itemsize
    shape = f"B={batch} n={n} causal"
    rows = [
        Row(
            "prefill attn",
            shape,
            "triton",
            _time(lambda: paged_prefill_attention(q, k, v, bt, cu, lens, D**-0.5)),
            nbytes,
            flops,
        )
    ]
    rows.append(
        Row(
            "prefill attn",
            shape,
            "torch ref",
            _time(lambda: paged_prefill_attention_ref(q, k, v, bt, cu, lens, D**-0.5)),
            nbytes,
            flops,
        )
    )
    q4 = q.view(batch, n, HQ, D).transpose(1, 2)
    kd = k[bt.long()].flatten(1, 2).transpose(1, 2).contiguous()
    vd = v[bt.long()].flatten(1, 2).transpose(1, 2).contiguous()
    sdpa = lambda: F.scaled_dot_product_attention(q4, kd, vd, is_causal=True, scale=D**-0.5, enable_gqa=True)  # noqa: E731
    rows.append(Row("prefill attn", shape, "torch SDPA (contiguous KV)", _time(sdpa), nbytes, flops))
    # Each SDPA backend by name (the row above takes whichever torch picks), K/V expanded to the
    # query heads since not every backend takes enable_gqa: which one a dense prefill path could use.
    ke, ve = (x.repeat_interleave(HQ // HKV, dim=1) for x in (kd, vd))
    for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue

        def run(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q4, ke, ve, is_causal=True, scale=D**-0.5)

        try:
            ms = _time(run)
        except RuntimeError as e:  # not built for this card or these shapes: say so, go on
            print(f"prefill attn {shape}: SDPA {name} unavailable ({str(e).splitlines()[0][:120]})")
            continue
        label = f"torch SDPA {name.split('_')[0].lower()}, K/V per query head (contiguous)"
        rows.append(Row("prefill attn", shape, label, ms, nbytes, flops))
    return rows


def bench_elementwise(t: int) -> list[Row]:
    rows = []
    kvs, _ = _paged([t], 4)
    key, value = torch.randn(2, t, HKV, D, dtype=DT, device="cuda")
    slots = torch.randperm(t, device="cuda")
    nb = 4 * key.numel() * DT.itemsize
    for impl, f in (("triton", kv_cache_write), ("torch ref", kv_cache_write_ref)):
        rows.append(Row("kv write", f"T={t} Hkv={HKV} D={D}", impl, _time(lambda: f(key, value, *kvs[1], slots)), nb))

    for hidden, rows_t in ((4096, t), (896, 4 * t)):  # Llama-3.1-8B; Qwen2.5-0.5B at its prefill chunk
        x, res = torch.randn(2, rows_t, hidden, dtype=DT, device="cuda")
        w = torch.randn(hidden, dtype=DT, device="cuda")
        nb = 4 * x.numel() * DT.itemsize + w.numel() * DT.itemsize
        for impl, f in (("triton", rms_norm), ("torch ref", rms_norm_ref)):
            rows.append(Row("rmsnorm+residual", f"T={rows_t} H={hidden}", impl,
                            _time(lambda: f(x, w, 1e-5, res)), nb))

    pos = torch.randint(0, 8192, (t,), device="cuda")
    cs = torch.randn(8192, D, device="cuda")
    q, k = torch.randn(t, HQ, D, dtype=DT, device="cuda"), torch.randn(t, HKV, D, dtype=DT, device="cuda")
    nb = 2 * (q.numel() + k.numel()) * DT.itemsize + t * D * 4
    for impl, f in (("triton", rotary), ("torch ref", rotary_ref)):
        rows.append(Row("rotary", f"T={t} Hq={HQ} Hkv={HKV}", impl, _time(lambda: f(pos, q, k, cs)), nb))
    v = torch.randn(t, HKV, D, dtype=DT, device="cuda")
    nb = (2 * q.numel() + 4 * k.numel()) * DT.itemsize + t * D * 4  # q in/out, k and v in and into the cache
    for impl, f in (("triton", rotary_kv_write), ("torch ref", rotary_kv_write_ref)):
        rows.append(Row("rotary + kv write", f"T={t} Hq={HQ} Hkv={HKV}", impl,
                        _time(lambda: f(pos, q, k, v, cs, *kvs[1], slots)), nb))
    qk_norm = (torch.rand(D, device="cuda").to(DT) + 0.5, torch.rand(D, device="cuda").to(DT) + 0.5, 1e-6)
    rows.append(Row("rotary + kv write", f"T={t} Hq={HQ} Hkv={HKV}", "triton, + q/k norm", _time(
        lambda: rotary_kv_write(pos, q, k, v, cs, *kvs[1], slots, qk_norm=qk_norm)), nb))

    for inter, rows_t in ((14336, t), (4864, 4 * t)):
        g = torch.randn(rows_t, 2 * inter, dtype=DT, device="cuda")
        nb = g.numel() * DT.itemsize * 3 // 2
        for impl, f in (("triton", silu_and_mul), ("torch ref", silu_and_mul_ref)):
            rows.append(Row("silu_and_mul", f"T={rows_t} I={inter}", impl, _time(lambda: f(g)), nb))
    return rows


def table(rows: list[Row], bw: float) -> str:
    lines = [
        "| kernel | shape | impl | median µs | GB/s (min bytes) | % of copy BW | TFLOP/s |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        gbs = r.nbytes / (r.us * 1e-6) / 1e9
        tf = f"{r.flops / (r.us * 1e-6) / 1e12:.0f}" if r.flops else ""
        lines.append(
            f"| {r.kernel} | {r.shape} | {r.impl} | {r.us:.1f} | {gbs:.0f} | {100 * gbs * 1e9 / bw:.0f}% | {tf} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the table (markdown) to this file")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernels.py: needs a CUDA GPU (none visible)")
    bw = copy_bandwidth()
    rows: list[Row] = []
    for batch, ctx in ((1, 1024), (1, 8192), (32, 2048), (128, 1024)):
        rows += bench_decode(batch, ctx)
    for batch, n in ((1, 4096), (4, 1024)):
        rows += bench_prefill(batch, n)
    rows += bench_elementwise(4096)
    header = (
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · "
        f"{datetime.date.today().isoformat()} · dtype bf16 · measured copy bandwidth {bw / 1e9:.0f} GB/s"
    )
    text = header + "\n\n" + table(rows, bw)
    publish(text, args.out)


if __name__ == "__main__":
    main()
