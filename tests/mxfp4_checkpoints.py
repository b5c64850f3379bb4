"""A tiny gpt-oss checkpoint in MXFP4 as published, and its dequantized fp32 twin.

`write_mxfp4_pair` takes a tiny random gpt-oss checkpoint (tests/checkpoints.py, transformers'
layout: `gate_up_proj` [E, H, 2I] with gate/up interleaved columns, `down_proj` [E, I, H]) and
writes
- `mxfp4/`: the experts as gpt-oss-20b/120b publish them, `gate_up_proj_blocks` [E, 2I, H/32, 16]
  and `_scales` [E, 2I, H/32] (rows interleaved gate/up, as transformers' dequantization expects:
  its output is transposed to [E, H, 2I]), `down_proj_blocks` [E, H, I/32, 16] and `_scales`, the
  biases and every other tensor unchanged, and the published quantization_config;
- `twin/`: the same model with each expert matrix replaced by its MXFP4 value in fp32 (exact) and
  no quantization_config: what transformers runs as the reference.
The blocks are made by kernels/mxfp4.quantize_mxfp4, whose decoding tests/kernels/test_mxfp4.py
checks against transformers' own. `corrupt` writes a deliberately wrong checkpoint (tests show
that the comparison catches each mistake): "nibbles" swaps each byte's two values, "interleave"
stores gate_up's rows as [gate; up] instead of interleaved, "orientation" stores down_proj's
blocks from the [I, H] matrix (the same shape when H == I). `packed_reference`: an experts op that
takes the packed tensors, as the fused Triton op does, for running the packed path on CPU.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pdserve.kernels.mxfp4 import checkpoint_view, dequantize_mxfp4, quantize_mxfp4
from pdserve.kernels.reference import fused_moe_routed_ref

# gpt-oss-20b's and -120b's quantization_config.
PUBLISHED = {"quant_method": "mxfp4",
             "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                        "lm_head"]}
CORRUPTIONS = ("nibbles", "interleave", "orientation")


def _copy_config(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)


def write_mxfp4_pair(src: Path, out: Path, corrupt: str | None = None,
                     quantization_config: dict | None = None) -> tuple[Path, Path]:
    """-> (mxfp4 directory, twin directory) under `out`."""
    tensors = load_file(str(src / "model.safetensors"))
    packed, twin = {}, {}
    for name, t in tensors.items():
        owner, _, leaf = name.rpartition(".")
        if leaf not in ("gate_up_proj", "down_proj"):
            packed[name] = twin[name] = t
            continue
        w = t.transpose(1, 2).contiguous()  # [E, out, in]: the blocks' orientation
        q, s = quantize_mxfp4(w)
        twin[name] = dequantize_mxfp4(q, s).transpose(1, 2).contiguous()
        if corrupt == "nibbles":
            q = (q << 4) | (q >> 4)
        elif corrupt == "interleave" and leaf == "gate_up_proj":
            q, s = torch.cat([q[:, 0::2], q[:, 1::2]], 1), torch.cat([s[:, 0::2], s[:, 1::2]], 1)
        elif corrupt == "orientation" and leaf == "down_proj":
            q, s = quantize_mxfp4(t)
        packed[f"{owner}.{leaf}_blocks"] = checkpoint_view(q).contiguous()
        packed[f"{owner}.{leaf}_scales"] = s
    mxfp4_dir, twin_dir = out / "mxfp4", out / "twin"
    for d, ts in ((mxfp4_dir, packed), (twin_dir, twin)):
        _copy_config(src, d)
        save_file(ts, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((mxfp4_dir / "config.json").read_text())
    cfg["quantization_config"] = quantization_config or PUBLISHED
    (mxfp4_dir / "config.json").write_text(json.dumps(cfg))
    return mxfp4_dir, twin_dir


def packed_reference(x, w13, w2, router_logits, top_k, renormalize, w13_scale, w2_scale, **kw):
    """An experts op that takes the packed tensors (as the fused Triton op does): dequantized here,
    then the torch reference."""
    return fused_moe_routed_ref(x, dequantize_mxfp4(w13, w13_scale, x.dtype), dequantize_mxfp4(w2, w2_scale, x.dtype),
                                router_logits, top_k, renormalize, **kw)
