"""SASS instructions per K-loop step of the MXFP4 decode GEMVs, compiled for sm_90 on a machine without a GPU.

The decode GEMVs (kernels/fused_moe.py: gate|up, down, down split) are bound by instruction issue on an H200,
not by HBM: this counts what a K step costs. The real launch code runs (`_fused_moe_decode` on CPU tensors of
gpt-oss-120b's shapes: hidden 2880, intermediate 2880, 128 experts, top-4, biases, clamped SwiGLU, one token,
the default decode config), with every Triton launch intercepted: the kernel is compiled for sm_90 from the
same arguments (so pointer alignment and integer specialization are what a GPU launch sees) and not run. Each
kernel's cubin goes through nvdisasm (the copy in the triton wheel); its K loop is the longest backward
branch's body, and its instructions per step are printed by opcode class, and per weight value (a thread's
share of the step's weights: rows x BLOCK_K / threads), with the registers a thread (cuobjdump).

    cd /tmp && /work/wt-mx/.venv/bin/python /work/wt-mx/tools/sass_loop.py \
        --fused-moe /work/wt-mx/tools/gpu/baselines/fused_moe_600a0db.py --fused-moe /work/wt-mx/kernels/fused_moe.py

Without --fused-moe: the installed pdserve.kernels.fused_moe. --sass DIR writes each kernel's SASS there.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

TARGET = GPUTarget("cuda", 90, 32)
NVIDIA_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
HIDDEN, INTER, EXPERTS, TOP_K = 2880, 2880, 128, 4
# Opcode (before the first '.') -> class, in the table's column order.
CLASSES = {
    "fp32": ("FFMA", "FMUL", "FADD", "FMNMX", "FSETP", "FSEL", "MUFU", "F2F", "I2F", "F2I", "HADD2", "HFMA2",
             "HMUL2"),
    "int": ("IMAD", "IADD3", "IADD", "LEA", "SHF", "SHL", "SHR", "LOP3", "LOP", "ISETP", "SEL", "IMNMX", "PRMT",
            "IABS", "FLO", "POPC", "BREV", "SGXT", "IMUL", "VIADD"),
    "load": ("LDG", "LDS", "LD", "LDC", "LDGSTS", "LDSM", "ULDC"),
    "store": ("STG", "STS", "ST", "STSM", "RED", "ATOM", "ATOMG"),
    "move": ("MOV", "MOV32I", "S2R", "S2UR", "CS2R", "R2UR", "PLOP3", "P2R", "R2P", "UMOV", "UIADD3", "UIMAD",
             "ULOP3", "USHF", "ULEA", "UISETP", "USEL", "UPRMT", "UFLO", "UPOPC"),
    "shuffle/sync": ("SHFL", "BAR", "MEMBAR", "DEPBAR", "WARPSYNC", "BSSY", "BSYNC", "VOTE", "NOP"),
    "branch": ("BRA", "EXIT", "RET", "CALL", "JMP", "BRX"),
}
CLASS_OF = {op: cls for cls, ops in CLASSES.items() for op in ops}


def load_module(path: str | None, index: int):
    """kernels/fused_moe.py as a module: the installed one, or a copy loaded by path (its own kernels)."""
    if path is None:
        from pdserve.kernels import fused_moe
        return fused_moe
    spec = importlib.util.spec_from_file_location(f"_sass_fused_moe_{index}", os.path.abspath(path))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


class Compiled:
    """Every intercepted launch compiled for TARGET: (kernel name, constexprs, num_warps, cubin)."""

    def __init__(self):
        self.kernels: list[tuple[str, dict, int, bytes]] = []
        self.seen: set = set()
        self.backend = make_backend(TARGET)

    def run(self, fn: JITFunction, args, kwargs):
        binder = create_function_from_signature(fn.signature, fn.params, self.backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound, specialization, options)
        key = (fn.__name__, str(sorted(constexprs.items(), key=str)), str(attrs), options.num_warps)
        if key in self.seen:
            return
        self.seen.add(key)
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET,
                                options=options.__dict__)
        names = {fn.arg_names[path[0]]: v for path, v in constexprs.items() if len(path) == 1}
        self.kernels.append((fn.__name__, names, options.num_warps, kernel.asm["cubin"]))


def compile_decode(mod) -> Compiled:
    """The module's decode path at gpt-oss-120b's shapes, every launch compiled, none run."""
    compiled = Compiled()
    original = JITFunction.run

    def intercept(self, *args, grid, warmup, **kwargs):
        compiled.run(self, args, kwargs)

    g = torch.Generator().manual_seed(0)
    # Untouched torch.empty pages cost no memory: the expert tensors have the real strides.
    w13 = torch.empty((EXPERTS, 2 * INTER, HIDDEN // 2), dtype=torch.uint8)
    w2 = torch.empty((EXPERTS, HIDDEN, INTER // 2), dtype=torch.uint8)
    w13_scale = torch.empty((EXPERTS, 2 * INTER, HIDDEN // 32), dtype=torch.uint8)
    w2_scale = torch.empty((EXPERTS, HIDDEN, INTER // 32), dtype=torch.uint8)
    w13_bias = torch.zeros((EXPERTS, 2 * INTER), dtype=torch.bfloat16)
    w2_bias = torch.zeros((EXPERTS, HIDDEN), dtype=torch.bfloat16)
    x = torch.randn((1, HIDDEN), generator=g).to(torch.bfloat16)
    ids = torch.tensor([[3, 17, 64, 101]], dtype=torch.int32)
    weights = torch.full((TOP_K,), 0.25)
    from pdserve.kernels.moe_activation import SwigluOAI
    act = SwigluOAI(alpha=1.702, limit=7.0)
    base = mod.moe_decode_config(TOP_K, INTER, mxfp4=True, tokens=1)
    JITFunction.run = intercept
    try:
        for down_split in (base.get("DOWN_SPLIT_K", 0) or 2, 0):  # the split down kernel and the plain one
            cfg = dict(base, DOWN_SPLIT_K=down_split)
            mod._fused_moe_decode(x, w13, w2, weights, ids, 0, cfg, w13_scale, w2_scale, None, w13_bias, w2_bias,
                                  act)
    finally:
        JITFunction.run = original
    return compiled


INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]*)?\s*([^;]*);")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
BRANCH_TARGET = re.compile(r"(\.L_x_\d+)")


def disassemble(cubin: bytes) -> tuple[str, int]:
    """(the cubin's SASS, registers a thread)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([os.path.join(NVIDIA_BIN, "nvdisasm"), "-c", f.name], check=True,
                              capture_output=True, text=True).stdout
        usage = subprocess.run([os.path.join(NVIDIA_BIN, "cuobjdump"), "-res-usage", f.name], check=True,
                               capture_output=True, text=True).stdout
    return sass, int(re.search(r"REG:(\d+)", usage).group(1))


def k_loop(sass: str) -> list[str]:
    """The opcodes of the longest backward branch's body (the K loop: its other loops are unrolled)."""
    instrs, labels = [], {}
    for line in sass.splitlines():
        if m := LABEL.match(line):
            labels[m.group(1)] = len(instrs)
        elif m := INSTR.match(line):
            instrs.append((m.group(3), m.group(5)))
    best = (0, 0)
    for i, (op, operands) in enumerate(instrs):
        if op == "BRA" and (t := BRANCH_TARGET.search(operands)) and labels.get(t.group(1), i + 1) <= i:
            start = labels[t.group(1)]
            best = max(best, (i + 1 - start, start), key=lambda b: b[0])
    length, start = best
    return [op for op, _ in instrs[start:start + length]]


def weights_per_thread(name: str, constexprs: dict, num_warps: int) -> float:
    """A thread's share of one K step's weight values: rows x BLOCK_K / threads (gate|up: 2 halves; the
    plain down kernel: the token's top-k experts a step)."""
    if "gate_up" in name:
        rows = 2 * constexprs["BLOCK_N"]
    else:
        rows = constexprs["BLOCK_N"] * constexprs.get("TOP_K", 1) if "K_TILE" in constexprs else constexprs["BLOCK_N"]
    return rows * constexprs["BLOCK_K"] / (32 * num_warps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fused-moe", action="append", default=None, metavar="PATH",
                    help="a copy of kernels/fused_moe.py (repeatable: columns side by side); default the installed one")
    ap.add_argument("--sass", metavar="DIR", help="write each kernel's SASS to DIR")
    args = ap.parse_args()
    paths = args.fused_moe or [None]
    results = collections.OrderedDict()  # kernel name -> {version label: (steps' opcodes, weights a step)}
    labels = []
    for i, path in enumerate(paths):
        label = os.path.basename(path) if path else "installed"
        label = label if label not in labels else f"{label}#{i}"
        labels.append(label)
        for name, constexprs, warps, cubin in compile_decode(load_module(path, i)).kernels:
            if "finish" in name:
                continue
            sass, regs = disassemble(cubin)
            if args.sass:
                os.makedirs(args.sass, exist_ok=True)
                with open(os.path.join(args.sass, f"{label}.{name}.sass"), "w") as f:
                    f.write(sass)
            ops = k_loop(sass)
            if not ops or "BLOCK_K" not in constexprs:
                continue
            results.setdefault(name, {})[label] = (ops, weights_per_thread(name, constexprs, warps), constexprs,
                                                   warps, regs)
    classes = list(CLASSES) + ["other"]
    print(f"gpt-oss-120b decode GEMVs (H = I = 2880, E = 128, top-4, 1 token, default MXFP4 decode config), sm_90 "
          f"SASS from Triton {triton.__version__}, instructions per K-loop step (one thread)\n")
    print("| kernel | version | tile | registers | per step | per weight | " + " | ".join(classes) + " |")
    print("|---" * (6 + len(classes)) + "|")
    for name, by_version in results.items():
        for label in labels:
            if label not in by_version:
                continue
            ops, per_thread, cx, warps, regs = by_version[label]
            counts = collections.Counter(CLASS_OF.get(op, "other") for op in ops)
            tile = f"{cx['BLOCK_N']}x{cx['BLOCK_K']} w{warps}"
            print(f"| {name} | {label} | {tile} | {regs} | {len(ops)} | {len(ops) / per_thread:.1f} | "
                  + " | ".join(str(counts.get(c, 0)) for c in classes) + " |")
    other = collections.Counter(op for by in results.values() for ops, *_ in by.values() for op in ops
                                if op not in CLASS_OF)
    if other:
        print("\nother: " + ", ".join(f"{op} {n}" for op, n in other.most_common()))


if __name__ == "__main__":
    main()
