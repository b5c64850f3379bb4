"""Calibrated fp8 KV-cache scales from a checkpoint, where it has them.

FP8 checkpoints made with a calibrated KV cache carry per-layer, per-tensor scales beside the
attention weights: `model.layers.N.self_attn.k_scale` and `.v_scale` (compressed-tensors,
vLLM's naming), or one `.kv_scale` for both (older AutoFP8 exports). They are the scales the
KV cache stores values in (stored = x / scale). A checkpoint without them gets scale 1.0 for
every layer, as vLLM does when none are given: e4m3 then covers |x| <= 448 at full relative
precision, which unscaled K/V of the usual models stay within (larger values saturate).

Only these names are read here; the model loader owns every other tensor.
"""

from __future__ import annotations

import glob
import logging
import os
import re

import torch

log = logging.getLogger(__name__)

_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.)?(k_scale|v_scale|kv_scale)$")


def load_kv_scales(path: str, num_layers: int) -> torch.Tensor | None:
    """[num_layers, 2] fp32 (k, v) from the checkpoint's safetensors, or None when it has no
    KV scales. A checkpoint that scales some layers but not all is refused (ValueError naming
    the missing layer): mixing calibrated and unit scales would be silently wrong."""
    from safetensors import safe_open

    found: dict[tuple[int, int], float] = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(f, framework="pt", device="cpu") as sf:
            for name in sf.keys():
                m = _NAME.search(name)
                if m is None:
                    continue
                layer, kind = int(m.group(1)), m.group(2)
                value = sf.get_tensor(name).float()
                if value.numel() != 1:
                    raise ValueError(f"checkpoint tensor {name!r}: a per-tensor KV scale has one element, "
                                     f"got shape {list(value.shape)}")
                for col in ((0, 1) if kind == "kv_scale" else ((0,) if kind == "k_scale" else (1,))):
                    found[(layer, col)] = float(value.reshape(()))
    if not found:
        return None
    scales = torch.ones(num_layers, 2)
    for layer in range(num_layers):
        for col, what in ((0, "k_scale"), (1, "v_scale")):
            if (layer, col) not in found:
                raise ValueError(f"checkpoint {path} has KV cache scales for some layers but no {what} for "
                                 f"layer {layer}")
            scales[layer, col] = found[(layer, col)]
    if not bool(((scales > 0) & torch.isfinite(scales)).all()):
        raise ValueError(f"checkpoint {path} has a KV cache scale that is not a positive finite number")
    log.info("fp8 KV cache: calibrated k/v scales from the checkpoint (k %.4g..%.4g, v %.4g..%.4g)",
             scales[:, 0].min(), scales[:, 0].max(), scales[:, 1].min(), scales[:, 1].max())
    return scales
