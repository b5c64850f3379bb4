"""BGMV's LoRA kernels alone, at Llama-3.1-8B's projections (`pdserve bench lora --kernels`):
one decode step's LoRA work (32 layers x qkv, o, gate_up, down: a shrink and an expand each)
captured in one CUDA graph and replayed, the split-K shrink (kernels/lora.py, what the engine
runs) against one program per token walking all of K (the shrink before the split), at batch
1, 8 and 64 with the batch spread round-robin over 0 (every token slot -1), 1 and 4 adapters.
Each layer has its own A and B stacks (8 slots, rank 16), so the step reads what a real one does.
"""

from __future__ import annotations

import torch

# (name, K, R = parts x rank 16, N) of one Llama-3.1-8B layer's fused LoRA linears.
PROJECTIONS = [("qkv", 4096, 48, 6144), ("o", 4096, 16, 4096), ("gate_up", 4096, 32, 28672),
               ("down", 14336, 16, 4096)]
LAYERS, SLOTS = 32, 8


def _stacks(device):
    g = torch.Generator(device=device).manual_seed(0)
    return [[(torch.randn(SLOTS, k, r, device=device, generator=g, dtype=torch.bfloat16) * 0.02,
              torch.randn(SLOTS, r, n, device=device, generator=g, dtype=torch.bfloat16) * 0.02)
             for _, k, r, n in PROJECTIONS] for _ in range(LAYERS)]


def step_ms(t: int, adapters: int, k_per_split: int | None, stacks, device, replays: int = 50) -> float:
    """ms of one replay of a graph holding a decode step's LoRA kernels; k_per_split None: the engine's."""
    from pdserve.kernels.lora import K_PER_SPLIT, lora_expand, lora_shrink_partials

    split = K_PER_SPLIT if k_per_split is None else k_per_split
    slots = torch.tensor([i % adapters if adapters else -1 for i in range(t)], device=device)
    xs = {k: torch.randn(t, k, device=device, dtype=torch.bfloat16) for _, k, _, _ in PROJECTIONS}
    ys = {n: torch.zeros(t, n, device=device, dtype=torch.bfloat16) for _, _, _, n in PROJECTIONS}

    def step():
        for layer in stacks:
            for (_, k, _, n), (a, b) in zip(PROJECTIONS, layer):
                lora_expand(ys[n], lora_shrink_partials(xs[k], a, slots, split), b, slots)

    step()  # compiles
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def run(batches=(1, 8, 64), spreads=(0, 1, 4)) -> list[str]:
    """The table's markdown lines (printed as it goes)."""
    device = torch.device("cuda")
    stacks = _stacks(device)
    lines = ["", f"## BGMV kernels alone: one decode step's LoRA ({LAYERS} layers x qkv/o/gate_up/down, "
             f"shrink + expand, {2 * len(PROJECTIONS) * LAYERS} launches in one CUDA graph), "
             f"{torch.cuda.get_device_name(device)}", "",
             "| batch | adapters in use | one program per token ms/step | split-K ms/step | speed-up |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for t in batches:
        for n in spreads:
            whole = step_ms(t, n, 1 << 20, stacks, device)
            split = step_ms(t, n, None, stacks, device)
            lines.append(f"| {t} | {n} | {whole:.3f} | {split:.3f} | {whole / split:.1f}x |")
            print(lines[-1], flush=True)
    return lines
