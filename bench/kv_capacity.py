"""KV capacity at long prompts, with and without the sliding-window release (docs/kv-cache.md).

N requests of P prompt tokens and O output tokens go through the engine's own scheduler and
block manager; the table reports how many ran at once (peak), the most tokens whose KV was held
at once, preemptions and blocks, for the hybrid KV cache (sliding layers' blocks behind the
window released) and with --disable-hybrid-kv-cache-manager. Nothing here is assumed from a
formula: the counts are the allocator's.

Two ways to run it:
- `--engine` (a GPU): the real LLMEngine, weights random (`--load-format dummy`), so the KV cache
  is sized from the card's memory as serving sizes it and every step runs the model;
- default (anywhere, seconds): the scheduler and block manager alone, with the same memory
  (`--kv-cache-gib`) for both modes and each step's model run replaced by "the tokens were computed".

    python -m pdserve.bench.kv_capacity --model /models/gpt-oss-120b --engine --prompt-len 32768
    python -m pdserve.bench.kv_capacity --model /models/gpt-oss-20b --kv-cache-gib 40 --prompt-len 32768
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdserve.bench.report import markdown_table, publish

GiB = 1 << 30


@dataclass
class Capacity:
    mode: str
    num_blocks: int
    block_bytes: int
    peak_running: int = 0
    peak_tokens: int = 0  # sum of the running requests' tokens with KV, at the fullest step
    preemptions: int = 0
    steps: int = 0

    def observe(self, running) -> None:
        self.steps += 1
        self.peak_running = max(self.peak_running, len(running))
        self.peak_tokens = max(self.peak_tokens, sum(r.num_computed_tokens for r in running))


def prompts(n: int, length: int) -> list[list[int]]:
    """Distinct prompts (no prefix shared across requests: capacity, not cache hits)."""
    return [[(7919 * i + 31 * j) % 30000 + 100 for j in range(length)] for i in range(n)]


def simulate(model_config, hybrid: bool, kv_bytes: int, n: int, prompt_len: int, output_len: int,
             block_size: int = 16, dtype_bytes: int = 2, max_num_seqs: int = 256,
             max_num_batched_tokens: int = 8192) -> Capacity:
    """The scheduler and block manager over `kv_bytes` of KV cache, without a model."""
    import torch

    from pdserve.worker.attention.kv_cache import KVCache
    from pdserve.worker.attention.kv_groups import KVGroups
    from pdserve.worker.engine.block_manager import BlockManager
    from pdserve.worker.engine.hybrid_block_manager import HybridBlockManager
    from pdserve.worker.engine.scheduler import Scheduler
    from pdserve.worker.request.request import Request
    from pdserve.worker.request.sampling_params import SamplingParams

    groups = KVGroups.of(model_config) if hybrid else None
    dtype = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}[dtype_bytes]
    per_block = KVCache.bytes_per_block(model_config, block_size, dtype, groups)
    num_blocks = kv_bytes // per_block
    bm = (HybridBlockManager(num_blocks, block_size, groups, enable_prefix_caching=False) if groups is not None
          else BlockManager(num_blocks, block_size, enable_prefix_caching=False))
    sched = Scheduler(bm, max_num_seqs, max_num_batched_tokens, prompt_len + output_len + 1)
    cap = Capacity("hybrid" if groups is not None else "every layer", num_blocks, per_block)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts(n, prompt_len)):
        sched.add(Request(str(i), p, params))
    while sched.has_work():
        batch = sched.schedule()
        if not batch.items:
            raise RuntimeError(f"{cap.mode}: nothing can run ({num_blocks} blocks for one {prompt_len}-token prompt?)")
        cap.observe(sched.running)
        sampled = {r.request_id: 1 for r, k in batch.items if r.num_computed_tokens + k == r.num_tokens}
        sched.update(batch, sampled)
    cap.preemptions = sched.num_preemptions
    return cap


def run_engine(model: str, hybrid: bool, n: int, prompt_len: int, output_len: int, **engine_kw) -> Capacity:
    """The real engine (random weights) on this machine's device: the KV cache sized as serving sizes it."""
    from pdserve.worker.config.engine import EngineConfig
    from pdserve.worker.engine.llm_engine import LLMEngine
    from pdserve.worker.request.sampling_params import SamplingParams

    config = EngineConfig(model=model, load_format="dummy", max_model_len=prompt_len + output_len,
                          disable_hybrid_kv_cache_manager=not hybrid, enable_prefix_caching=False, **engine_kw)
    engine = LLMEngine(config)
    try:
        cap = Capacity("hybrid" if engine.runner.kv_groups is not None else "every layer",
                       engine.block_manager.num_blocks, engine.kv_cache.block_bytes)
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts(n, prompt_len)):
            engine.add_request(str(i), p, params)
        while engine.has_work():
            engine.step()
            cap.observe(engine.scheduler.running)
        cap.preemptions = engine.scheduler.num_preemptions
        return cap
    finally:
        engine.shutdown()


def table(caps: list[Capacity], n: int, prompt_len: int, output_len: int) -> str:
    rows = [[c.mode, str(c.num_blocks), f"{c.block_bytes / 2**20:.2f}", f"{c.num_blocks * c.block_bytes / GiB:.2f}",
             str(c.peak_running), str(c.peak_tokens), str(c.preemptions), str(c.steps)] for c in caps]
    head = ["KV cache", "blocks", "MiB/block", "GiB", "peak running", "peak tokens held", "preemptions", "steps"]
    return (f"{n} requests x {prompt_len} prompt + {output_len} output tokens\n\n"
            + markdown_table(head, rows, right=set(range(1, 8))))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (config.json is enough without --engine)")
    ap.add_argument("--engine", action="store_true", help="run the real engine (--load-format dummy)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32768)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--kv-cache-gib", type=float, default=40.0, help="without --engine: the KV cache's memory")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256, help="high enough that memory, not this, binds")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="with --engine")
    ap.add_argument("--out", help="also write the table here")
    args = ap.parse_args(argv)
    caps = []
    for hybrid in (True, False):
        if args.engine:
            caps.append(run_engine(args.model, hybrid, args.requests, args.prompt_len, args.output_len,
                                   block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                                   max_num_seqs=args.max_num_seqs,
                                   gpu_memory_utilization=args.gpu_memory_utilization))
        else:
            from transformers import AutoConfig

            from pdserve.worker.config.model import ModelConfig

            cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(args.model))
            caps.append(simulate(cfg, hybrid, int(args.kv_cache_gib * GiB), args.requests, args.prompt_len,
                                 args.output_len, args.block_size, max_num_seqs=args.max_num_seqs,
                                 max_num_batched_tokens=args.max_num_batched_tokens))
    publish(table(caps, args.requests, args.prompt_len, args.output_len), args.out)


if __name__ == "__main__":
    main()
