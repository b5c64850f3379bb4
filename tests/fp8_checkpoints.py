"""Tiny FP8 checkpoints in each published format, and their dequantized fp32 twins.

`write_fp8_pair` takes a tiny random checkpoint (tests/checkpoints.py), quantizes its linear
weights the way the format's producers do (here, in the test, independently of pdserve's code)
and writes them with that format's real config keys and tensor names; beside it, the same model
with every weight dequantized to fp32 and no quantization_config: the reference.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# Mixtral names its experts' matrices w1 (gate), w3 (up), w2 (down); every MoE router (`gate`)
# stays unquantized, as the published FP8 MoE checkpoints leave it. DeepSeek's latent attention
# projections are FP8 in its published checkpoints (128x128 blocks), as are its experts.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3",
           "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
FORMATS = ("fp8-tensor", "fp8-block", "ct-channel", "online")


def _amax_scale(w: torch.Tensor) -> torch.Tensor:
    return w.abs().amax().float().clamp(min=1e-12) / E4M3_MAX


def quantize_tensor(w):  # one scale for the tensor
    s = _amax_scale(w)
    return (w / s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), s


def quantize_channel(w):  # one scale per output row, [N, 1]
    s = w.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return (w / s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), s


def quantize_block(w, b=128):  # one scale per 128 x 128 block; edge blocks partial
    n, k = w.shape
    s = torch.empty(-(-n // b), -(-k // b))
    q = torch.empty(n, k, dtype=E4M3)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * b:(i + 1) * b, j * b:(j + 1) * b]
            s[i, j] = _amax_scale(blk)
            q[i * b:(i + 1) * b, j * b:(j + 1) * b] = (blk / s[i, j]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q, s


def dequant_block(q, s, b=128):
    n, k = q.shape
    return q.float() * s.repeat_interleave(b, 0)[:n].repeat_interleave(b, 1)[:, :k]


CT_CONFIG = {
    "config_groups": {"group_0": {
        "input_activations": {"actorder": None, "block_structure": None, "dynamic": True, "group_size": None,
                              "num_bits": 8, "observer": None, "observer_kwargs": {}, "strategy": "token",
                              "symmetric": True, "type": "float"},
        "output_activations": None,
        "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "channel", "symmetric": True,
                    "type": "float"}}},
    "format": "float-quantized",
    "global_compression_ratio": 1.2,
    "ignore": ["lm_head", "re:.*layers\\.1\\.mlp\\..*"],  # layer 1's MLP stays unquantized
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}
QUANT_CONFIGS = {
    "fp8-tensor": {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                  "modules_to_not_convert": None, "weight_block_size": [128, 128]},
    "ct-channel": CT_CONFIG,
}


def _is_linear(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in LINEARS


def write_fp8_pair(base: Path, out: Path, fmt: str) -> tuple[Path, Path]:
    """-> (the FP8 checkpoint, its dequantized fp32 reference). `online` writes the base
    checkpoint unchanged (pdserve quantizes it with --quantization fp8) and a reference
    quantized per channel as that flag does."""
    q_dir, ref_dir = out / f"{fmt}", out / f"{fmt}-dequantized"
    for d in (q_dir, ref_dir):
        shutil.copytree(base, d)
        for f in d.glob("*.safetensors"):
            f.unlink()
    weights = load_file(str(next(base.glob("*.safetensors"))))
    quantized, dequantized = {}, {}
    for name, w in weights.items():
        if not _is_linear(name) or (fmt == "ct-channel" and ".layers.1.mlp." in name):
            quantized[name] = dequantized[name] = w
            continue
        stem = name[:-len(".weight")]
        if fmt == "fp8-tensor":
            q, s = quantize_tensor(w)
            quantized[name], quantized[f"{stem}.weight_scale"] = q, s.reshape(())
            quantized[f"{stem}.input_scale"] = torch.tensor(0.02)
            dequantized[name] = q.float() * s
        elif fmt == "fp8-block":
            q, s = quantize_block(w)
            quantized[name], quantized[f"{stem}.weight_scale_inv"] = q, s
            dequantized[name] = dequant_block(q, s)
        elif fmt == "ct-channel":
            q, s = quantize_channel(w)
            s = s.to(torch.bfloat16)  # llm-compressor writes the scales in the model's dtype
            quantized[name], quantized[f"{stem}.weight_scale"] = q, s
            dequantized[name] = q.float() * s.float()
        elif fmt == "online":
            q, s = quantize_channel(w)
            quantized[name], dequantized[name] = w, q.float() * s
        else:
            raise ValueError(fmt)
    save_file({k: v.contiguous() for k, v in quantized.items()}, str(q_dir / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in dequantized.items()}, str(ref_dir / "model.safetensors"))
    if fmt in QUANT_CONFIGS:
        cfg_path = q_dir / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["quantization_config"] = QUANT_CONFIGS[fmt]
        cfg_path.write_text(json.dumps(cfg, indent=2))
    return q_dir, ref_dir


def with_quantization_config(ckpt: Path, out: Path, quantization_config: dict) -> Path:
    """A copy of `ckpt` whose config.json carries `quantization_config` (weights untouched)."""
    shutil.copytree(ckpt, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
