"""Triton's CPU interpreter without its re-patch on every helper call and with its dtype table kept
(CI runs the kernels in it).

Triton (3.x) patches triton.language for the interpreter when a kernel launches, and again each
time the kernel calls a @triton.jit helper, per program of the grid: each time a full
`inspect.getmembers` scan of tl, tl.tensor and tl.math that, inside a launch, finds the builtins
already patched and changes nothing. It was a third of a test's time (the gpt-oss MXFP4 test: 88
of 255 s under cProfile). A helper whose language modules the launch in progress has patched
skips the scan; anything else takes Triton's own path. Same patches, same answers.

`_get_np_dtype` (the numpy dtype of a Triton type, asked on every cast, splat and load) built
its 19-entry table on each call; its answers are kept per type.
"""

from __future__ import annotations


def patch_interpreter() -> None:
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if (patch is None or executor is None or not hasattr(interpreter, "_get_np_dtype")
            or getattr(patch, "pdserve_skips_repatching", False)):
        return
    launch = executor.__call__
    # Per launch in progress, the language modules patched so far (None until the launch's own
    # patch, its first call here). Nothing restores a patch until the launch returns: a helper's
    # is never restored, the launch's own when it ends. triton.language.standard's helpers (tl.sum,
    # tl.zeros) see tl.core, the kernels tl: each is patched once per launch.
    active: list[set[int] | None] = []
    seen: dict = {}

    def langs(fn) -> frozenset[int]:
        if fn not in seen:
            seen[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        return seen[fn]

    def patch_lang(fn):
        if active and active[-1] is None:
            active[-1] = set(langs(fn))
            return patch(fn)
        if active and langs(fn) <= active[-1]:
            return interpreter._LangPatchScope()
        if active:
            active[-1] |= langs(fn)
        return patch(fn)

    def launch_patching_once(self, *args, **kwargs):
        active.append(None)
        try:
            return launch(self, *args, **kwargs)
        finally:
            active.pop()

    np_dtype, np_dtypes = interpreter._get_np_dtype, {}

    def get_np_dtype(tt_dtype):
        # A block's is its element type's; pointers' Triton's own answers at once (neither hashes).
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(key, tl.pointer_type):
            return np_dtype(key)
        if key not in np_dtypes:
            np_dtypes[key] = np_dtype(key)
        return np_dtypes[key]

    interpreter._get_np_dtype = get_np_dtype
    patch_lang.pdserve_skips_repatching = True
    interpreter._patch_lang = patch_lang
    executor.__call__ = launch_patching_once
