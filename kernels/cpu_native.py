"""The CPU engine's native kernels, built on first use, called through ctypes: decode attention
(cpu_decode_attention.c), the element-wise stages (cpu_pointwise.c, used by cpu_pointwise.py) and
the linears of a decode batch (cpu_small_gemm.c, used by cpu_small_gemm.py).

Decode attention over a bf16 cache is what a CPU step spends most on at batch 8-32 when it runs
as torch ops: each layer gathers every sequence's K/V blocks, widens them to fp32 and runs two
small batched matmuls (a KV head's few query heads are the rows), all memory-bound. The C kernel
reads each token's K and V once, straight from its cache block, in fp32 math (the reference's).

It is plain C without torch headers, so a C compiler (`cc`, or $CC) builds it in about a second;
the shared object is kept in the cache directory (~/.cache/pdserve/kernels, or $PDSERVE_CACHE),
named by the source, the flags and this CPU's feature flags (-march=native), so a later start only
loads it. Without a compiler, or when the build fails, `library()` is None (logged once) and the
torch ops path runs. `PDSERVE_CPU_NATIVE_ATTENTION=0` turns the attention off,
`PDSERVE_CPU_NATIVE_POINTWISE=0` the element-wise stages, `PDSERVE_CPU_SMALL_GEMM=0` the small-batch
GEMM (A/B runs).

ctypes releases the GIL during the call: a batch split over threads runs in parallel.

Batch invariance (on unless PDSERVE_CPU_BATCH_INVARIANT=0, `batch_invariant()`): a token's
numbers do not depend on the step it is computed in. In a step the engine marks invariant
(`set_step_invariant`, worker/executor/cpu_threads.py: a bf16 model whose every product the
native kernels compute), every bf16 linear on an attached weight runs the native GEMM whatever its
row count (oneDNN's kernels round by row count), and a prompt's attention runs the decode kernel
once per query token over the cache (SDPA's blocking moves with the chunk's length and offset).
A prompt whose prefix was cached, a prompt split in other chunks, a token in a mixed or larger
batch, and a decode worker that pulled its KV then all give the bits of a fresh prefill on one
worker: the greedy and seeded answers are the same on every path (docs/engine.md).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV = "PDSERVE_CPU_NATIVE_ATTENTION"
SOURCE = Path(__file__).with_name("cpu_decode_attention.c")
POINTWISE_ENV = "PDSERVE_CPU_NATIVE_POINTWISE"
POINTWISE_SOURCE = Path(__file__).with_name("cpu_pointwise.c")
FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-std=c11"]
BATCH_INVARIANT_ENV = "PDSERVE_CPU_BATCH_INVARIANT"
_batch_invariant = os.environ.get(BATCH_INVARIANT_ENV, "1").strip() not in ("0", "false", "off")
# Per step, set by the engine's step thread (worker/executor/cpu_threads.py): whether the step is
# batch-invariant, and how many threads native calls split over (None: torch's intra-op count).
_step_invariant = False
_threads: int | None = None


def threads() -> int:
    """Threads a native call splits over: the step's (set_threads), else torch's intra-op count."""
    return _threads or torch.get_num_threads()


def set_threads(n: int | None) -> None:
    """The native calls' thread count from now on (the engine's step thread sets it per step:
    worker/executor/cpu_threads.py); None: torch's."""
    global _threads
    _threads = n


def batch_invariant() -> bool:
    """Engines built from now on run batch-invariant where their model allows (the module docstring)."""
    return _batch_invariant


def set_batch_invariant(on: bool) -> None:
    """For this whole process (A/B runs and tests); PDSERVE_CPU_BATCH_INVARIANT sets the start value."""
    global _batch_invariant
    _batch_invariant = bool(on)


def step_invariant() -> bool:
    """The step being computed runs every row on the native kernels (set by the engine per step)."""
    return _step_invariant


def set_step_invariant(on: bool) -> None:
    global _step_invariant
    _step_invariant = bool(on)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _cache_root() -> Path:
    root = os.environ.get("PDSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdserve")
    return Path(root) / "kernels"


def _build(compiler: str, source: Path, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed: concurrent starts never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, "-o", tmp, str(source)], check=True, capture_output=True, text=True,
                       timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(source: Path, symbol: str, env: str, what: str) -> ctypes.CDLL | None:
    """`source` built (once per machine: cached by source, flags and CPU) and loaded; None where
    `env` is 0, there is no compiler, or the build or load fails (logged once per source)."""
    if os.environ.get(env, "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler (cc): the CPU %s runs as torch ops", what)
        return None
    key = hashlib.sha256(source.read_bytes() + " ".join(FLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    path = _cache_root() / f"{source.stem}-{key}.so"
    try:
        if not path.is_file():
            _build(compiler, source, path)
            log.info("built the CPU %s kernel: %s", what, path)
        lib = ctypes.CDLL(str(path))
        getattr(lib, symbol)
    except (OSError, AttributeError, subprocess.SubprocessError) as e:  # AttributeError: a .so without the symbol
        detail = getattr(e, "stderr", "") or e
        log.warning("CPU %s kernel not loaded (%s): torch ops run instead", what, str(detail).strip()[:500])
        return None
    return lib


_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def library() -> ctypes.CDLL | None:
    """The decode attention kernel, built first if this machine has none cached; None where it cannot be."""
    lib = load(SOURCE, "paged_decode_bf16", ENV, "decode attention")
    if lib is not None:
        lib.paged_decode_bf16.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64,
                                          _i64, _i64, _i64, ctypes.c_float, _ptr, _ptr]
        lib.paged_decode_bf16.restype = None
        lib.kv_write_bf16.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64,
                                      _i64, _i64, _i64]
        lib.kv_write_bf16.restype = None
    return lib


@functools.cache
def pointwise() -> ctypes.CDLL | None:
    """The element-wise stages (cpu_pointwise.c: RMSNorm, rotary, SiLU-and-mul on bf16 rows);
    None where they cannot be built (PDSERVE_CPU_NATIVE_POINTWISE=0: off)."""
    lib = load(POINTWISE_SOURCE, "rms_norm_bf16", POINTWISE_ENV, "element-wise")
    if lib is not None:
        lib.rms_norm_bf16.argtypes = [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, ctypes.c_float, _ptr, _i64, _ptr,
                                      _i64, _ptr]
        lib.rotary_bf16.argtypes = [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64]
        lib.silu_and_mul_bf16.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _i64]
        for fn in (lib.rms_norm_bf16, lib.rotary_bf16, lib.silu_and_mul_bf16):
            fn.restype = None
    return lib


_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()
_scratch = threading.local()


def run_split(total: int, parts: int, run) -> None:
    """run(lo, hi) over [0, total): in this thread for parts <= 1, else one share per part on a
    pool that grows to the most parts asked for (the native calls release the GIL)."""
    global _pool, _pool_size
    if parts <= 1:
        run(0, total)
        return
    with _pool_lock:
        if _pool_size < parts:  # more threads than before: a bigger pool replaces the old one
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool, _pool_size = ThreadPoolExecutor(parts, thread_name_prefix="cpu-native"), parts
        pool = _pool
    step = -(-total // parts)
    # The calling thread takes the first share itself: one hand-off fewer, one thread fewer awake.
    futures = [pool.submit(run, lo, min(total, lo + step)) for lo in range(step, total, step)]
    run(0, min(total, step))
    for f in futures:
        f.result()


def run_balanced(work: torch.Tensor, parts: int, run) -> None:
    """run(lo, hi) over [0, len(work)) in up to `parts` contiguous shares of about equal total
    `work` (an integer per item: a prompt's later queries read more keys), on run_split's pool."""
    total = len(work)
    if parts <= 1 or total <= 1:
        run(0, total)
        return
    cum = torch.cumsum(work, 0, dtype=torch.int64)
    targets = cum[-1] * torch.arange(1, parts, dtype=torch.int64) // parts
    cuts = [0, *sorted(set(torch.searchsorted(cum, targets, right=True).tolist())), total]
    ranges = [(lo, hi) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]
    run_split(len(ranges), len(ranges), lambda a, b: [run(*ranges[i]) for i in range(a, b)])


def scratch_floats(n: int) -> torch.Tensor:
    """At least n fp32 values of this thread's own scratch (kept and grown across calls)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _scratch.buf = torch.empty(n, dtype=torch.float32)
    return buf
