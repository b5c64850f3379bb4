"""pdserve.kernels: Triton kernels, each beside a plain-torch reference of the same function.

KV cache layout shared by every kernel (see worker/attention/kv_cache.py for why): per layer,
`k_cache` and `v_cache` are views of shape [num_blocks, block_size, num_kv_heads, head_dim]
whose block stride may be larger than block_size * num_kv_heads * head_dim (all layers of a
block live together so a block moves with one descriptor). Kernels must honour strides.
"""

import sys as _sys

if __name__ == "kernels":
    # Imported as a top-level `kernels`: the checkout's root is on sys.path (`python -m` run from
    # it, pytest), where this folder shadows the installed distribution of that name, Hugging
    # Face's kernel hub, which transformers (>= 5.25) imports. Hand the import over to that one
    # (the import system returns what sys.modules holds once this body has run); pdserve's own
    # code imports this folder as `pdserve.kernels`, never as `kernels`.
    def _installed_kernels() -> None:
        import importlib.machinery
        import importlib.util
        import os

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = [p for p in _sys.path if os.path.abspath(p or os.curdir) != root]
        spec = importlib.machinery.PathFinder.find_spec("kernels", path)
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            _sys.modules["kernels"] = module
            spec.loader.exec_module(module)

    _installed_kernels()
