"""Attention over the paged KV cache: the cache itself (kv_cache.py, kv_scales.py), the backend
interface and the torch reference (backend.py), the Triton backend (triton_backend.py), and
the choice between them (selector.py)."""
