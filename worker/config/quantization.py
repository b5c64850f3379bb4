"""Which quantized format a checkpoint is in: `quantization_config` (or --quantization fp8) ->
Fp8Config, or Mxfp4Config for gpt-oss's MXFP4 experts.

Every format pdserve runs reduces to one shape: an e4m3 weight [out, in] with fp32 scales that
multiply it (per output row, or per 128 x 128 block), and activations quantized to e4m3 just
before the GEMM (per token, per token and 128-column group, or with the checkpoint's static
per-tensor scale). Formats:

- `quant_method: fp8` without `weight_block_size`: one `weight_scale` per checkpoint tensor
  (per-tensor), `input_scale` per tensor when `activation_scheme: static`.
- `quant_method: fp8` with `weight_block_size: [128, 128]` (DeepSeek-V3, Qwen3-*-FP8): one
  `weight_scale_inv` per 128 x 128 block (the name says inverse, but it multiplies the weight,
  as in those checkpoints' own dequantization); activations per token and 128-column group.
- `quant_method: compressed-tensors`, `format: float-quantized` (llm-compressor's FP8 and
  FP8_DYNAMIC, RedHatAI/neuralmagic): `weight_scale` per channel [out, 1], per tensor, or per
  block; activations dynamic per token or static per tensor.
- `--quantization fp8` on an unquantized checkpoint: per-channel weights computed at load,
  dynamic per-token activations.

MXFP4 (`quant_method: mxfp4`, gpt-oss as published) is a format of gpt-oss's experts only: their
`*_blocks` / `*_scales` tensors (kernels/mxfp4.py); attention, router, embeddings and lm_head are
bf16 (the config's `modules_to_not_convert`; transformers converts nothing but the experts).

Anything else is refused when the model is read, with the config key and value that we cannot
run, never a traceback half-way through loading.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pdserve.worker.config.unsupported_model import UnsupportedModelError

FP8_MAX = 448.0  # largest finite float8_e4m3fn
BLOCK = (128, 128)  # the one block shape the block GEMM is written for (DeepSeek-V3, Qwen3-FP8)

WEIGHT_SCHEMES = ("channel", "block")  # a per-tensor scale is stored per row (exact: rows of one tensor share it)
ACTIVATION_SCHEMES = ("token", "group", "static")  # dynamic per token, dynamic per token x 128 columns, static


class QuantizationError(UnsupportedModelError):
    """A quantization_config (or --quantization) pdserve cannot run; names the key and its value."""


@dataclass(frozen=True)
class Fp8Config:
    source: str  # "fp8" | "compressed-tensors" | "online" (--quantization fp8)
    weight: str  # WEIGHT_SCHEMES
    activation: str  # ACTIVATION_SCHEMES
    scale_name: str = "weight_scale"  # the checkpoint's name of the weight scales ("weight_scale_inv": fp8 block)
    ignore: tuple[str, ...] = ()  # module names (or "re:" patterns) left unquantized by the checkpoint
    key: str = "quantization_config"  # where `ignore` came from, for messages

    @property
    def block(self) -> tuple[int, int] | None:
        return BLOCK if self.weight == "block" else None

    @property
    def describe(self) -> str:
        w = {"channel": "per-channel", "block": "128x128 block"}[self.weight]
        a = {"token": "dynamic per-token", "group": "dynamic per-token x 128", "static": "static per-tensor"}
        return f"fp8 ({self.source}: {w} weights, {a[self.activation]} activations)"

    def ignored(self, module: str) -> bool:
        """Whether the checkpoint left `module` (a checkpoint module name, e.g.
        model.layers.0.self_attn.q_proj) unquantized."""
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif f".{module}.".find(f".{entry}.") >= 0:  # whole dotted components: "lm_head", "layers.0.mlp"
                return True
        return False

    def quantizes(self, prefix: str, parts: list[str]) -> bool:
        """Whether the fused linear made of checkpoint modules prefix.part (q/k/v, gate/up) is
        FP8. One GEMM cannot mix an FP8 part with a bf16 one, so a partly ignored fusion is refused."""
        flags = {p: self.ignored(f"{prefix}.{p}") for p in parts}
        if len(set(flags.values())) > 1:
            raise QuantizationError(
                f"{self.key}: ignores {[p for p, f in flags.items() if f]} but not "
                f"{[p for p, f in flags.items() if not f]} of {prefix}; pdserve fuses them into one GEMM, "
                f"which is either FP8 or not (ignore list: {list(self.ignore)})")
        return not next(iter(flags.values()))


@dataclass(frozen=True)
class Mxfp4Config:
    """gpt-oss's experts in MXFP4 (models/gpt_oss.py); every other weight in the checkpoint's dtype."""

    ignore: tuple[str, ...] = ()  # modules_to_not_convert: transformers' patterns

    @property
    def describe(self) -> str:
        return "mxfp4 experts"

    def converts(self, module: str) -> bool:
        """Whether `module` (e.g. model.layers.3.mlp.experts) is MXFP4 in the checkpoint, by
        transformers' rule (quantizers_utils.should_convert_module): a pattern skips a module it
        matches from the start up to a dot boundary (as a regex), or as a suffix."""
        return not any(re.match(rf"(?:{p})(?:(?<=\.)|(?=\.|$))", module) or module.endswith(p) for p in self.ignore)


MXFP4_ARCHITECTURES = ("GptOssForCausalLM",)


def _dict(qc: Any) -> dict:
    return qc if isinstance(qc, dict) else (qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc)))


def _refuse(key: str, value: Any, why: str) -> QuantizationError:
    return QuantizationError(f"quantization_config.{key} = {value!r}: {why}")


def parse_quantization(quantization_config: Any, flag: str | None,
                       architecture: str | None = None) -> Fp8Config | Mxfp4Config | None:
    """The checkpoint's quantization_config (None if absent) and the --quantization flag -> the
    format to run, or None for an unquantized model. `architecture`: the model's (MXFP4 is
    gpt-oss's only)."""
    if flag not in (None, "fp8"):
        raise QuantizationError(f"--quantization: must be fp8, got {flag!r}")
    if quantization_config is None:
        return Fp8Config("online", "channel", "token") if flag == "fp8" else None
    qc = _dict(quantization_config)
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8(qc)
    if method == "compressed-tensors":
        if flag is not None:
            raise QuantizationError("--quantization fp8: the checkpoint is already quantized "
                                    "(quantization_config.quant_method = 'compressed-tensors'); omit the flag")
        return _compressed_tensors(qc)
    if method == "mxfp4":  # gpt-oss as published: its experts' *_blocks / *_scales tensors
        if architecture not in MXFP4_ARCHITECTURES:
            raise _refuse("quant_method", method, f"MXFP4 weights run as gpt-oss's experts only "
                                                  f"({', '.join(MXFP4_ARCHITECTURES)}), not {architecture}")
        if flag is not None:
            raise QuantizationError(f"--quantization {flag}: the checkpoint is already quantized "
                                    f"(quantization_config.quant_method = 'mxfp4'); omit the flag")
        return Mxfp4Config(tuple(qc.get("modules_to_not_convert") or ()))
    raise _refuse("quant_method", method, "pdserve runs fp8 and compressed-tensors (float-quantized) checkpoints, "
                                          "and gpt-oss's mxfp4 ones; int8, awq, gptq, bitsandbytes and other "
                                          "methods are not supported")


def _fp8(qc: dict) -> Fp8Config:
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _refuse("fmt", qc.get("fmt"), "only e4m3 weights are supported")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _refuse("activation_scheme", scheme, "must be dynamic or static")
    key = "ignored_layers" if qc.get("ignored_layers") else "modules_to_not_convert"
    ignore = tuple(qc.get(key) or ())
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Config("fp8", "channel", "static" if scheme == "static" else "token",
                         ignore=ignore, key=f"quantization_config.{key}")
    if list(block) != list(BLOCK):
        raise _refuse("weight_block_size", block, "only [128, 128] blocks are supported")
    if scheme != "dynamic":
        raise _refuse("activation_scheme", scheme, "block-scaled weights need dynamic activations")
    return Fp8Config("fp8", "block", "group", "weight_scale_inv", ignore, f"quantization_config.{key}")


def _compressed_tensors(qc: dict) -> Fp8Config:
    fmt = qc.get("format")
    if fmt != "float-quantized":
        raise _refuse("format", fmt, "pdserve runs compressed-tensors float-quantized (FP8) checkpoints only")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse("quantization_status", status, "the weights must be stored compressed (FP8)")
    if qc.get("sparsity_config"):
        raise _refuse("sparsity_config", "...", "sparse checkpoints are not supported")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise _refuse("config_groups", sorted(groups), "exactly one quantization scheme group is supported")
    (gname, group), = groups.items()
    g = f"config_groups.{gname}"
    if group.get("targets") != ["Linear"]:
        raise _refuse(f"{g}.targets", group.get("targets"), "only ['Linear'] (every linear layer) is supported")
    if group.get("output_activations"):
        raise _refuse(f"{g}.output_activations", group["output_activations"], "output quantization is not supported")
    w = group.get("weights") or {}
    for k, want in (("type", "float"), ("num_bits", 8), ("symmetric", True), ("dynamic", False)):
        if w.get(k, want) != want:
            raise _refuse(f"{g}.weights.{k}", w.get(k), f"FP8 weights need {want!r}")
    strategy = w.get("strategy")
    if strategy in ("channel", "tensor"):
        weight = "channel"
    elif strategy == "block":
        shape = w.get("block_structure")
        if isinstance(shape, str):  # older releases wrote "128x128"
            shape = [int(s) for s in shape.split("x")]
        if list(shape or ()) != list(BLOCK):
            raise _refuse(f"{g}.weights.block_structure", w.get("block_structure"), "only [128, 128] is supported")
        weight = "block"
    else:
        raise _refuse(f"{g}.weights.strategy", strategy, "must be channel, tensor or block")
    a = group.get("input_activations")
    if not a:
        raise _refuse(f"{g}.input_activations", a, "weight-only FP8 (W8A16) is not supported; "
                                                   "activations must be FP8 too")
    for k, want in (("type", "float"), ("num_bits", 8), ("symmetric", True)):
        if a.get(k, want) != want:
            raise _refuse(f"{g}.input_activations.{k}", a.get(k), f"FP8 activations need {want!r}")
    a_strategy, dynamic = a.get("strategy"), a.get("dynamic")
    if weight == "block":
        if not (dynamic and a_strategy in ("group", "token") and a.get("group_size") in (None, BLOCK[1])):
            raise _refuse(f"{g}.input_activations", {"strategy": a_strategy, "dynamic": dynamic,
                                                     "group_size": a.get("group_size")},
                          "block-scaled weights need dynamic per-token group-128 activations")
        activation = "group"
    elif dynamic is True and a_strategy in ("token", "tensor"):
        activation = "token"  # dynamic per-tensor runs per token: finer scales, same GEMM
    elif dynamic is False and a_strategy == "tensor":
        activation = "static"
    else:
        raise _refuse(f"{g}.input_activations.strategy", a_strategy,
                      f"with dynamic={dynamic!r}: supported are dynamic token/tensor and static tensor")
    return Fp8Config("compressed-tensors", weight, activation, "weight_scale", tuple(qc.get("ignore") or ()),
                     "quantization_config.ignore")
