"""Block-128 FP8 GEMMs through torch's scaled_mm: cuBLASLt's DeepSeek-style block scaling.

out = (A * As) @ (B * Bs)^T with A e4m3 activations [M, K] scaled per token and 128-column group
(1x128) and B an e4m3 weight [N, K] scaled per 128x128 block, as DeepSeek-V3 / Qwen3-FP8
checkpoints store `weight_scale_inv`. cuBLASLt (>= 12.9) runs this on sm90 only; torch reaches it
through `torch.nn.functional.scaled_mm` with ScalingType BlockWise1x128 / BlockWise128x128
(torch >= 2.10; the enum members were spelled Blockwise_1x128 / Blockwise_128x128 at first) and,
since torch 2.9, through `torch._scaled_mm` when the scale shapes say so. Before torch 2.10 a
K whose 128-column group count is not a multiple of 4 gave silently wrong answers (pytorch
#166752), so such shapes stay on the Triton GEMM here whatever the version.

Layouts cuBLASLt reads (torch checks them; the fix above made them exact):
- As: [M, ceil(K/128)] fp32, strides (1, M): each group's M scales contiguous ("outer-dim
  major"): `fp8_quant.quantize_fp8(x, 128, mn_major_scales=True)` writes it;
- Bs, for B passed as weight.t() [K, N]: [ceil(K/128), ceil(N/128)] fp32, strides (1, L4) with L4
  = ceil(K/128) rounded up to 4: the checkpoint's [N/128, K/128] row-major grid, transposed. With
  K/128 a multiple of 4 that is the published tensor itself, no copy.

Nothing here is verified on the CPU (torch's CPU scaled_mm has no block scaling): the engine
probes the real call once per device and dtype against the dequantized product
(`probe_blockwise`) and keeps the Triton block GEMM (fp8_block_gemm.py) when it fails.
Reference: `scaled_mm_blockwise_ref` (reads the scales through the strides cuBLASLt uses).
"""

from __future__ import annotations

import torch

BLOCK = 128


def blockwise_recipes() -> tuple[object, object] | None:
    """(the 1x128 ScalingType, the 128x128 one) of this torch's scaled_mm, None without it. The
    enum lives beside scaled_mm: torch.nn.functional, or the module defining it in early versions."""
    import sys

    fn = getattr(torch.nn.functional, "scaled_mm", None)
    if fn is None:
        return None
    st = getattr(torch.nn.functional, "ScalingType", None) or getattr(
        sys.modules.get(getattr(fn, "__module__", "") or ""), "ScalingType", None)
    if st is None:
        return None
    for a, b in (("BlockWise1x128", "BlockWise128x128"), ("Blockwise_1x128", "Blockwise_128x128")):
        if hasattr(st, a) and hasattr(st, b):
            return getattr(st, a), getattr(st, b)
    return None


def weight_ineligible(n: int, k: int, scale_rows: int) -> str | None:
    """Why a layer's block-scaled weight [N, K] cannot take scaled_mm (None: it can)."""
    if scale_rows != BLOCK:
        return "per-row scales (fused parts off the 128-row grid)"
    if k % BLOCK or n % BLOCK:
        return f"N={n} and K={k} must be multiples of {BLOCK}"
    if (k // BLOCK) % 4:
        return f"K/128={k // BLOCK} is not a multiple of 4 (cuBLASLt's padded scale layout)"
    return None


def weight_scale_operand(w_scale: torch.Tensor) -> torch.Tensor:
    """The weight's block scales [N/128, K/128] (row-major, as loaded) -> scaled_mm's scale_b for
    mat_b = weight.t(): [K/128, N/128] with strides (1, K/128). A view, no copy."""
    nb, kb = w_scale.shape
    if w_scale.dtype != torch.float32 or kb % 4 or w_scale.stride() != (kb, 1):
        raise ValueError(f"block scales must be fp32 [N/128, K/128] row-major with K/128 a multiple of 4, "
                         f"got {w_scale.dtype} {list(w_scale.shape)} strides {w_scale.stride()}")
    return w_scale.t()


def check_activation_scales(xs: torch.Tensor, m: int, k: int) -> None:
    """scaled_mm's 1x128 scale_a: [M, ceil(K/128)] fp32 with strides (1, M)."""
    kb = -(-k // BLOCK)
    ok = (xs.dtype == torch.float32 and tuple(xs.shape) == (m, kb)
          and (xs.stride(0) == 1 or m == 1) and (xs.stride(1) == m or kb == 1))
    if not ok:
        raise ValueError(f"activation scales must be fp32 [{m}, {kb}] with strides (1, {m}) "
                         f"(quantize_fp8(..., mn_major_scales=True)), got {xs.dtype} {list(xs.shape)} "
                         f"strides {xs.stride()}")


def scaled_mm_blockwise(xq: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor, scale_b: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """xq [M, K] e4m3 (scales xs, check_activation_scales) @ w8 [N, K] e4m3 (scale_b from
    weight_scale_operand)^T -> [M, N] out_dtype, on cuBLASLt. No host sync: graph-capturable."""
    recipes = blockwise_recipes()
    if recipes is not None:
        return torch.nn.functional.scaled_mm(xq, w8.t(), xs, recipes[0], scale_b, recipes[1],
                                             output_dtype=out_dtype)
    # torch 2.9: the same kernel, the recipe read from the scale shapes.
    return torch._scaled_mm(xq, w8.t(), scale_a=xs, scale_b=scale_b, out_dtype=out_dtype)


# Rows of the quantized activations and their scales are padded to this multiple: the scales'
# column stride is M, and cuBLASLt reads scale columns with 16-byte alignment (DeepGEMM and
# vLLM's CUTLASS path pad them the same way). torch's own tests only use M = 256. The probe
# raises it to 16 if 4 is refused or wrong on the card.
PAD_M = 4


def block_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """What an FP8 block layer runs from SCALED_MM_BLOCK_MIN_M rows: x [M, K] (unquantized)
    quantized per token and 128 columns into token-major scales (M padded to PAD_M with zero
    rows), times w8 [N, K] with its [N/128, K/128] block scales on cuBLASLt -> [M, N]."""
    from pdserve.kernels.fp8_quant import quantize_fp8

    xq, xs = quantize_fp8(x, BLOCK, mn_major_scales=True, pad_rows_to=PAD_M)
    return block_linear_quantized(xq, xs, x.shape[0], w8, w_scale, out_dtype)


def block_linear_quantized(xq: torch.Tensor, xs: torch.Tensor, m: int, w8: torch.Tensor, w_scale: torch.Tensor,
                           out_dtype: torch.dtype) -> torch.Tensor:
    """block_linear after its quantization: xq [M', K] e4m3 with token-major 1x128 scales xs,
    M' = the m real rows padded to PAD_M (quantize_fp8's, or a norm's that quantized for this
    GEMM: kernels/rms_norm_fp8.py) -> [m, N]."""
    out = scaled_mm_blockwise(xq, xs, w8, w_scale.t(), out_dtype)
    return out if out.shape[0] == m else out[:m]


def scaled_mm_blockwise_ref(xq: torch.Tensor, xs: torch.Tensor, w8: torch.Tensor, scale_b: torch.Tensor,
                            out_dtype: torch.dtype) -> torch.Tensor:
    """What scaled_mm_blockwise computes, in fp32 on any device: xs[m, g] scales A's row m,
    columns 128g..; scale_b[g, j] scales the weight's rows 128j.. and columns 128g... The scales
    are read from their memory the way cuBLASLt reads it (strides (1, M) and (1, L4), whatever
    the tensors' own strides say), so a tensor in another layout gives another answer here too."""
    (m, k), n = xq.shape, w8.shape[0]
    kb, nb = -(-k // BLOCK), -(-n // BLOCK)
    l4 = -(-kb // 4) * 4
    xs = torch.as_strided(xs, (m, kb), (1, m), xs.storage_offset())
    scale_b = torch.as_strided(scale_b, (kb, nb), (1, l4), scale_b.storage_offset())
    a = xq.float() * xs.float().repeat_interleave(BLOCK, dim=1)[:, :k]
    ws = scale_b.float().t().repeat_interleave(BLOCK, dim=0)[:n].repeat_interleave(BLOCK, dim=1)[:, :k]
    return (a @ (w8.float() * ws).t()).to(out_dtype)


_probed: dict[tuple[str, torch.dtype], tuple[bool, str]] = {}


def probe_blockwise(device: torch.device, out_dtype: torch.dtype) -> tuple[bool, str]:
    """Whether block_linear runs and is right on this device and output dtype: two small
    products (M = 150 and 256, K=512, N=256, scales varying per token, group and block) against
    the dequantized reference, once per process. (ok, why not / the error measured). Call at load,
    never during CUDA-graph capture (it synchronises)."""
    key = (str(device), out_dtype)
    if key in _probed:
        return _probed[key]
    if device.type != "cuda":
        result = (False, "not a CUDA device")
    elif torch.cuda.get_device_capability(device)[0] != 9:
        result = (False, f"cuBLASLt block scaling needs sm90, this is sm"
                         f"{''.join(map(str, torch.cuda.get_device_capability(device)))}")
    else:
        result = _run_probe(device, out_dtype)
    _probed[key] = result
    return result


def _run_probe(device: torch.device, out_dtype: torch.dtype) -> tuple[bool, str]:
    """Rows padded to 4, else to 16 (if cuBLASLt wanted wider alignment than documented): the
    first padding whose products are right becomes PAD_M."""
    global PAD_M
    failures = []
    for pad in (4, 16):
        PAD_M = pad
        why = _check_products(device, out_dtype)
        if why.startswith("relative error"):
            return True, f"{why}; rows padded to a multiple of {pad}"
        failures.append(f"padded to {pad}: {why}")
    PAD_M = 4
    return False, "; ".join(failures)


def _check_products(device: torch.device, out_dtype: torch.dtype) -> str:
    from pdserve.kernels.reference import quantize_fp8_blocks_ref, quantize_fp8_ref

    g = torch.Generator(device="cpu").manual_seed(0)
    k, n = 512, 256
    w = (torch.randn(n, k, generator=g, device="cpu") * torch.logspace(-2, 0, n)[:, None]).to(device)
    errs = []
    for m in (150, 256):  # padded rows and none
        x = (torch.randn(m, k, generator=g, device="cpu") * torch.logspace(-1, 1, k)).to(device, out_dtype)
        try:
            w8, ws = quantize_fp8_blocks_ref(w)
            out = block_linear(x, w8, ws.contiguous(), out_dtype)
            torch.cuda.synchronize(device)
        except Exception as e:  # unsupported here: the caller keeps the Triton GEMM
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        xq, xs = quantize_fp8_ref(x, BLOCK)
        ref = scaled_mm_blockwise_ref(xq, xs.t().contiguous().t(), w8, ws.t(), torch.float64)
        if out.shape != ref.shape or out.dtype != out_dtype:
            return f"wrong result at M={m}: shape {list(out.shape)} {out.dtype}"
        err = ((out.double() - ref).norm() / ref.norm()).item()
        # Hopper accumulates FP8 products in ~14-bit precision per group; bf16 output rounding
        # adds 2^-9. A wrong scale layout is off by O(1).
        if not err < 2e-2:
            return f"wrong result at M={m}: relative error {err:.3g} against the dequantized product"
        errs.append(err)
    return f"relative error {max(errs):.2e} against the dequantized product (M = 150, 256)"
