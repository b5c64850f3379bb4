"""Programmatic dependent launch (kernels/pdl.py): every kernel that can be launched with it waits
first, and a decode-like chain captured in a CUDA graph gives the same bits with it on and off.

A kernel launched with PDL that read or wrote anything before `gdc_wait` could see its
predecessor's stale output (a weight, which no kernel of a step writes, is the one exception: the
GEMVs' EARLY_W loads its first tile before the wait); one that never waited would break the
chain's transitivity (the next kernel's wait would cover it, not the kernel before it). The first
test checks the source of every launch: on CPU the interpreter never takes PDL, so the rule is
checked structurally here and by value on a GPU (sm_90+) below.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from tests.kernels.kernel_inputs import ON_GPU

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "kernels"


def _jit_functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    def is_jit(d: ast.expr) -> bool:
        f = d.func if isinstance(d, ast.Call) else d
        return isinstance(f, ast.Attribute) and f.attr == "jit"

    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and any(map(is_jit, n.decorator_list))}


def _launches(tree: ast.Module, jit: dict) -> list[tuple[str, ast.Call]]:
    return [(n.func.value.id, n) for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)
            and isinstance(n.func.value, ast.Name) and n.func.value.id in jit]


def _is_pdl_enter(st: ast.stmt) -> bool:
    return (isinstance(st, ast.Expr) and isinstance(st.value, ast.Call)
            and getattr(st.value.func, "id", "") == "pdl_enter"
            and [getattr(a, "id", None) for a in st.value.args] == ["PDL"])


MEMORY_OPS = ("load", "store", "atomic_add", "atomic_xchg", "atomic_cas", "atomic_max", "atomic_min")
WEIGHT_POINTERS = {"w_ptr", "w_rows"}  # what an early weight load may read: never written during a step


def _check_before_wait(st: ast.stmt, jit: dict, where: str) -> None:
    """What precedes pdl_enter touches no memory (index arithmetic only), except a weight load
    under `if EARLY_W:` (kernels/pdl.py: no kernel of a step writes a weight, so that read
    cannot be stale), and calls no other jit function (it could load)."""
    for node in ast.walk(st):
        if not isinstance(node, ast.Call):
            continue
        assert getattr(node.func, "id", None) not in jit, f"{where}: calls {node.func.id} before pdl_enter(PDL)"
        op = node.func.attr if isinstance(node.func, ast.Attribute) else None
        if op not in MEMORY_OPS:
            continue
        early = (isinstance(st, ast.If) and getattr(st.test, "id", None) == "EARLY_W" and op == "load"
                 and WEIGHT_POINTERS & {n.id for n in ast.walk(node.args[0]) if isinstance(n, ast.Name)}
                 and not {n.id for n in ast.walk(node.args[0]) if isinstance(n, ast.Name)
                          and n.id.endswith(("_ptr", "_rows"))} - WEIGHT_POINTERS)
        assert early, f"{where}: tl.{op} before pdl_enter(PDL) (only a weight load under `if EARLY_W:` may)"


def test_every_launched_kernel_enters_through_pdl_enter():
    launched = 0
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        jit = _jit_functions(tree)
        for name, call in _launches(tree, jit):
            launched += 1
            where = f"{path.name}: {name}"
            spread = [k.value for k in call.keywords if k.arg is None]
            assert any(isinstance(v, ast.Call) and getattr(v.func, "id", "") == "pdl_args" for v in spread), \
                f"{where} is launched without **pdl_args(device)"
            fn = jit[name]
            params = [a.arg for a in fn.args.args]
            assert "PDL" in params, f"{where} takes no PDL constexpr"
            enter = next((i for i, st in enumerate(fn.body) if _is_pdl_enter(st)), None)
            assert enter is not None, f"{where}: pdl_enter(PDL) is not a statement of its body"
            for st in fn.body[:enter]:
                _check_before_wait(st, jit, where)
    assert launched >= 30  # the decode step's kernels and the rest: a rename must not empty this test


def test_off_where_the_card_or_the_interpreter_lacks_it():
    from pdserve.kernels import pdl

    assert pdl.pdl_args(torch.device("cpu")) == {}
    before = pdl.programmatic_launch_enabled()
    try:
        pdl.set_programmatic_launch(False)
        assert pdl.pdl_args(torch.device("cpu")) == {}
        if ON_GPU:
            assert pdl.pdl_args(torch.device("cuda")) == {}
    finally:
        pdl.set_programmatic_launch(before)


def _chain(x, residual, w_qkv, w_o, w_gu, w_down, norm_w):
    """One dense layer at bs=1 the way the engine's GEMV path runs it: kernels reading the one
    before's output, a cuBLAS GEMM in the middle (a plainly launched kernel inside the chain)."""
    from pdserve.kernels.fused_gemv import GemvConfig, fused_gemv
    from pdserve.kernels.rms_norm import rms_norm
    from pdserve.kernels.silu_and_mul import silu_and_mul

    narrow = GemvConfig(2, 1024, 1)
    outs = []
    for _ in range(3):
        qkv, residual = fused_gemv(x, w_qkv, "rms_norm", norm_weight=norm_w, residual=residual, config=narrow)
        o, _ = fused_gemv(qkv[:, :w_o.shape[1]].contiguous(), w_o, config=GemvConfig(32, 256, 4))
        h, residual = rms_norm(o, norm_w, 1e-6, residual)
        gu = torch.nn.functional.linear(h, w_gu)
        # K slices summed by each strip's last program: counters that must read zero on every replay.
        x, _ = fused_gemv(silu_and_mul(gu), w_down, config=GemvConfig(2, 1024, 2, reduce_in_kernel=True))
        outs += [qkv, o, h, x, residual]
    return torch.cat([t.float().flatten() for t in outs])


@pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_capability()[0] < 9,
                    reason="PDL needs a CUDA card of compute capability 9.0 or up")
def test_a_graph_of_pdl_launches_equals_plain_launches():
    from pdserve.kernels import pdl

    g = torch.Generator(device="cuda").manual_seed(0)
    h, inter = 1024, 2816

    def rand(*shape):
        return (torch.randn(*shape, device="cuda", generator=g) / shape[-1] ** 0.5).to(torch.bfloat16)

    args = (rand(1, h), rand(1, h), rand(3 * h, h), rand(h, h), rand(2 * inter, h), rand(h, inter),
            1 + rand(h))
    results = {}
    before = pdl.programmatic_launch_enabled()
    try:
        for on in (False, True):
            pdl.set_programmatic_launch(on)
            eager = _chain(*args)  # also compiles every kernel outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = _chain(*args)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            results[on] = (eager, static_out.clone())
    finally:
        pdl.set_programmatic_launch(before)
    assert torch.equal(results[False][0], results[False][1])
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][0])
