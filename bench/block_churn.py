"""Block runs after churn: how many runs (one NIXL descriptor each) a new request's blocks form
once the BlockManager has turned the cache over, by eviction policy. CPU only, no timings asserted.

The workload (also the `real` layout of kv_transfer.py): requests of 1..num_blocks/32 blocks with
unique prompts (their full blocks enter the prefix cache when freed, the partial last block goes
back empty), one decode block for a random live request after each arrival, and random finishes,
turning the cache over about four times; then live requests finish at random until the pull's n
blocks are free, and a new request of n blocks is allocated. The pull pairs two such allocations
(prefill and decode sides, different seeds): its descriptors are the runs of (source,
destination) pairs that merge (block_runs.merge_runs), which is what NIXL posts.

    python -m pdserve.bench.block_churn                      # the table
    python -m pdserve.bench.block_churn --smoke              # seconds
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from pdserve.bench.report import publish

CHURN_BLOCK_SIZE = 16  # tokens per block (only the block ids matter)
GiB = 1 << 30


def churned_blocks(num_blocks: int, n: int, seed: int, eviction_slack: float = 0.0,
                   timings: list[float] | None = None) -> list[int]:
    """The block ids a new n-block request gets after the churn workload (module docstring).
    `timings` (if given) gets the seconds of every allocate call, per block allocated."""
    from pdserve.worker.engine.block_manager import BlockManager
    from pdserve.worker.request.request import Request
    from pdserve.worker.request.sampling_params import SamplingParams

    rng = random.Random(seed)
    bs = CHURN_BLOCK_SIZE
    bm = BlockManager(num_blocks, bs, **({"eviction_slack": eviction_slack} if eviction_slack else {}))
    params = SamplingParams(max_tokens=1 << 20)
    live: list[Request] = []
    next_token = 0

    def tokens(k: int) -> list[int]:
        nonlocal next_token
        next_token += k
        return list(range(next_token - k, next_token))  # unique: no accidental prefix hits

    def run(r: Request, num_tokens: int) -> None:
        need = bm.blocks_needed(num_tokens) - len(r.block_ids)
        t = time.perf_counter()
        bm.allocate(r, num_tokens)
        if timings is not None and need > 0:
            timings.append((time.perf_counter() - t) / need)
        r.num_computed_tokens = num_tokens
        bm.register_computed(r)

    max_req = max(2, num_blocks // 32)
    for i in range(8 * 32):
        if live and rng.random() < 0.4:
            bm.free_request(live.pop(rng.randrange(len(live))))
            continue
        r = Request(f"c{i}", tokens(rng.randint(1, max_req) * bs - rng.randrange(bs)), params)
        if not bm.can_allocate(r, r.num_tokens):
            if live:
                bm.free_request(live.pop(rng.randrange(len(live))))
            continue
        run(r, r.num_tokens)
        live.append(r)
        grow = rng.choice(live)  # a running request decodes into a new block
        grow.token_ids += tokens(bs)
        if bm.can_allocate(grow, grow.num_tokens):
            run(grow, grow.num_tokens)
        else:
            del grow.token_ids[-bs:]
    while bm.num_free_blocks < n:
        bm.free_request(live.pop(rng.randrange(len(live))))
    target = Request("target", tokens(n * bs), params)
    run(target, n * bs)
    return target.block_ids


def num_runs(src: list[int], dst: list[int]) -> int:
    from pdserve.worker.kv.block_runs import merge_runs

    return len(merge_runs(src, dst))


def measure(num_blocks: int, n: int, slack: float, seeds: int, block_bytes: int) -> dict[str, float]:
    """Means over seeds of one side's runs, the pull's descriptors, and allocate's cost per block."""
    side, pair, per_block = [], [], []
    for seed in range(seeds):
        t: list[float] = []
        src = churned_blocks(num_blocks, n, 2 * seed, slack, t)
        dst = churned_blocks(num_blocks, n, 2 * seed + 1, slack)
        side.append(num_runs(src, src))
        pair.append(num_runs(src, dst))
        per_block.append(statistics.mean(t))
    d = statistics.mean(pair)
    return {"side": statistics.mean(side), "desc": d, "run": n / d, "per_gib": d * GiB / (n * block_bytes),
            "us": statistics.mean(per_block) * 1e6}


def fragmented_allocate_us(num_blocks: int, n: int) -> float:
    """Microseconds per block to allocate n blocks where every other block of the cache is free
    and empty (the worst case for a scan: num_blocks / 2 runs of one block)."""
    from pdserve.worker.engine.block_manager import BlockManager
    from pdserve.worker.request.request import Request
    from pdserve.worker.request.sampling_params import SamplingParams

    bs, params = CHURN_BLOCK_SIZE, SamplingParams(max_tokens=1)
    bm = BlockManager(num_blocks, bs, enable_prefix_caching=False)
    reqs = [Request(f"f{i}", [0] * bs, params) for i in range(num_blocks)]
    for r in reqs:
        bm.allocate(r, bs)
    for r in reqs[::2]:
        bm.free_request(r)
    target = Request("target", [0] * (n * bs), params)
    t = time.perf_counter()
    bm.allocate(target, n * bs)
    return (time.perf_counter() - t) / n * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench block-churn", description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["8192:256", "8192:4096", "2048:1024", "100000:4096"],
                    help="CACHE_BLOCKS:PULL_BLOCKS (8192:4096 is kv_transfer.py's 1 GiB real row)")
    ap.add_argument("--slack", type=float, nargs="+", default=[0.0, 0.5, 1.0, 3.0],
                    help="BlockManager eviction_slack values (0: strict LRU, the default)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--block-kib", type=int, default=256, help="bytes per block, for descriptors per GiB")
    ap.add_argument("--smoke", action="store_true", help="one small case, one seed")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.cases, args.seeds, args.slack = ["2048:512"], 1, [0.0, 1.0]
    cases = []
    for c in args.cases:
        try:
            cache, pull = (int(x) for x in c.split(":"))
        except ValueError:
            ap.error(f"--cases: {c!r} is not CACHE_BLOCKS:PULL_BLOCKS")
        if not 0 < pull <= cache // 2 or cache < 64:
            ap.error(f"--cases {c}: the pull must be at most half a cache of >= 64 blocks")
        cases.append((cache, pull))
    if args.seeds < 1 or min(args.slack) < 0:
        ap.error("--seeds must be >= 1 and --slack >= 0")
    bb = args.block_kib * 1024
    lines = [f"# Block runs after churn ({args.block_kib} KiB blocks, mean of {args.seeds} seeds)", "",
             "| cache blocks | pull blocks | pull MiB | eviction slack | runs per side | descriptors (pairs) "
             "| mean run (blocks) | descriptors per GiB | allocate µs per block |", "|---" * 9 + "|"]
    for cache, pull in cases:
        for slack in args.slack:
            m = measure(cache, pull, slack, args.seeds, bb)
            lines.append(f"| {cache} | {pull} | {pull * bb / (1 << 20):.0f} | {slack:g} | {m['side']:.1f} | "
                         f"{m['desc']:.1f} | {m['run']:.1f} | {m['per_gib']:.1f} | {m['us']:.2f} |")
    lines += ["", "Allocating the pull's blocks where every other block is free (one-block runs only):", "",
              "| cache blocks | pull blocks | allocate µs per block |", "|---|---|---|"]
    for cache, pull in cases:
        lines.append(f"| {cache} | {pull} | {fragmented_allocate_us(cache, pull):.2f} |")
    publish("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
