"""Measured tiles for kernels/fp8_gemv.py: {card name: {"N,K,blocked,rows": config}}
(fp8_gemv.config_key; rows: 1, 0 for 2-16, 64 for 17-64).

Written by `python -m pdserve.bench.fp8_gemv_tune` on the card itself (each shape's fastest of a
sweep, timed in CUDA graphs with the weights rotated past L2); a card or shape missing here takes
fp8_gemv.default_config (per-channel scales: within ~15% of the best at Llama-3.1-8B shapes on an
H200; group scales: a rule fitted to this table's tiles, not yet timed on its own).
Measured tiles are a table, not a run-time autotuner, so a worker picks the same tiles (and
computes the same bits) on every start.

NVIDIA H200: 2026-11-27, triton 3.6, Llama-3.1-8B linears at TP=1 and TP=2 shards, M = 1 and 8
(docs/fp8-gpu-results.md); 2026-12-03, DeepSeek-V3's block-FP8 linears outside the routed experts
(`--shapes deepseek-v3 --formats block`; docs/results/deepseek/2026-12-03-h200-fp8-gemv-tiles.md).
NVIDIA H100 80GB HBM3: 2026-12-06, M = 1 only, Llama-3.1-8B linears at TP=1, with the one-launch split
sum and the early weight load in the sweep (`bash tools/gpu/fp8.sh tiles`;
docs/results/fp8/2026-12-06-h100-tiles-early-w.md): bs=1 per-channel 1.38x -> 1.64x bf16 over the rule;
the block-128 entries swept again with K steps of several scale groups (`FORMATS=block COMMITTED=1 bash
tools/gpu/fp8.sh tiles`; docs/results/fp8/2026-12-06-h100-wide-group-steps.md): block-128 bs=1 1.51x ->
1.62x bf16 against the entries before, same call. The 64-row entries (M = 64, `bash tools/gpu/fp8.sh batch`,
docs/results/fp8/2026-12-06-h100-gemv-64-rows.md): kept where the GEMV took <= 0.9x the W8A8 GEMM's time,
then dropped on 2026-12-07: with K split, the Triton block GEMM took 18.4 / 15.4 / 34.8 us at 64 rows for
qkv / o / down against those tiles' 22.0 / 16.8 / 45.4 (docs/results/fp8/2026-12-07-h100-w8a8-k-split.md);
no 17-64-row entry is held now, so every layer takes the W8A8 GEMM from 17 rows.
"""

CONFIGS: dict[str, dict[str, dict]] = {
    "NVIDIA H100 80GB HBM3": {
        "4096,4096,0,1": dict(BLOCK_K=1024, BLOCK_N=2, SPLIT_K=1, num_stages=3, num_warps=4, EARLY_W=True),
        "4096,4096,1,1": dict(BLOCK_K=512, BLOCK_N=32, SPLIT_K=4, num_stages=3, num_warps=4, EARLY_W=True),
        "4096,14336,0,1": dict(BLOCK_K=1024, BLOCK_N=8, SPLIT_K=2, num_stages=3, num_warps=4,
                               EARLY_W=True, REDUCE_IN_KERNEL=True),
        "4096,14336,1,1": dict(BLOCK_K=512, BLOCK_N=16, SPLIT_K=4, num_stages=3, num_warps=4,
                               EARLY_W=True, REDUCE_IN_KERNEL=True),
        "6144,4096,0,1": dict(BLOCK_K=1024, BLOCK_N=8, SPLIT_K=1, num_stages=3, num_warps=4, EARLY_W=True),
        "6144,4096,1,1": dict(BLOCK_K=512, BLOCK_N=64, SPLIT_K=4, num_stages=3, num_warps=4,
                              EARLY_W=True, REDUCE_IN_KERNEL=True),
        "28672,4096,0,1": dict(BLOCK_K=1024, BLOCK_N=4, SPLIT_K=1, num_stages=3, num_warps=2, EARLY_W=True),
        "28672,4096,1,1": dict(BLOCK_K=1024, BLOCK_N=8, SPLIT_K=1, num_stages=6, num_warps=4, EARLY_W=True),
    },
    "NVIDIA H200": {
        "576,7168,1,0": dict(BLOCK_K=128, BLOCK_N=32, SPLIT_K=16, num_stages=3, num_warps=4),
        "576,7168,1,1": dict(BLOCK_K=128, BLOCK_N=16, SPLIT_K=16, num_stages=3, num_warps=4),
        "1536,7168,1,0": dict(BLOCK_K=128, BLOCK_N=32, SPLIT_K=8, num_stages=3, num_warps=4),
        "1536,7168,1,1": dict(BLOCK_K=128, BLOCK_N=32, SPLIT_K=16, num_stages=3, num_warps=4),
        "7168,2048,1,0": dict(BLOCK_K=128, BLOCK_N=32, SPLIT_K=4, num_stages=3, num_warps=4),
        "7168,2048,1,1": dict(BLOCK_K=128, BLOCK_N=32, SPLIT_K=4, num_stages=3, num_warps=4),
        "7168,16384,1,0": dict(BLOCK_K=128, BLOCK_N=64, SPLIT_K=16, num_stages=3, num_warps=4),
        "7168,16384,1,1": dict(BLOCK_K=128, BLOCK_N=64, SPLIT_K=8, num_stages=3, num_warps=4),
        "7168,18432,1,0": dict(BLOCK_K=128, BLOCK_N=64, SPLIT_K=16, num_stages=3, num_warps=4),
        "7168,18432,1,1": dict(BLOCK_K=128, BLOCK_N=64, SPLIT_K=8, num_stages=3, num_warps=4),
        "24576,1536,1,0": dict(BLOCK_K=128, BLOCK_N=64, SPLIT_K=1, num_stages=3, num_warps=4),
        "24576,1536,1,1": dict(BLOCK_K=128, BLOCK_N=32, SPLIT_K=2, num_stages=3, num_warps=4),
        "36864,7168,1,0": dict(BLOCK_K=128, BLOCK_N=64, SPLIT_K=4, num_stages=3, num_warps=4),
        "36864,7168,1,1": dict(BLOCK_K=128, BLOCK_N=64, SPLIT_K=2, num_stages=3, num_warps=4),
        "3072,4096,0,0": dict(BLOCK_K=128, BLOCK_N=32, SPLIT_K=4, num_stages=3, num_warps=4),
        "3072,4096,0,1": dict(BLOCK_K=512, BLOCK_N=16, SPLIT_K=4, num_stages=3, num_warps=4),
        "3072,4096,1,0": dict(BLOCK_K=128, BLOCK_N=32, SPLIT_K=4, num_stages=3, num_warps=4),
        "3072,4096,1,1": dict(BLOCK_K=128, BLOCK_N=32, SPLIT_K=8, num_stages=3, num_warps=4),
        "4096,2048,0,0": dict(BLOCK_K=256, BLOCK_N=32, SPLIT_K=2, num_stages=3, num_warps=4),
        "4096,2048,0,1": dict(BLOCK_K=256, BLOCK_N=16, SPLIT_K=4, num_stages=3, num_warps=4),
        "4096,2048,1,0": dict(BLOCK_K=128, BLOCK_N=32, SPLIT_K=4, num_stages=3, num_warps=4),
        "4096,2048,1,1": dict(BLOCK_K=128, BLOCK_N=16, SPLIT_K=4, num_stages=3, num_warps=4),
        "4096,4096,0,0": dict(BLOCK_K=128, BLOCK_N=32, SPLIT_K=4, num_stages=3, num_warps=4),
        "4096,4096,0,1": dict(BLOCK_K=512, BLOCK_N=16, SPLIT_K=4, num_stages=3, num_warps=4),
        "4096,4096,1,0": dict(BLOCK_K=128, BLOCK_N=32, SPLIT_K=4, num_stages=3, num_warps=4),
        "4096,4096,1,1": dict(BLOCK_K=128, BLOCK_N=32, SPLIT_K=8, num_stages=3, num_warps=4),
        "4096,7168,0,0": dict(BLOCK_K=256, BLOCK_N=32, SPLIT_K=4, num_stages=3, num_warps=4),
        "4096,7168,0,1": dict(BLOCK_K=512, BLOCK_N=16, SPLIT_K=4, num_stages=3, num_warps=4),
        "4096,7168,1,0": dict(BLOCK_K=128, BLOCK_N=32, SPLIT_K=4, num_stages=3, num_warps=4),
        "4096,7168,1,1": dict(BLOCK_K=128, BLOCK_N=32, SPLIT_K=8, num_stages=3, num_warps=4),
        "4096,14336,0,0": dict(BLOCK_K=256, BLOCK_N=32, SPLIT_K=4, num_stages=3, num_warps=4),
        "4096,14336,0,1": dict(BLOCK_K=512, BLOCK_N=16, SPLIT_K=4, num_stages=3, num_warps=4),
        "4096,14336,1,0": dict(BLOCK_K=128, BLOCK_N=64, SPLIT_K=8, num_stages=3, num_warps=4),
        "4096,14336,1,1": dict(BLOCK_K=128, BLOCK_N=32, SPLIT_K=8, num_stages=3, num_warps=4),
        "6144,4096,0,0": dict(BLOCK_K=256, BLOCK_N=32, SPLIT_K=4, num_stages=3, num_warps=4),
        "6144,4096,0,1": dict(BLOCK_K=256, BLOCK_N=16, SPLIT_K=4, num_stages=3, num_warps=4),
        "6144,4096,1,0": dict(BLOCK_K=128, BLOCK_N=64, SPLIT_K=4, num_stages=3, num_warps=4),
        "6144,4096,1,1": dict(BLOCK_K=128, BLOCK_N=32, SPLIT_K=8, num_stages=3, num_warps=4),
        "14336,4096,0,0": dict(BLOCK_K=128, BLOCK_N=32, SPLIT_K=4, num_stages=3, num_warps=4),
        "14336,4096,0,1": dict(BLOCK_K=512, BLOCK_N=16, SPLIT_K=1, num_stages=3, num_warps=4),
        "14336,4096,1,0": dict(BLOCK_K=128, BLOCK_N=64, SPLIT_K=4, num_stages=3, num_warps=4),
        "14336,4096,1,1": dict(BLOCK_K=128, BLOCK_N=64, SPLIT_K=4, num_stages=3, num_warps=4),
        "28672,4096,0,0": dict(BLOCK_K=256, BLOCK_N=32, SPLIT_K=1, num_stages=3, num_warps=4),
        "28672,4096,0,1": dict(BLOCK_K=256, BLOCK_N=32, SPLIT_K=1, num_stages=3, num_warps=4),
        "28672,4096,1,0": dict(BLOCK_K=128, BLOCK_N=64, SPLIT_K=4, num_stages=3, num_warps=4),
        "28672,4096,1,1": dict(BLOCK_K=128, BLOCK_N=64, SPLIT_K=2, num_stages=3, num_warps=4),
    },
}
