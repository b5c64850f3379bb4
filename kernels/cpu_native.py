"""The CPU engine's native decode attention (cpu_decode_attention.c): built on first use, called through ctypes.

Decode attention over a bf16 cache is what a CPU step spends most on at batch 8-32 when it runs
as torch ops: each layer gathers every sequence's K/V blocks, widens them to fp32 and runs two
small batched matmuls (a KV head's few query heads are the rows), all memory-bound. The C kernel
reads each token's K and V once, straight from its cache block, in fp32 math (the reference's).

It is plain C without torch headers, so a C compiler (`cc`, or $CC) builds it in about a second;
the shared object is kept in the cache directory (~/.cache/pdserve/kernels, or $PDSERVE_CACHE),
named by the source, the flags and this CPU's feature flags (-march=native), so a later start only
loads it. Without a compiler, or when the build fails, `library()` is None (logged once) and the
torch ops path runs. `PDSERVE_CPU_NATIVE_ATTENTION=0` turns it off (A/B runs).

ctypes releases the GIL during the call: a batch split over threads runs in parallel.
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
from pathlib import Path

log = logging.getLogger(__name__)

ENV = "PDSERVE_CPU_NATIVE_ATTENTION"
SOURCE = Path(__file__).with_name("cpu_decode_attention.c")
FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-std=c11"]


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


def _build(compiler: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed: concurrent starts never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, "-o", tmp, str(SOURCE)], check=True, capture_output=True, text=True,
                       timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel, built first if this machine has none cached; None where it cannot be."""
    if os.environ.get(ENV, "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.info("no C compiler (cc): CPU decode attention runs as torch ops")
        return None
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    path = _cache_root() / f"cpu_decode_attention-{key}.so"
    try:
        if not path.is_file():
            _build(compiler, path)
            log.info("built the CPU decode attention kernel: %s", path)
        lib = ctypes.CDLL(str(path))
        fn = lib.paged_decode_bf16
    except (OSError, AttributeError, subprocess.SubprocessError) as e:  # AttributeError: a .so without the symbol
        detail = getattr(e, "stderr", "") or e
        log.warning("CPU decode attention kernel not loaded (%s): torch ops run instead", str(detail).strip()[:500])
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, ctypes.c_float,
                   ptr, ptr]
    fn.restype = None
    return lib
