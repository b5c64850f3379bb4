"""pdserve.kernels: Triton kernels, each beside a plain-torch reference of the same function.

KV cache layout shared by every kernel (see worker/attention/kv_cache.py for why): per layer,
`k_cache` and `v_cache` are views of shape [num_blocks, block_size, num_kv_heads, head_dim]
whose block stride may be larger than block_size * num_kv_heads * head_dim (all layers of a
block live together so a block moves with one descriptor). Kernels must honour strides.
"""
