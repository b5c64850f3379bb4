"""The paged KV cache tensor and its sizing.

Layout: one tensor [num_blocks, num_layers, 2 (k|v), block_size, num_kv_heads, head_dim]; a
multi-head latent attention model's has one entry of one "head" per token instead of K and V
([num_blocks, num_layers, 1, block_size, 1, latent_dim]: kv_spec.py).
Block-major on purpose: every byte of a block, for all layers, is one contiguous span, and a
run of consecutive block ids is one larger span. KV transfer then moves a request's blocks
with a handful of large descriptors instead of one per layer per block (per-descriptor
overhead dominates small transfers). Attention sees each layer as a strided view.

A model with sliding-window layers (kv_groups.py) splits its layers in two groups that share
the blocks: the tensor is then [num_blocks, groups.slots, 2, ...] and a layer's view is its
group's slot in every block (a block serves one group at a time; the block tables say which).

The element type is the model's dtype, or float8 e4m3 (--kv-cache-dtype fp8): one byte per
value, so the same memory holds twice the blocks of a bf16 cache and a hand-off moves half the
bytes. An fp8 cache stores x / scale with one K and one V scale per layer (`scales`, fp32
[num_layers, 2]); the write kernels divide by it, the attention kernels multiply it back in. A
latent cache's row is key and value at once: it uses the layer's K scale.
"""

from __future__ import annotations

import hashlib
import math
import mmap

import torch

from pdserve.kernels.reference import FP8_KV_DTYPE
from pdserve.protocol.kv_layout import KVLayout
from pdserve.worker.attention.kv_groups import KVGroups
from pdserve.worker.attention.kv_spec import kv_spec
from pdserve.worker.config.model import ModelConfig


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype's element type: auto = the model's dtype; fp8 / fp8_e4m3 = float8 e4m3."""
    return FP8_KV_DTYPE if name in ("fp8", "fp8_e4m3") else model_dtype


def kv_layout(cfg: ModelConfig, dtype: torch.dtype, block_size: int, scales: torch.Tensor | None = None,
              groups: KVGroups | None = None) -> KVLayout:
    """What P/D peers compare before a pull (str() of it: "<layers>x<kv heads>x<head dim>:<dtype>:<block size>").

    An fp8 cache's layout also names its scales ("float8_e4m3fn@1" when all are 1, else "@" and a
    digest of them): blocks written with other scales would dequantize to other values, so a pair
    whose scales differ must not exchange KV any more than one whose dtype does. A hybrid cache's
    (`groups`) names its group split too: its blocks hold one group's layers."""
    window, sliding = (groups.window, groups.sliding_layers) if groups is not None else (0, ())
    spec = kv_spec(cfg)
    if spec.latent and scales is not None:
        scales = scales[:, :1]  # a latent cache reads each layer's K scale only (attention/mla.py)
    return KVLayout(cfg.num_layers, spec.num_kv_heads, spec.head_dim, str(dtype).removeprefix("torch."), block_size,
                    scales_tag(scales) if dtype == FP8_KV_DTYPE else None, window, tuple(sliding), spec.latent)


def scales_tag(scales: torch.Tensor | None) -> str:
    """"1" for unit scales (no calibration), else the first 12 hex digits of their fp32 bytes' sha256."""
    if scales is None:
        return "1"
    s = scales.detach().to("cpu", torch.float32).contiguous()
    if bool((s == 1.0).all()):
        return "1"
    return hashlib.sha256(s.numpy().tobytes()).hexdigest()[:12]


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, but in host memory from a private anonymous mapping: the kernel hands out
    zero pages as they are first written, where torch.zeros writes every byte up front. A CPU
    worker's default cache is 1 GiB: zeroing it cost each start about a CPU-second and its
    whole size in resident memory before the first request. Private, so a forked child
    copies on write as it would with malloc's memory (a cache meant to be shared moves to
    shared memory explicitly: kv/connector.py)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 scales: torch.Tensor | None = None, groups: KVGroups | None = None):
        """`dtype`: the element type (the model's, or FP8_KV_DTYPE); `scales`: an fp8 cache's
        per-layer (k, v) scales, [num_layers, 2] (None: all 1, as vLLM without calibrated scales);
        `groups`: full and sliding layers sharing the blocks (None: a block holds every layer)."""
        self.num_blocks, self.block_size = num_blocks, block_size
        self.groups = groups
        self.num_layers = cfg.num_layers
        self.dtype = dtype
        self.spec = spec = kv_spec(cfg)
        self.quantized = dtype == FP8_KV_DTYPE
        if scales is None:
            scales = torch.ones(cfg.num_layers, 2)
        if tuple(scales.shape) != (cfg.num_layers, 2) or not bool((scales > 0).all()) or \
                not bool(torch.isfinite(scales).all()):
            raise ValueError(f"KV cache scales must be [{cfg.num_layers}, 2] positive finite numbers, "
                             f"got shape {list(scales.shape)}")
        self.scales = scales.to(device=device, dtype=torch.float32).contiguous()
        # What a peer must share for our blocks' bytes to mean the same there (checked before a pull).
        self.layout = kv_layout(cfg, dtype, block_size, self.scales if self.quantized else None, groups)
        self.tensor = zeroed((num_blocks, layers_per_block(cfg, groups), spec.entries, block_size,
                              spec.num_kv_heads, spec.head_dim), dtype, device)
        # Pre-built views: indexing per layer on every forward would allocate view objects.
        slot = groups.slot if groups is not None else int
        # (K, V) per layer; a latent cache's one entry as both (MLA reads K's view: attention/mla.py).
        self._layers = [(self.tensor[:, slot(i), 0], self.tensor[:, slot(i), spec.entries - 1])
                        for i in range(cfg.num_layers)]
        # Per layer: whether it reads the sliding group's block tables (AttentionMetadata.sliding).
        self.sliding = [groups is not None and groups.is_sliding(i) for i in range(cfg.num_layers)]
        # [1]-element views the kernels load (a device pointer: CUDA graphs read the current value).
        self._scales = [(self.scales[i, 0:1], self.scales[i, 1:2]) if self.quantized else (None, None)
                        for i in range(cfg.num_layers)]

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layers[i]

    def layer_scales(self, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer i's (k_scale, v_scale), [1] fp32 each; (None, None) for an unquantized cache."""
        return self._scales[i]

    @property
    def block_bytes(self) -> int:
        return self.tensor[0].numel() * self.tensor.element_size()

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, groups: KVGroups | None = None) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return layers_per_block(cfg, groups) * block_size * kv_spec(cfg).token_values() * elem


def layers_per_block(cfg: ModelConfig, groups: KVGroups | None) -> int:
    return groups.slots if groups is not None else cfg.num_layers
