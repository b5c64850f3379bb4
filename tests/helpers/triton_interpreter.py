"""Triton's CPU interpreter without its re-patch on every helper call (CI runs the kernels in it).

Triton (3.x) patches triton.language for the interpreter when a kernel launches, and again each
time the kernel calls a @triton.jit helper, per program of the grid: each time a full
`inspect.getmembers` scan of tl, tl.tensor and tl.math that, inside a launch, finds the builtins
already patched and changes nothing. It was a third of a test's time (the gpt-oss MXFP4 test: 88
of 255 s under cProfile). A helper whose language modules the launch in progress has patched
skips the scan; anything else takes Triton's own path. Same patches, same answers.
"""

from __future__ import annotations

import inspect


def skip_repatching() -> None:
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch is None or executor is None or getattr(patch, "pdserve_skips_repatching", False):
        return
    launch = executor.__call__
    # Per launch in progress, the language modules its own patch covered (None until it patched:
    # the launch's first call here is its own). A launch restores its patch before it returns.
    active: list[set[int] | None] = []

    def langs(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core)}

    def patch_lang(fn):
        if active and active[-1] is None:
            active[-1] = langs(fn)
            return patch(fn)
        if active and langs(fn) <= active[-1]:
            return interpreter._LangPatchScope()
        return patch(fn)

    def launch_patching_once(self, *args, **kwargs):
        active.append(None)
        try:
            return launch(self, *args, **kwargs)
        finally:
            active.pop()

    patch_lang.pdserve_skips_repatching = True
    interpreter._patch_lang = patch_lang
    executor.__call__ = launch_patching_once
