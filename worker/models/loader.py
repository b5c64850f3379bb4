"""Load a Hugging Face checkpoint (local directory or hub id) into our model, logging stages."""

from __future__ import annotations

import glob
import logging
import math
import os
import time
from dataclasses import dataclass

import torch

from pdserve.kernels.mxfp4 import FP4_MAX, SCALE_BIAS
from pdserve.worker.config.model import ModelConfig
from pdserve.worker.models import cpu_packed

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    path: str
    model: torch.nn.Module
    model_config: ModelConfig
    tokenizer: object


def resolve_model_path(model: str | None, weights: bool = True) -> str:
    """A local directory as is; None -> the default model; anything else -> a hub snapshot
    (without its *.safetensors when `weights` is False: --load-format dummy)."""
    if model is None:
        from pdserve.worker.models.default_model import ensure_default_model

        return str(ensure_default_model())
    if os.path.isdir(model):
        return model
    if os.path.exists(model):
        raise FileNotFoundError(f"--model {model!r} is a file; pass the checkpoint directory")
    if model.startswith(("/", "./", "../", "~")):
        raise FileNotFoundError(f"--model {model!r}: no such directory")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.model", "*.jinja", "*.txt"] + (["*.safetensors"] if weights else [])
    log.info("downloading %s from the hub (%sconfig, tokenizer)", model, "safetensors, " if weights else "")
    return snapshot_download(model, allow_patterns=patterns)


def _stage(name: str, t0: float) -> float:
    t = time.perf_counter()
    log.info("load: %-28s %6.2fs", name, t - t0)
    return t


def read_model_config(path: str, quantization: str | None = None) -> ModelConfig:
    from transformers import AutoConfig, GenerationConfig

    hf_config = AutoConfig.from_pretrained(path)
    try:
        gen_eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        gen_eos = None
    return ModelConfig.from_hf(hf_config, gen_eos, quantization)


def load_model(model: str | None, device: torch.device, dtype: torch.dtype, backend, max_positions: int | None = None,
               tp: tuple[int, int] = (0, 1), expert_parallel: bool = False,
               quantization: str | None = None, load_format: str = "auto") -> LoadedModel:
    """tp = (rank, size): with size > 1 the model holds rank's shard (parallel/shard.py) and
    `model.cfg` is the shard's config; `model_config` stays the full model's. `expert_parallel`:
    an MoE model's experts are divided whole among the ranks (models/moe.py). `quantization`:
    --quantization (fp8: quantize an unquantized checkpoint at load; worker/quantization).
    `load_format`: --load-format; "dummy" fills the parameters with random values
    (init_dummy_weights) instead of reading the checkpoint's *.safetensors."""
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from pdserve.worker.models.registry import model_class
    from pdserve.worker.quantization.fp8_linear import keep_quantized_dtypes, process_quantized

    t = time.perf_counter()
    dummy = load_format == "dummy"
    path = resolve_model_path(model, weights=not dummy)
    t = _stage(f"resolve {os.path.basename(path.rstrip('/'))}", t)
    cfg = read_model_config(path, quantization)
    tokenizer = AutoTokenizer.from_pretrained(path)
    t = _stage("config + tokenizer", t)

    shard = None
    if expert_parallel and not cfg.is_moe:
        log.warning("--enable-expert-parallel has no effect: %s has no experts", cfg.architecture)
    if tp[1] > 1:
        from pdserve.worker.parallel.shard import TPShard

        shard = TPShard(tp[0], tp[1], cfg, expert_parallel=expert_parallel and cfg.is_moe)
    positions = max_positions or cfg.max_position_embeddings
    # Build on the meta device and materialise on the target: no random init, no CPU copy.
    with torch.device("meta"):
        net = model_class(cfg.architecture)(cfg, backend, positions, shard)
    net = keep_quantized_dtypes(net.to(dtype=dtype)).to_empty(device=device)
    net.init_rope(positions)
    files = [] if dummy else sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files and not dummy:
        raise FileNotFoundError(f"no *.safetensors in {path} (--load-format dummy runs random weights without them)")

    def tensors():
        # Whole tensors at TP = 1; under TP, slices: each parameter's weight loader
        # (parallel/layers.py) indexes its rank's part, and only that part is read from the file.
        for f in files:
            with safe_open(f, framework="pt", device=str(device)) as sf:
                for name in sf.keys():
                    # Quantization scales are small and may be 0-d: read whole.
                    whole = shard is None or name.endswith(("_scale", "_scale_inv"))
                    yield name, sf.get_tensor(name) if whole else sf.get_slice(name)

    if dummy:
        init_dummy_weights(net)
        log.info("load: --load-format dummy: random weights (uniform +-%g, seed %d) of %s's shapes and formats, "
                 "made on %s; no weight file read", DUMMY_RANGE, DUMMY_SEED, cfg.architecture, device)
    else:
        net.load_weights(tensors())
    process_quantized(net, dtype)
    quant = cfg.quantization or cfg.mxfp4
    if quant is not None and device.type == "cuda":
        # The bf16 weights quantized at load (--quantization fp8), or MXFP4 ones dequantized, leave
        # freed blocks in torch's cache; KV sizing counts reserved memory as this process's, so
        # hand them back first.
        torch.cuda.empty_cache()
    net.eval()
    nbytes = sum(p.numel() * p.element_size() for p in net.parameters())
    if cpu_packed.wanted(device, dtype):
        cpu_packed.pack_model(net)
    what = "weights" if shard is None else f"weights, shard {shard.rank}/{shard.size}"
    if quant is not None:
        what += f", {quant.describe}"
    source = "dummy" if dummy else f"{len(files)} files"
    _stage(f"{what} ({nbytes / 2**20:.0f} MiB, {source}) -> {device}", t)
    return LoadedModel(path, net, cfg, tokenizer)


# vLLM's dummy weights: small uniform values (every product and sum stays far from overflow, so
# the model runs without inf/NaN), from a fixed seed (the same weights each start).
DUMMY_RANGE = 1e-3
DUMMY_SEED = 1234
_FP8_PIECE = 1 << 26  # elements drawn at once for an e4m3 tensor (a 128 MiB fp16 temporary at most)
# MXFP4's E8M0 exponent for dummy weights: e2m1 values (|v| <= 6) times 2^-13, within DUMMY_RANGE.
DUMMY_MXFP4_SCALE = SCALE_BIAS + math.floor(math.log2(DUMMY_RANGE / FP4_MAX))


def init_dummy_weights(net: torch.nn.Module, seed: int = DUMMY_SEED) -> None:
    """Fill every parameter in place on its device: floating point ones uniform in
    +-DUMMY_RANGE; FP8 (e4m3) weights uniform in +-1, their fp32 scales (names ending in
    `scale` / `scale_inv`) DUMMY_RANGE, so a dequantized weight is again of order DUMMY_RANGE;
    MXFP4 (uint8) weights random bytes (every byte is two valid e2m1 codes), their uint8
    exponents DUMMY_MXFP4_SCALE, likewise within DUMMY_RANGE once decoded.
    One generator in parameter order: deterministic for a given model, device and dtype."""
    params = list(net.named_parameters())
    if not params:
        return
    gen = torch.Generator(device=params[0][1].device)
    gen.manual_seed(seed)
    with torch.no_grad():
        for name, p in params:
            leaf = name.rsplit(".", 1)[-1]
            if p.dtype == torch.uint8 and _quantized_owner(net, name):  # MXFP4 (models/gpt_oss.py), in place
                if leaf.endswith("scale"):
                    p.fill_(DUMMY_MXFP4_SCALE)
                else:
                    p.random_(0, 256, generator=gen)
                continue
            if not p.is_floating_point():
                continue
            if leaf.endswith(("scale", "scale_inv")) and p.dtype == torch.float32 and _quantized_owner(net, name):
                p.fill_(DUMMY_RANGE)
            elif p.element_size() == 1:  # e4m3: drawn in fp16 (uniform_ has no fp8 kernel), in bounded pieces
                flat = p.data.view(-1)
                for i in range(0, flat.numel(), _FP8_PIECE):
                    piece = flat[i:i + _FP8_PIECE]
                    piece.copy_(torch.empty(piece.shape, dtype=torch.float16, device=p.device).uniform_(
                        -1, 1, generator=gen))
            else:
                p.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)


def _quantized_owner(net: torch.nn.Module, name: str) -> bool:
    """The parameter belongs to an FP8 layer (one whose build recorded the dtypes to keep)."""
    owner = net.get_submodule(name.rpartition(".")[0]) if "." in name else net
    return bool(getattr(owner, "param_dtypes", None))
