"""Host time to plan an eager step's inputs (ModelRunner._plan_eager + _eager_inputs), on CPU, for
several trees side by side.

    python tools/prefill_inputs_host.py --tree new=. [--tree old=/path/to/older] [--rounds 5] [--reps 50]

What a prefill costs the host before its first kernel: per token, the input id, position and KV
slot lists and their host tensors. An idle engine pays it in the prompt's TTFT; a busy one in
host time per step. Each tree is imported from a link farm (tools/sync_step_host.py's) in its own
subprocess; the trees take turns `--rounds` times. Requests are stand-ins with the fields the
planner reads (no model, no engine), 16 tokens a block; the steps:

- prefill 16 x 1024: bench/engine.py's offline step (16k tokens, 16 prompts);
- prefill 1 x 16384: one long prompt's chunk;
- decode 256 x 1: an eager decode step (the CPU engine's, or a GPU step without graphs);
- mixed 255 + 1024: 255 decodes beside a 1024-token chunk.

Median µs over `--reps` calls in a run, then the median of the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.sync_step_host import link_farm  # noqa: E402

STEPS = {"prefill 16 x 1024": [1024] * 16, "prefill 1 x 16384": [16384], "decode 256 x 1": [1] * 256,
         "mixed 255 + 1024": [1] * 255 + [1024]}

CHILD = r"""
import json, statistics, sys, time, types
import torch
from pdserve.worker.executor.model_runner import ModelRunner

steps, reps = json.loads(sys.argv[1]), int(sys.argv[2])
BS = 16

def request(i, n):
    ctx = 1100 if n == 1 else n  # a decode row: ~1100 tokens of context behind it
    r = types.SimpleNamespace(request_id=f"r{i}", num_computed_tokens=ctx - n, token_ids=list(range(3, 3 + ctx)),
                              num_scheduled_tokens=ctx, lora_name=None,
                              params=types.SimpleNamespace(prompt_logprobs=None))
    r.block_ids = list(range(i * 1100, i * 1100 + -(-ctx // BS)))
    return r

runner = types.SimpleNamespace(block_size=BS, kv_groups=None, lora=None, _step_lora={}, device=torch.device("cpu"),
                               _backend=None)
runner._tensor = lambda data, dtype: ModelRunner._tensor(runner, data, dtype)
out = {}
for name, rows in steps.items():
    batch = types.SimpleNamespace(items=[(request(i, n), n) for i, n in enumerate(rows)])
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        plan, _ = ModelRunner._plan_eager(runner, batch)
        ModelRunner._eager_inputs(runner, plan.inputs)
        ts.append(time.perf_counter() - t0)
    out[name] = 1e6 * statistics.median(ts)
print(json.dumps(out))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=PATH")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    tmp = tempfile.mkdtemp(prefix="prefill-inputs-")
    farms = {name: link_farm(os.path.abspath(path), os.path.join(tmp, name)) for name, path in trees.items()}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
            env = dict(os.environ, PYTHONPATH=farms[name], OMP_NUM_THREADS="1")
            proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(STEPS), str(args.reps)], env=env,
                                  capture_output=True, text=True, cwd=tmp)
            if proc.returncode:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            runs[name].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    names = list(trees)
    print(f"µs per step plan + host tensors, median of {args.rounds} rounds ({args.reps} calls each); "
          f"load average at the end {os.getloadavg()[0]:.1f}\n")
    print("| step | " + " | ".join(names) + " |")
    print("| --- |" + " ---: |" * len(names))
    for step in STEPS:
        print(f"| {step} | " + " | ".join(f"{statistics.median(x[step] for x in runs[n]):.0f}" for n in names) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
