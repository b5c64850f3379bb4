"""The sparse mixture-of-experts block: a router picks k of E expert MLPs per token, the experts
run as one fused op, and (Qwen2-MoE) a shared expert behind a sigmoid gate is added.

Routing is computed exactly as transformers does, in fp32 (kernels/reference.py: moe_route_ref; the
Triton path: kernels/moe_route.py, or with the sort in one launch, fused_moe.moe_route_align):
softmax over all E router logits,
top-k of the probabilities, and with `norm_topk_prob` (Qwen3-MoE, Qwen2-MoE when set, Mixtral
always) the k probabilities divided by their sum. (Mixtral's "softmax over the top-k logits" is the
same number: softmax then renormalise over the k equals a softmax over the k logits.)

Parallelism (parallel/shard.py's TPShard): every rank has every token (attention's output is
all-reduced), so every rank routes every token identically (replicated gate, same input).
- Without expert parallelism each expert's gate|up rows and down columns are split as a dense
  MLP's: a rank computes I/N columns of every chosen expert, and the partial outputs are summed.
- With it (`--enable-expert-parallel`) a rank holds E/N whole experts and computes only the
  assignments routed to them; the others contribute zeros, and the same all-reduce combines.
  This is the simple all-reduce expert parallelism: no all-to-all token dispatch, so every rank
  still moves a [T, H] partial per layer, and a rank whose experts are popular does more work.
One all-reduce per layer either way: the shared expert's partial sum joins the experts' before it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.kernels.reference import (dequantize_fp8_ref, dequantize_moe_fp8_ref, fused_moe_ref,
                                       fused_moe_routed_ref, moe_grouped_route_ref, quantize_fp8_rows_ref)
from pdserve.worker.attention.backend import AttentionBackend
from pdserve.worker.config.model import ModelConfig
from pdserve.worker.parallel.communicator import all_reduce
from pdserve.worker.parallel.shard import TPShard
from pdserve.worker.quantization.fp8_linear import warn_once, cuda_fp8_supported

FP8 = torch.float8_e4m3fn


def moe_op(backend: AttentionBackend) -> Callable:
    """The routing + experts op (router logits in, the layer's output out), following the attention
    backend as the pointwise ops do (models/llama.py): the Triton kernels on CUDA (and under the
    interpreter in the twin tests; they pick the fewest launches per batch size), the references
    on CPU. One op rather than two, so that decode batches can route and sort in one launch."""
    if backend.name == "triton":
        from pdserve.kernels.fused_moe import fused_moe_routed

        return fused_moe_routed
    return fused_moe_routed_ref


def grouped_route_op(backend: AttentionBackend) -> Callable:
    """DeepSeekMoE's group-limited top-k (reference.moe_grouped_route_ref's arguments): one kernel
    where the Triton backend runs (kernels/moe_grouped_route.py), else the reference."""
    if backend.name == "triton":
        from pdserve.kernels.moe_grouped_route import moe_grouped_route

        return moe_grouped_route
    return moe_grouped_route_ref


def topk_experts_op(backend: AttentionBackend) -> Callable:
    """The experts op from routing already made (weights, ids): for routers the fused op does not
    compute (DeepSeek's grouped top-k, models/deepseek.py); the same backend choice as moe_op."""
    if backend.name == "triton":
        from pdserve.kernels.fused_moe import fused_moe

        return fused_moe
    return fused_moe_ref


# Decode-sized steps route through kernels/moe_gate.py where the experts run on the fused op
# (False: the router's F.linear and the routing kernel at every size, tools/gpu/gpt_oss.py's
# --router-linear baseline).
FUSED_GATE = True
# And the layer's add + RMSNorm before the router inside that launch (moe_gate's `norm`): one launch
# a layer fewer, no faster (Qwen3-30B-A3B bs=1 on an H200: 1.49 ms/step either way; bench/moe.py
# engine --gate-norm), so off.
GATE_NORM = False


class DecodeGate:
    """The router's GEMV and top-k routing in one launch (kernels/moe_gate.py) for the steps the
    fused op runs on its decode path (up to moe_gate.MAX_TOKENS and fused_moe.decode_max_tokens;
    above them fused_moe_routed routes and sorts in one launch itself). The kernel counts its
    arrivals in the device's split-K counters (kernels/arrivals.py), taken once the weights are on
    their device (`allocate`, from a block's finish_loading: outside any CUDA-graph capture)."""

    def __init__(self):
        self.counters: torch.Tensor | None = None

    def allocate(self, device: torch.device) -> None:
        from pdserve.kernels.arrivals import strip_counters

        self.counters = strip_counters(device)

    def takes(self, tokens: int, mxfp4: bool) -> bool:
        """Shapes only (no sync): a CUDA graph replays the branch it captured."""
        from pdserve.kernels.fused_moe import decode_max_tokens
        from pdserve.kernels.moe_gate import MAX_TOKENS

        return FUSED_GATE and self.counters is not None and tokens <= min(MAX_TOKENS, decode_max_tokens(mxfp4))

    def takes_norm(self, x: torch.Tensor, norm: nn.Module, mxfp4: bool) -> bool:
        """Whether this step's router also does the RMSNorm before it (GATE_NORM; shapes and dtypes only)."""
        if not GATE_NORM:  # every MoE layer asks, every step: the common answer first
            return False
        from pdserve.kernels.moe_gate import NORM_MAX_HIDDEN

        return norm.weight.dtype == x.dtype and x.shape[1] <= NORM_MAX_HIDDEN and self.takes(x.shape[0], mxfp4)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                 renormalize: bool, norm: nn.Module | None = None,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """(weights, ids); with `norm` (an RMSNorm, x its input): (weights, ids, normed x, x + residual)."""
        from pdserve.kernels.moe_gate import GateNorm, moe_gate

        fused = None if norm is None else GateNorm(norm.weight, norm.eps, residual)
        return moe_gate(x, weight, bias, top_k, renormalize, self.counters, fused)


class FusedExperts(nn.Module):
    """The rank's experts stacked: w13 [E_local, 2 I_local, H] (gate rows, then up rows) and
    w2 [E_local, H, I_local], filled from the checkpoint's per-expert tensors at load.

    FP8 checkpoints (Qwen3-30B-A3B-FP8 and the like): an expert's e4m3 matrix and its scale
    (per-tensor, per-channel or 128x128 blocks, `weight_scale` / `weight_scale_inv`) arrive as
    two tensors in either order.
    - Where the Triton MoE op runs (`fp8_kernel`), the experts stay e4m3 (half bf16's memory and
      bytes per token): w13 / w2 hold this rank's e4m3 rows and columns, `w13_scale` / `w2_scale`
      their scales in kernels/fused_moe.py's layout (128x128 blocks as published, gate's and up's
      block rows each from their own first row; else one scale per row). Without expert
      parallelism a rank's I columns must start on a block boundary for block scales to split
      with them (I / N a multiple of 128); otherwise, and on GPUs without FP8 (before sm90:
      `finish_loading`), the experts are dequantized, with a log line.
    - Otherwise (the torch reference on CPU) each matrix is dequantized to the compute dtype once
      both tensors are here, and stored like a bf16 checkpoint's.
    `--quantization fp8` (an unquantized checkpoint): loaded in the compute dtype, then each
    expert's rows quantized per channel (`finish_loading`), as the dense linears are: kept e4m3
    where the Triton op runs, dequantized back elsewhere (the same values on every path).
    Attention and dense or shared-expert MLPs take their own FP8 path (quantization/fp8_linear.py)."""

    def __init__(self, cfg: ModelConfig, shard: TPShard, op: Callable, fp8_kernel: bool = False,
                 topk_op: Callable | None = None):
        """`op`: routing + experts (moe_op); `topk_op`: experts from given weights and ids (topk_experts_op),
        for models that route themselves (apply_topk)."""
        super().__init__()
        self.shard, self.op, self.topk_op = shard, op, topk_op
        self.local = shard.local_experts
        self.inter = n = shard.expert_intermediate_size
        e, h = len(self.local), cfg.hidden_size
        quant = cfg.quantization
        self.block = quant.block if quant is not None else None
        self._fp8: dict[tuple, dict] = {}  # (expert, part) -> {"weight"|"scale": tensor} until both arrived
        self.online = quant is not None and quant.source == "online"
        self.fp8_kernel = fp8_kernel
        self.keep_fp8 = fp8_kernel and quant is not None and not self.online and self._block_aligned()
        if not self.keep_fp8:
            self.w13 = nn.Parameter(torch.empty(e, 2 * n, h))
            self.w2 = nn.Parameter(torch.empty(e, h, n))
        else:
            bn, bk = self.block or (1, None)
            self.w13 = _param((e, 2 * n, h), FP8)
            self.w2 = _param((e, h, n), FP8)
            self.w13_scale = _param((e, 2 * -(-n // bn), -(-h // bk) if bk else 1), torch.float32)
            self.w2_scale = _param((e, -(-h // bn), -(-n // bk) if bk else 1), torch.float32)
            # load_model casts parameters to the compute dtype; these keep theirs (fp8_linear.keep_quantized_dtypes).
            self.param_dtypes = {"w13": FP8, "w2": FP8, "w13_scale": torch.float32, "w2_scale": torch.float32}

    def _block_aligned(self) -> bool:
        if self.block is None or self.shard.expert_parallel or self.shard.size == 1 or self.inter % self.block[0] == 0:
            return True
        warn_once("moe-fp8-blocks", "FP8 experts dequantized at load: %d of each expert's %d columns per rank "
                   "(tensor parallel %d) start mid-way through its %dx%d scale blocks (--enable-expert-parallel "
                   "keeps them FP8)", self.inter, self.shard.full.moe_intermediate_size, self.shard.size, *self.block)
        return False

    def shard_ids(self, param_name: str) -> list:
        """The parts of a parameter the checkpoint must supply (what load_weights checks)."""
        if param_name.endswith("_scale"):
            return []  # arrive with their matrices (loaded through w13 / w2): check_loaded pairs them
        if param_name.endswith("w13"):
            return [(e, part) for e in self.local for part in (0, 1)]
        return [(e, None) for e in self.local]

    def weight_loader(self, param: nn.Parameter, loaded, shard_id) -> None:
        """`shard_id` = (global expert id, 0 gate | 1 up | None down[, "scale"]). An expert another
        rank holds is skipped without reading it (a safetensors slice is read only when indexed)."""
        expert, part, *scale = shard_id
        if expert not in self.local:
            return
        if self.keep_fp8:
            self._load_fp8(loaded, expert, part, bool(scale))
            return
        if scale or _is_fp8(loaded):
            held = self._fp8.setdefault((expert, part), {})
            held["scale" if scale else "weight"] = loaded if isinstance(loaded, torch.Tensor) else loaded[:]
            if len(held) < 2:
                return  # its other half is further in the checkpoint
            del self._fp8[expert, part]
            loaded = dequantize_expert(held["weight"], held["scale"], self.block,
                                       f"expert {expert} {('gate', 'up')[part] if part is not None else 'down'}")
        e, n = expert - self.local.start, self.inter
        col = 0 if self.shard.expert_parallel else self.shard.rank * n  # this rank's I columns
        if part is None:
            param.data[e].copy_(loaded[:, col:col + n])
        else:
            param.data[e, part * n:(part + 1) * n].copy_(loaded[col:col + n])

    def _load_fp8(self, loaded, expert: int, part: int | None, is_scale: bool) -> None:
        """This rank's rows (gate/up) or columns (down) of an e4m3 matrix, or of its scale, copied
        as they are; the pair is tracked for check_loaded."""
        what = f"expert {expert} {('gate', 'up')[part] if part is not None else 'down'}"
        held = self._fp8.setdefault((expert, part), {})
        held["scale" if is_scale else "weight"] = True
        if len(held) == 2:
            del self._fp8[expert, part]
        e, n = expert - self.local.start, self.inter
        col = 0 if self.shard.expert_parallel else self.shard.rank * n  # this rank's I columns
        if not is_scale:
            if not _is_fp8(loaded):
                raise ValueError(f"checkpoint: {what} is {getattr(loaded, 'dtype', 'not e4m3')} in an FP8 "
                                 f"checkpoint; its experts run FP8 and must all be e4m3")
            if part is None:
                self.w2.data[e].copy_(loaded[:, col:col + n])
            else:
                self.w13.data[e, part * n:(part + 1) * n].copy_(loaded[col:col + n])
            return
        full_i, h = self.shard.full.moe_intermediate_size, self.w2.shape[1]
        rows, cols = (h, full_i) if part is None else (full_i, h)
        kind, s = expert_scale(loaded if isinstance(loaded, torch.Tensor) else loaded[:], rows, cols, self.block, what)
        if self.block is not None:
            bn, bk = self.block
            if kind == "tensor":  # every block of the tensor
                s = s.expand(-(-rows // bn), -(-cols // bk))
            elif kind == "row":  # the kernel's layout here is one scale per block
                raise ValueError(f"checkpoint: {what} has one scale per row in a {bn}x{bk} block-scaled checkpoint; "
                                 f"its experts run FP8 with block scales only")
            if part is None:
                self.w2_scale.data[e].copy_(s[:, col // bk:col // bk + self.w2_scale.shape[2]])
            else:
                nb = self.w13_scale.shape[1] // 2
                self.w13_scale.data[e, part * nb:(part + 1) * nb].copy_(s[col // bn:col // bn + nb])
            return
        per_row = s.reshape(-1).expand(rows)
        if part is None:
            self.w2_scale.data[e, :, 0].copy_(per_row)
        else:
            self.w13_scale.data[e, part * n:(part + 1) * n, 0].copy_(per_row[col:col + n])

    def finish_loading(self, compute_dtype: torch.dtype) -> None:
        """After the checkpoint: every FP8 matrix met its scale; FP8 experts on a GPU that cannot
        run the kernel's e4m3 conversions (before sm90) are dequantized to the compute dtype;
        --quantization fp8 quantizes the experts here."""
        self.check_loaded()
        dev = self.w13.device
        # On CPU the Triton op runs only under the interpreter (tests), which converts e4m3.
        kernel_ok = dev.type != "cuda" or cuda_fp8_supported(dev)
        if self.online:
            self._quantize_online(self.fp8_kernel and kernel_ok)
            return
        if not self.keep_fp8 or kernel_ok:
            return
        warn_once("moe-fp8-sm90", "no FP8 (sm90+) on %s: FP8 experts dequantized to %s", dev, compute_dtype)
        self.w13 = nn.Parameter(torch.stack([dequantize_moe_fp8_ref(w, s, self.block, parts=2).to(compute_dtype)
                                             for w, s in zip(self.w13, self.w13_scale)]), requires_grad=False)
        self.w2 = nn.Parameter(torch.stack([dequantize_moe_fp8_ref(w, s, self.block).to(compute_dtype)
                                            for w, s in zip(self.w2, self.w2_scale)]), requires_grad=False)
        del self.w13_scale, self.w2_scale
        self.keep_fp8 = False

    def _quantize_online(self, keep: bool) -> None:
        """Each expert's gate, up and down rows quantized per channel, one expert at a time (no
        fp32 copy of a whole layer): kept e4m3 with one scale per row, or dequantized in place."""
        e, rows13, h = self.w13.shape
        if not keep:
            for w in (*self.w13.data, *self.w2.data):
                w.copy_(dequantize_fp8_ref(*quantize_fp8_rows_ref(w)))
            return
        dev = self.w13.device
        q13, q2 = torch.empty(self.w13.shape, dtype=FP8, device=dev), torch.empty(self.w2.shape, dtype=FP8, device=dev)
        s13, s2 = torch.empty(e, rows13, 1, device=dev), torch.empty(e, h, 1, device=dev)
        for i in range(e):
            q13[i], s13[i, :, 0] = quantize_fp8_rows_ref(self.w13.data[i])
            q2[i], s2[i, :, 0] = quantize_fp8_rows_ref(self.w2.data[i])
        self.w13, self.w2 = nn.Parameter(q13, requires_grad=False), nn.Parameter(q2, requires_grad=False)
        self.w13_scale, self.w2_scale = nn.Parameter(s13, requires_grad=False), nn.Parameter(s2, requires_grad=False)
        self.keep_fp8 = True

    def check_loaded(self) -> None:
        """After the checkpoint: an FP8 matrix whose scale never came (or the reverse) is an error."""
        if self._fp8:
            (expert, part), held = next(iter(self._fp8.items()))
            raise ValueError(f"checkpoint: expert {expert} ({'down' if part is None else ('gate', 'up')[part]}) "
                             f"has its FP8 {next(iter(held))} but not its "
                             f"{'scale' if 'weight' in held else 'weight'} ({len(self._fp8)} such tensors)")

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
        """x [T, H], the router's logits [T, E] -> this rank's partial output [T, H]. Every rank
        routes over all E experts (global ids); under expert parallelism the op skips
        assignments to experts outside its range (zeros)."""
        fp8 = dict(w13_scale=self.w13_scale, w2_scale=self.w2_scale, block=self.block) if self.keep_fp8 else {}
        return self.op(x, self.w13, self.w2, router_logits, top_k, renormalize, expert_offset=self.local.start, **fp8)


    def apply_topk(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], the router's choice (weights [T, k] fp32, global expert ids [T, k]) -> this
        rank's partial output [T, H] (zeros for experts another rank holds)."""
        fp8 = dict(w13_scale=self.w13_scale, w2_scale=self.w2_scale, block=self.block) if self.keep_fp8 else {}
        return self.topk_op(x, self.w13, self.w2, weights, ids, expert_offset=self.local.start, **fp8)


def _param(shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def _is_fp8(loaded) -> bool:
    if isinstance(loaded, torch.Tensor):
        return loaded.dtype == torch.float8_e4m3fn
    return loaded.get_dtype() == "F8_E4M3"  # a safetensors slice (read under tensor parallelism)


def expert_scale(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int] | None,
                 what: str) -> tuple[str, torch.Tensor]:
    """An expert matrix's scale as published, in fp32, and its kind: "tensor" (one, as [1, 1]),
    "row" ([rows] or [rows, 1]: per channel; as [rows, 1]) or, in a block-scaled checkpoint,
    "block" ([ceil(rows / bn), ceil(cols / bk)]). Anything else is refused naming the matrix.
    The one reading of a scale's shape for both loading paths (kept FP8, or dequantized)."""
    s = scale.float()
    if s.numel() == 1:
        return "tensor", s.reshape(1, 1)
    if s.numel() == rows and (s.dim() == 1 or tuple(s.shape) == (rows, 1)):
        return "row", s.reshape(rows, 1)
    if block is not None:
        bn, bk = block
        want = (-(-rows // bn), -(-cols // bk))
        if tuple(s.shape) != want:
            raise ValueError(f"checkpoint: {what}'s block scales are {list(s.shape)}, expected {list(want)} "
                             f"for a [{rows}, {cols}] matrix in {bn}x{bk} blocks")
        return "block", s
    raise ValueError(f"checkpoint: {what}'s scale has shape {list(s.shape)}: not one per tensor or per row "
                     f"({rows}) of a [{rows}, {cols}] matrix")


def dequantize_expert(w8: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, what: str) -> torch.Tensor:
    """An expert's e4m3 matrix [rows, cols] and its scale (any kind `expert_scale` reads) -> fp32."""
    rows, cols = w8.shape
    kind, s = expert_scale(scale, rows, cols, block, what)
    if kind == "block":
        return dequantize_fp8_ref(w8, s.repeat_interleave(block[0], 0)[:rows], block)  # the reference takes a row each
    return dequantize_fp8_ref(w8, s.reshape(-1).expand(rows))


class SparseMoeBlock(nn.Module):
    """Router + experts (+ the shared expert); checkpoint names `mlp.gate`, `mlp.experts.N.*`,
    `mlp.shared_expert.*`, `mlp.shared_expert_gate` (Mixtral's are renamed to these at load)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, shard: TPShard, layer_idx: int = 0):
        from pdserve.worker.models.llama import MLP, pointwise_ops

        super().__init__()
        self.top_k, self.renormalize, self.shard = cfg.num_experts_per_tok, cfg.norm_topk_prob, shard
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # replicated: [E, H] is small
        self.experts = FusedExperts(cfg, shard, moe_op(backend), fp8_kernel=backend.name == "triton",
                                    topk_op=topk_experts_op(backend))
        self.decode_gate = DecodeGate() if self.experts.op is not fused_moe_routed_ref else None
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            # Its checkpoint name, for an FP8 checkpoint's ignore list (its linears follow the dense path).
            self.shared_expert = MLP(cfg, shard, pointwise_ops(backend), f"model.layers.{layer_idx}.mlp.shared_expert",
                                     inter=cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def finish_loading(self, compute_dtype: torch.dtype) -> None:
        if self.decode_gate is not None:
            self.decode_gate.allocate(self.gate.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.decode_gate is not None and self.decode_gate.takes(x.shape[0], mxfp4=False):
            weights, ids = self.decode_gate(x, self.gate.weight, None, self.top_k, self.renormalize)
            out = self.experts.apply_topk(x, weights, ids)
        else:
            out = self.experts(x, F.linear(x, self.gate.weight), self.top_k, self.renormalize)
        return self._with_shared(x, out)

    def takes_norm(self, x: torch.Tensor, norm: nn.Module) -> bool:
        return self.decode_gate is not None and self.decode_gate.takes_norm(x, norm, mxfp4=False)

    def forward_norm(self, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None):
        """norm(x (+ residual)) and this block in the router's launch (takes_norm): (out, x + residual)."""
        weights, ids, h, residual = self.decode_gate(x, self.gate.weight, None, self.top_k, self.renormalize, norm,
                                                     residual)
        return self._with_shared(h, self.experts.apply_topk(h, weights, ids)), residual

    def _with_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is not None:
            s = self.shared_expert
            # The down projection without its all-reduce: this rank's partial joins the experts'.
            shared = s.down_proj.linear(s.silu_and_mul(s.gate_up_proj(x)), None)  # FP8 or not
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * shared
        return all_reduce(out) if self.shard.size > 1 else out
