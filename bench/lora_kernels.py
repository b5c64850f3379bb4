"""BGMV's LoRA kernels alone, at Llama-3.1-8B's projections (`pdserve bench lora --kernels`):
one decode step's LoRA work (32 layers, rank 16 on q/k/v/o/gate/up/down) captured in one CUDA
graph and replayed, at batch 1, 8 and 64 with the batch spread round-robin over 1 and 4 adapters
(8 slots; each layer its own A and B stacks, so the step reads what a real one does). Tables:

1. launches: the same step as 7 shrink + expand pairs a layer (one per projection: 448
   launches), as 4 pairs (q | k | v and gate | up packed) whose expand reads block-diagonal B
   ([S, parts * R, N], zeros included), and as 4 pairs whose expand reads each column's own R
   rows of B ([S, R, N] and the parts' ends: what the engine runs);
2. the shrink's K_PER_SPLIT (kernels/lora.py): the engine's layout at 128 .. 1024 columns a
   program and at all of K (one program per token), to pick the default;
3. with the base GEMMs (random bf16 weights of the 8B's shapes, cuBLAS): the base alone, the
   base + LoRA in one stream, and the base + LoRA with each shrink forked onto a second stream
   beside its base GEMM (the engine's default; a shrink needs only x, the expand joins after the
   GEMM): how much of the LoRA time the base GEMMs hide.
"""

from __future__ import annotations

import torch

# (name, K, N, parts' widths) of one Llama-3.1-8B layer's packed LoRA linears (rank 16 a part).
PACKED = [("qkv", 4096, 6144, (4096, 1024, 1024)), ("o", 4096, 4096, (4096,)),
          ("gate_up", 4096, 28672, (14336, 14336)), ("down", 14336, 4096, (4096,))]
RANK, LAYERS, SLOTS = 16, 32, 8
SPLITS = (128, 256, 512, 1024)
BATCHES, SPREADS = (1, 8, 64), (1, 4)


def _linears(layout: str) -> list[tuple[int, int, int, tuple | None]]:
    """(K, N, product width, parts' ends or None) of each LoRA linear of a layer."""
    if layout == "unfused":
        return [(k, w, RANK, None) for _, k, _, widths in PACKED for w in widths]
    out = []
    for _, k, n, widths in PACKED:
        ends = tuple(int(e) for e in torch.tensor(widths).cumsum(0)) if len(widths) > 1 else None
        out.append((k, n, len(widths) * RANK, ends if layout == "by-part" else None))
    return out


def _stacks(layout: str, device) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each layer's (A [S, K, W], B) per linear: B [S, R, N] by part, [S, W, N] block-diagonal."""
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=device, generator=g, dtype=torch.bfloat16) * 0.02

    return [[(rand(SLOTS, k, w), rand(SLOTS, RANK if ends else w, n)) for k, n, w, ends in _linears(layout)]
            for _ in range(LAYERS)]


def _base_weights(device) -> list[list[torch.Tensor]]:
    # Uninitialized: a GEMM's time does not depend on the values, and 14 GB of randn would not be free.
    return [[torch.empty(n, k, device=device, dtype=torch.bfloat16) for _, k, n, _ in PACKED]
            for _ in range(LAYERS)]


def _time_graph(step, device, replays: int = 50) -> float:
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
    del graph
    return start.elapsed_time(end) / replays


def step_ms(t: int, adapters: int, layout: str, stacks, device, k_per_split: int | None = None,
            base=None, overlap: bool = False) -> float:
    """ms of one replay of a graph holding a decode step's LoRA kernels (and its base GEMMs when
    `base`, with the shrinks on a second stream when `overlap`; adapters 0 with base: the base alone)."""
    from pdserve.kernels.lora import K_PER_SPLIT, lora_expand, lora_shrink_partials

    split = K_PER_SPLIT if k_per_split is None else k_per_split
    slots = torch.tensor([i % adapters if adapters else -1 for i in range(t)], device=device)
    linears = _linears(layout)
    xs = {k: torch.randn(t, k, device=device, dtype=torch.bfloat16) for k, _, _, _ in linears}
    ys = {n: torch.zeros(t, n, device=device, dtype=torch.bfloat16) for _, n, _, _ in linears}
    side = torch.cuda.Stream(device) if overlap else None

    def step():
        main = torch.cuda.current_stream(device) if overlap else None
        for li, layer in enumerate(stacks):
            for j, ((k, n, _, ends), (a, b)) in enumerate(zip(linears, layer)):
                x, y = xs[k], ys[n]
                if base is None:
                    lora_expand(y, lora_shrink_partials(x, a, slots, split), b, slots, ends)
                    continue
                if overlap:
                    side.wait_stream(main)
                    with torch.cuda.stream(side):
                        u = lora_shrink_partials(x, a, slots, split)
                    torch.mm(x, base[li][j].t(), out=y)
                    main.wait_stream(side)
                    lora_expand(y, u, b, slots, ends)
                else:
                    torch.mm(x, base[li][j].t(), out=y)
                    if adapters:
                        lora_expand(y, lora_shrink_partials(x, a, slots, split), b, slots, ends)

    return _time_graph(step, device)


def run(batches=BATCHES, spreads=SPREADS, splits=SPLITS, with_base: bool = True) -> list[str]:
    """The tables' markdown lines (printed as they go)."""
    from pdserve.kernels.lora import K_PER_SPLIT

    device = torch.device("cuda")
    card = torch.cuda.get_device_name(device)
    layouts = ("unfused", "block-diagonal", "by-part")
    stacks = {lay: _stacks(lay, device) for lay in layouts}
    lines = ["", f"## BGMV kernels alone, {card}: one decode step's LoRA ({LAYERS} layers, rank {RANK} on "
             f"q/k/v/o/gate/up/down, {SLOTS} slots) in one CUDA graph, ms per replay", "",
             f"### Launches a step (shrink split at the engine's K_PER_SPLIT = {K_PER_SPLIT})", "",
             f"| batch | adapters | unfused ({14 * LAYERS} launches) | packed, block-diagonal B ({8 * LAYERS}) "
             f"| packed, B by part ({8 * LAYERS}; the engine) |", "| ---: | ---: | ---: | ---: | ---: |"]

    def emit(line):
        lines.append(line)
        print(line, flush=True)

    for t in batches:
        for n in spreads:
            ms = [step_ms(t, n, lay, stacks[lay], device) for lay in layouts]
            emit(f"| {t} | {n} | {ms[0]:.3f} | {ms[1]:.3f} | {ms[2]:.3f} |")
    heads = [str(s) for s in splits] + ["all of K"]
    emit("")
    emit("### The shrink's K columns a program (K_PER_SPLIT), packed with B by part")
    emit("")
    emit("| batch | adapters | " + " | ".join(heads) + " | best |")
    emit("| ---: | ---: | " + " | ".join("---:" for _ in heads) + " | ---: |")
    for t in batches:
        for n in spreads:
            ms = [step_ms(t, n, "by-part", stacks["by-part"], device, s) for s in (*splits, 1 << 20)]
            emit(f"| {t} | {n} | " + " | ".join(f"{m:.3f}" for m in ms) + f" | {heads[ms.index(min(ms))]} |")
    if with_base:
        del stacks["unfused"], stacks["block-diagonal"]
        base = _base_weights(device)
        emit("")
        emit("### With the base GEMMs (cuBLAS, the 8B's four projections a layer), packed with B by part")
        emit("")
        emit("| batch | adapters | base alone | base + LoRA, one stream | shrinks on a second stream (the engine) "
             "| LoRA's share hidden |")
        emit("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for t in batches:
            alone = step_ms(t, 0, "by-part", stacks["by-part"], device, base=base)
            for n in spreads:
                serial = step_ms(t, n, "by-part", stacks["by-part"], device, base=base)
                forked = step_ms(t, n, "by-part", stacks["by-part"], device, base=base, overlap=True)
                hidden = (serial - forked) / (serial - alone) if serial > alone else 0.0
                emit(f"| {t} | {n} | {alone:.3f} | {serial:.3f} ({serial / alone:.2f}x) | {forked:.3f} "
                     f"({forked / alone:.2f}x) | {100 * hidden:.0f}% |")
    return lines
