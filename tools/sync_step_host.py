"""The synchronous engine step's host time outside the model forward, on CPU, for two trees side by side.

    python tools/sync_step_host.py --tree new=/path/to/checkout [--tree old=/path/to/older] \
        [--rounds 3] [--steps 200] [--batches 1 64 256] [--profile DIR]

Each tree is imported from a link farm of its top-level folders (as tools/gpu/lib.sh builds), in
its own subprocess; the trees take turns, `--rounds` times, so a drift in the machine's load lands
on both. The engine runs a tiny random Qwen2 on CPU with async scheduling off and the decode
graphs' static-buffer path (`static_decode=True`: the buffers and padding of a CUDA-graph step,
the forward called instead of replayed). The model forward is a stub that returns zeros of the
right shape, and the whole of `DecodeGraphs._forward` (what a graph replay replaces on a GPU) is
timed and subtracted: what is left is everything else the host does per step (scheduling, input
planning, the step's copies, sampling, reading the tokens back, the requests' bookkeeping,
outputs). The logits projection stays real (tiny here; on a GPU a launch) and is reported apart.
"Exposed" is the part a GPU would idle through: from the step's start to the replay, and from the
tokens' read-back (where the host waits for the device) to the step's end; the host work between
the replay and the wait (logits, sampling launches, the read-back's setup) overlaps the device.

Per batch size B: B greedy requests of 16 prompt tokens decode `--steps` tokens; the steps where
all B decode are timed, per phase (median us/step; the host total and the exposed part also
at their 10th percentile: on a shared machine other processes only ever add time). `--profile`:
cProfile of the same steps, per function tottime in us/step, written per tree and batch size.
Numbers name this machine only: CUDA syncs, pinned copies and kernel launches are absent here
(the docs page that reports a run says which ones the GPU path adds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import collections, cProfile, json, pstats, statistics, sys, time
import torch
torch.set_num_threads(1)
ckpt, batches, steps, prof_dir, tag = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
kv_bytes = int(sys.argv[6])
try:
    from pdserve.worker.engine.llm_engine import LLMEngine
    from pdserve.worker.config.engine import EngineConfig
    from pdserve.worker.request.sampling_params import SamplingParams
except ImportError:  # the tree of 2026-11-26
    from pdserve.worker.engine import LLMEngine
    from pdserve.worker.config import EngineConfig
    from pdserve.worker.sampling_params import SamplingParams
kw = dict(model=ckpt, device="cpu", dtype="float32", max_model_len=512, max_num_seqs=max(batches),
          max_num_batched_tokens=8192, enable_prefix_caching=False, kv_cache_memory=kv_bytes)
if "async_scheduling" in EngineConfig.__dataclass_fields__:
    kw["async_scheduling"] = False
engine = LLMEngine(EngineConfig(**kw), attention_backend="torch", static_decode=True)
model = engine.runner.model
runner, graphs, scheduler = engine.runner, engine.runner.graphs, engine.scheduler
zeros = torch.zeros(max(batches) * 64 + 8192, engine.model_config.hidden_size)
def stub_forward(input_ids, positions, meta, *a, **k):
    return zeros[: input_ids.shape[0]]
model.forward = stub_forward
acc = collections.defaultdict(float)  # phase -> seconds so far
marks = {}
def timed(obj, name, key, mark_start=None, mark_end=None):
    real = getattr(obj, name)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        if mark_start:
            marks[mark_start] = t0
        out = real(*a, **k)
        t1 = time.perf_counter()
        if mark_end:
            marks[mark_end] = t1
        acc[key] += t1 - t0
        return out
    setattr(obj, name, wrapper)
# On a GPU the whole of DecodeGraphs._forward (metadata views and the forward) is the graph replay.
timed(graphs, "_forward", "forward", mark_start="replay")
timed(graphs, "run", "graph_run")
timed(model, "compute_logits", "logits")
timed(runner, "_plan_graph", "plan")
timed(scheduler, "schedule", "schedule")
timed(scheduler, "update", "update")
timed(engine, "_output", "outputs")
# Where the host waits for the step's token ids on a GPU: main's collect(), the old tree's run()
# (its .tolist() at the end). What runs after it, and before the replay, is exposed: the device
# idles through it. Between the replay and the wait the host overlaps the device.
if hasattr(runner, "collect"):
    timed(runner, "launch", "runner")
    timed(runner, "collect", "runner", mark_end="read")
else:
    timed(runner, "run", "runner", mark_end="read")
PHASES = ("schedule", "plan", "graph_inputs", "logits", "sample_readback", "update", "outputs", "engine_rest",
          "host", "exposed", "forward")
vocab = engine.model_config.vocab_size
result = {}
for B in batches:
    for warm in (True, False):
        params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
        for i in range(B):
            engine.add_request(f"{tag}-{B}-{warm}-{i}", [(7 * i + j) % (vocab - 3) + 3 for j in range(16)], params)
        per = {k: [] for k in PHASES}
        prof = cProfile.Profile() if (prof_dir and not warm) else None
        while engine.has_work():
            running = len(scheduler.running)
            waiting = scheduler.num_waiting + len(engine._inbox)
            decode = running == B and waiting == 0 and all(r.num_computed_tokens > r.num_prompt_tokens
                                                          for r in scheduler.running)
            before = dict(acc)
            if decode and prof is not None:
                prof.enable()
            t0 = time.perf_counter()
            engine.step()
            t1 = time.perf_counter()
            if decode and prof is not None:
                prof.disable()
            if not decode:
                continue
            d = {k: acc[k] - before.get(k, 0.0) for k in list(acc)}
            g = lambda k: d.get(k, 0.0)
            phase = dict(schedule=g("schedule"), plan=g("plan"), graph_inputs=g("graph_run") - g("forward"),
                         logits=g("logits"), update=g("update"), outputs=g("outputs"), forward=g("forward"))
            phase["sample_readback"] = g("runner") - g("plan") - g("graph_run") - g("logits")
            phase["host"] = (t1 - t0) - g("forward")
            phase["engine_rest"] = (t1 - t0) - g("runner") - g("schedule") - g("update") - g("outputs")
            phase["exposed"] = (marks["replay"] - t0) + (t1 - marks["read"])
            for k in PHASES:
                per[k].append(phase[k])
    result[B] = {k: 1e6 * statistics.median(v) for k, v in per.items()} | {"steps": len(per["host"])}
    # The 10th percentile: on a shared machine other processes only ever add time.
    result[B] |= {k + "_p10": 1e6 * statistics.quantiles(per[k], n=10)[0] for k in ("host", "exposed")}
    if prof is not None:
        st = pstats.Stats(prof)
        rows = []
        n = result[B]["steps"]
        for (fn, line, name), (cc, nc, tt, ct, callers) in st.stats.items():
            short = fn.split("/pdserve/")[-1] if "/pdserve/" in fn else fn.rsplit("/", 1)[-1]
            rows.append((f"{short}:{name}", nc / n, 1e6 * tt / n, 1e6 * ct / n))
        with open(f"{prof_dir}/{tag}-bs{B}.json", "w") as f:
            json.dump(rows, f)
print(json.dumps(result))
"""


LABELS = {
    "schedule": "Scheduler.schedule",
    "plan": "ModelRunner._plan_graph",
    "graph_inputs": "DecodeGraphs.run without the forward (the step's input copies)",
    "logits": "compute_logits (CPU: the projection itself; GPU: its launch)",
    "sample_readback": "the runner's rest: execute, argmax, reading the ids back",
    "update": "Scheduler.update",
    "outputs": "LLMEngine._output, all requests",
    "engine_rest": "the engine's rest (step(), loops, connector, bookkeeping)",
    "host": "**host total** (step minus forward)",
    "exposed": "**exposed** (before the replay + after the read-back)",
    "host_p10": "host total, 10th percentile of the steps",
    "exposed_p10": "exposed, 10th percentile of the steps",
    "forward": "the forward (stub; subtracted)",
}


def link_farm(tree: str, root: str) -> str:
    farm = os.path.join(root, "pdserve")
    os.makedirs(farm)
    for d in ("worker", "kernels", "bench", "protocol", "router", "cli"):
        if os.path.isdir(os.path.join(tree, d)):
            os.symlink(os.path.join(tree, d), os.path.join(farm, d))
    return root


def make_checkpoint(path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {f"t{i}": i for i in range(256)}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")),
                            unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=PATH")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--profile", help="write per-function cProfile rows (JSON) here")
    ap.add_argument("--kv-mib", type=int, default=64,
                    help="KV cache MiB (4 KiB blocks: the default 64 is 16k blocks; an H200 holds 673k of the 0.5B's)")
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    tmp = tempfile.mkdtemp(prefix="sync-step-host-")
    ckpt = os.path.join(tmp, "ckpt")
    make_checkpoint(ckpt)
    farms = {name: link_farm(os.path.abspath(path), os.path.join(tmp, name)) for name, path in trees.items()}
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name in (list(trees) if r % 2 == 0 else list(reversed(trees))):
            env = dict(os.environ, PYTHONPATH=farms[name], OMP_NUM_THREADS="1")
            prof = args.profile if (args.profile and r == 0) else ""
            out = subprocess.run([sys.executable, "-c", CHILD, ckpt, json.dumps(args.batches), str(args.steps),
                                  prof, name, str(args.kv_mib << 20)], env=env, capture_output=True, text=True, cwd=tmp)
            if out.returncode:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r} {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    print(f"load average (1, 5, 15 min) at the end: {os.getloadavg()}")
    print("\nus/step, median over the steps of a run, then the median of the rounds; host = the step minus the forward "
          "(each round's host in brackets)\n")
    names = list(trees)
    for b in args.batches:
        print(f"batch {b}\n")
        print("| phase | " + " | ".join(names) + " |")
        print("| --- |" + " ---: |" * len(names))
        for k in LABELS:
            cells = []
            for n in names:
                vals = [x[str(b)][k] for x in runs[n]]
                cell = f"{statistics.median(vals):.1f}"
                if k == "host":
                    cell += " (" + ", ".join(f"{v:.1f}" for v in vals) + ")"
                cells.append(cell)
            print(f"| {LABELS[k]} | " + " | ".join(cells) + " |")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
